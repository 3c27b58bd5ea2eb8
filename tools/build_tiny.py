"""Build the deterministic tiny models and print where they are.

    python tools/build_tiny.py                  # all of them, into the cache
    python tools/build_tiny.py tiny tiny-bert   # some of them
    python tools/build_tiny.py --out models/    # into models/<name>, rebuilt
    python tools/build_tiny.py --check tiny     # also: parameters and near-tie statistics

The cache is $MPENGINE_CACHE_DIR/models (default ~/.cache/mpengine/models). `--check`
decodes a few prompts greedily and reports how far apart the two largest logits are: a
gap below ~1e-4 is a near-tie that numerical noise in a correct engine could flip.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from mpengine.models.resolve import resolve_model
from mpengine.models.tiny import KNOWN_MODELS, build, greedy_margins

CHECK_PROMPTS = (
    "The lighthouse keeper counted the steps",
    "def fibonacci(n):",
    "Bonjour, comment ça va ?",
    "今天天气很好",
    "1, 2, 3, 4,",
    "Once upon a time",
    "SELECT name FROM users WHERE",
    "🎉 Party time",
    "Q: Why is the sky blue?\nA:",
    "Привет, мир",
)


def check(path: Path, is_causal_lm: bool, num_steps: int) -> str:
    """Parameter count and, for a causal LM, greedy top-2 logit gap statistics."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    auto_class = AutoModelForCausalLM if is_causal_lm else AutoModel
    model = auto_class.from_pretrained(path).eval()
    report = f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params"
    if not is_causal_lm:
        return report
    tokenizer = AutoTokenizer.from_pretrained(path)
    gaps: list[float] = []
    distinct: list[int] = []
    for prompt in CHECK_PROMPTS:
        tokens, prompt_gaps = greedy_margins(model, tokenizer(prompt)["input_ids"], num_steps)
        gaps += prompt_gaps
        distinct.append(len(set(tokens)))
    near = sum(gap < 1e-4 for gap in gaps)
    return (
        f"{report}, {len(gaps)} greedy steps: median top-2 gap {statistics.median(gaps):.3f},"
        f" min {min(gaps):.1e}, {near} below 1e-4;"
        f" distinct tokens per {num_steps}: {statistics.median(distinct)} (median)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", help=f"models to build (default: all of {list(KNOWN_MODELS)})"
    )
    parser.add_argument("--out", type=Path, help="build into OUT/<name> instead of the cache")
    parser.add_argument(
        "--check", action="store_true", help="load each model and report statistics"
    )
    parser.add_argument("--steps", type=int, default=32, help="greedy steps per prompt for --check")
    args = parser.parse_args()
    names = args.names or list(KNOWN_MODELS)
    unknown = [name for name in names if name not in KNOWN_MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {list(KNOWN_MODELS)}")
    for name in names:
        arch, preset = KNOWN_MODELS[name]
        start = time.perf_counter()
        path = Path(build(arch, args.out / name, preset) if args.out else resolve_model(name))
        line = f"{name}\t{path}\t{time.perf_counter() - start:.2f}s"
        if args.check:
            line += "\t" + check(path, arch != "bert", args.steps)
        print(line, flush=True)


if __name__ == "__main__":
    main()
