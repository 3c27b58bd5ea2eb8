"""``mpengine embed TEXT...``: launch an engine with an embedding model, embed the texts,
print one JSON object per text."""

from __future__ import annotations

import argparse
import json
import sys
import time

from mpengine.cli.args import add_engine_args, config_from_args, validated


def add_parser(sub: argparse._SubParsersAction) -> None:
    embed = sub.add_parser(
        "embed",
        help="launch an engine with an embedding model, embed texts, print one JSON object "
        "per text",
    )
    embed.add_argument("text", nargs="+", help="a text to embed")
    # How to pool is the engine's --pooling (the model's default, which requests keep).
    group = embed.add_argument_group("embedding")
    group.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="L2-normalise the embeddings (default: the model's)",
    )
    group.add_argument(
        "--dimensions", type=int, default=None, help="keep the first N values (Matryoshka)"
    )
    group.add_argument(
        "--truncate-prompt-tokens",
        type=int,
        default=None,
        help="embed at most the first N tokens of each text (-1: as many as the model takes); "
        "by default a longer text is an error",
    )
    add_engine_args(embed)
    embed.set_defaults(func=cmd_embed)


def pooling_from_args(args: argparse.Namespace):
    from mpengine.protocol import PoolingParams

    return validated(
        lambda: PoolingParams(
            normalize=args.normalize,
            dimensions=args.dimensions,
            truncate_prompt_tokens=args.truncate_prompt_tokens,
        ),
        "pooling",
    )


def cmd_embed(args: argparse.Namespace) -> int:
    from mpengine.launch import Engine

    params = pooling_from_args(args)
    with Engine(config_from_args(args)) as engine, engine.client() as client:
        if client.info.pooling is None:
            if engine.config.pooling == "none":
                raise SystemExit("mpengine: --pooling none turns embeddings off")
            raise SystemExit(
                f"mpengine: the model {engine.config.model!r} cannot embed (give an embedding "
                "model, or --pooling last|mean|cls to pool a generation model's hidden states)"
            )
        start = time.perf_counter()
        outputs = client.embed_many(args.text, params)
        elapsed = time.perf_counter() - start
    for index, out in enumerate(outputs):
        record = {
            "index": index,
            "num_prompt_tokens": out.num_prompt_tokens,
            "embedding": out.embedding.tolist(),
        }
        print(json.dumps(record))
    num_tokens = sum(out.num_prompt_tokens for out in outputs)
    print(
        f"{len(outputs)} embeddings of {num_tokens} prompt tokens in {elapsed:.2f} s",
        file=sys.stderr,
    )
    return 0
