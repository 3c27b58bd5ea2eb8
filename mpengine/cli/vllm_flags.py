"""The flags of ``vllm serve`` that deployment scripts pass and this engine has no flag of
its own for: one table, so that what each does here stays written in one place.

Every flag of the table is accepted by ``mpengine serve``. Given with a value this engine
serves as asked (``-tp 1``, ``--kv-cache-dtype auto``), it is silent; given where it has no
effect here, it is named in one start-up note with the reason; given with a value that
cannot be honoured (``-pp 2``, ``--kv-cache-dtype fp8``, ``--enable-lora``), serving is
refused at once, with the reason. The flags that map onto the engine's own (``--dtype
half``, ``--enable-prefix-caching``, ``--max-model-len 4k``...) are engine flags
(``cli.args``), not listed here.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

SWITCH = "switch"  # a flag without a value (store_true)


@dataclass(frozen=True, slots=True)
class VllmFlag:
    """One of vLLM's flags: its spellings, what it takes, the values served as asked, and
    what it does here: ``refused`` (other values stop the start with ``why``) or not (they
    are named in the start-up note with ``why``)."""

    names: tuple[str, ...]
    kind: type | str  # int, str, or SWITCH
    why: str
    served: tuple[object, ...] = ()
    refused: bool = False

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[0].lstrip("-").replace("-", "_")


NO_PIPELINE = "layers are not split in stages: -tp splits every layer instead"
OFFLINE = "models load offline, as they are on disk"

TABLE: tuple[VllmFlag, ...] = (
    VllmFlag(("--pipeline-parallel-size", "-pp"), int, NO_PIPELINE, served=(1,), refused=True),
    VllmFlag(
        ("--kv-cache-dtype",),
        str,
        "the KV cache has the model's dtype (--dtype)",
        served=("auto",),
        refused=True,
    ),
    VllmFlag(
        ("--quantization", "-q"),
        str,
        "weights run in the model's dtype (GGUF files are dequantized)",
        served=("None", "none"),
        refused=True,
    ),
    VllmFlag(
        ("--load-format",),
        str,
        "models load from safetensors, PyTorch or GGUF files",
        served=("auto", "safetensors", "pt", "gguf"),
        refused=True,
    ),
    VllmFlag(("--enable-lora",), SWITCH, "LoRA adapters are not supported", refused=True),
    VllmFlag(("--lora-modules",), str, "LoRA adapters are not supported", refused=True),
    VllmFlag(("--hf-overrides",), str, "a model's config is used as it is", refused=True),
    VllmFlag(
        ("--trust-remote-code",),
        SWITCH,
        "models run with transformers' own classes; a model's own code is never run",
    ),
    VllmFlag(("--revision",), str, OFFLINE),
    VllmFlag(("--code-revision",), str, OFFLINE),
    VllmFlag(("--tokenizer-revision",), str, OFFLINE),
    VllmFlag(("--download-dir",), str, OFFLINE),
    VllmFlag(("--tokenizer-mode",), str, "the model's fast tokenizer is used", served=("auto",)),
    VllmFlag(("--disable-log-stats",), SWITCH, "the engine logs no periodic stats (/metrics)"),
    VllmFlag(("--enable-chunked-prefill",), SWITCH, "prefills are always chunked"),
    VllmFlag(("--max-logprobs",), int, "logprobs are bounded at 20 for every request"),
    VllmFlag(("--max-seq-len-to-capture",), int, "CUDA graphs cover every decode batch size"),
    VllmFlag(("--num-scheduler-steps",), int, "the scheduler plans every step", served=(1,)),
    VllmFlag(("--compilation-config", "-O"), str, "see --compile-decode and --enforce-eager"),
    VllmFlag(("--disable-custom-all-reduce",), SWITCH, "collectives are torch.distributed's"),
    VllmFlag(("--disable-frontend-multiprocessing",), SWITCH, "the HTTP server is one process"),
    VllmFlag(("--max-parallel-loading-workers",), int, "a model loads in one process"),
    VllmFlag(("--enable-sleep-mode",), SWITCH, "the engine does not sleep"),
    VllmFlag(("--reasoning-parser",), str, "reasoning text stays in the message's content"),
    VllmFlag(("--enable-prompt-tokens-details",), SWITCH, "usage reports no cached tokens"),
    VllmFlag(
        ("--return-tokens-as-token-ids",),
        SWITCH,
        "a request asks for it (return_tokens_as_token_ids)",
    ),
    VllmFlag(("--root-path",), str, "the API is served at /"),
)


def add_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of :data:`TABLE`, in a group of its own."""
    group = parser.add_argument_group(
        "vLLM's flags", "accepted as `vllm serve` takes them; what each does here:"
    )
    for flag in TABLE:
        if flag.kind == SWITCH:
            help_text = f"{'refused' if flag.refused else 'no effect'}: {flag.why}"
            group.add_argument(*flag.names, dest=flag.dest, action="store_true", help=help_text)
            continue
        served = ", ".join(map(str, flag.served))
        what = "other values refused" if flag.refused else "no effect"
        help_text = f"{served} as asked; {what}: {flag.why}" if served else f"{what}: {flag.why}"
        metavar = "N" if flag.kind is int else "VALUE"
        group.add_argument(
            *flag.names, dest=flag.dest, type=flag.kind, metavar=metavar, help=help_text
        )


def check(args: argparse.Namespace) -> None:
    """Refuse a flag whose value cannot be honoured (``SystemExit``, one line); name those
    that have no effect in one note on stderr."""
    ignored = []
    for flag in TABLE:
        value = getattr(args, flag.dest, None)
        if value is None or value is False or value in flag.served or str(value) in flag.served:
            continue
        shown = flag.names[0] if value is True else f"{flag.names[0]} {value}"
        if flag.refused:
            raise SystemExit(f"mpengine: {shown} cannot be served: {flag.why}")
        ignored.append(f"{shown} ({flag.why})")
    if ignored:
        print(f"mpengine: note: no effect here: {'; '.join(ignored)}", file=sys.stderr)
