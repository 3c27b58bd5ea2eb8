"""``mpengine generate [MODEL]``: complete prompts and print them (the prompt and its
completion, or one JSON object per sample), with an engine it launches or a running one
(``--address``: IPC, or ``mpengine serve``'s URL)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from mpengine.cli.args import add_text_command_args, command_logging, prepare_text_command
from mpengine.cli.remote import engine_client, request_params


def add_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser(
        "generate",
        help="complete prompts and print them, with an engine it launches (or a running one: "
        "--address)",
    )
    gen.add_argument(
        "--prompt", action="append", help="a prompt (repeatable; default 'The quick brown fox')"
    )
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--json", action="store_true", help="print one JSON object per sample")
    add_text_command_args(gen, "complete the prompts with")
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    prepare_text_command(args)
    prompts = args.prompt or ["The quick brown fox"]
    stream = args.stream and len(prompts) == 1 and args.n == 1 and not args.json
    if args.stream and not stream:
        print(
            "mpengine: --stream prints one prompt's text with n = 1, not as --json; "
            "printing the outputs when they are done",
            file=sys.stderr,
        )
    with command_logging(args.log_level, "generate"), engine_client(args) as client:
        params = request_params(client, args)
        start = time.perf_counter()
        if stream:
            outputs = [_stream(client, prompts[0], params, args.logprobs is not None)]
        else:
            outputs = client.generate_many(prompts, params)
        elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs, strict=True):
        for sample in out.outputs:
            if stream:
                _print_tokens(sample)
            elif args.json:
                print(json.dumps(_record(prompt, sample), ensure_ascii=False))
            else:
                print(f"{prompt}{sample.text}")
                _print_tokens(sample)
    num_tokens = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    print(
        f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tokens/s)",
        file=sys.stderr,
    )
    failed = [s for o in outputs for s in o.outputs if s.finish_reason == "error"]
    for sample in failed:
        print(f"mpengine: sample {sample.index} failed: {sample.error}", file=sys.stderr)
    return 1 if failed else 0


def _stream(client, prompt: str, params, logprobs: bool):
    """Print the prompt and its text as it comes; the whole output."""
    from mpengine.client.outputs import CompletionOutput, RequestOutput

    whole = CompletionOutput(0, logprobs=[] if logprobs else None)
    sys.stdout.write(prompt)
    for delta in client.stream(prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        whole.text += delta.text
        whole.token_ids += delta.token_ids
        whole.finish_reason = delta.finish_reason
        whole.error = delta.outputs[0].error or whole.error
        if whole.logprobs is not None:
            whole.logprobs += delta.outputs[0].logprobs or []
    sys.stdout.write("\n")
    return RequestOutput("", [], [whole], finished=True)


def _record(prompt: str, sample) -> dict:
    """One sample as ``--json`` prints it."""
    record = {
        "prompt": prompt,
        "index": sample.index,
        "text": sample.text,
        "token_ids": sample.token_ids,
        "finish_reason": sample.finish_reason,
    }
    if sample.error is not None:
        record["error"] = sample.error
    if sample.logprobs is not None:
        # Per token: [token id, logprob] pairs, the sampled token first.
        record["logprobs"] = [list(map(list, step.items())) for step in sample.logprobs]
    return record


def _print_tokens(sample) -> None:
    """A sample's token count, finish reason and (when asked) each token's logprobs."""
    print(f"  [{len(sample.token_ids)} tokens, finish_reason={sample.finish_reason}]")
    for token_id, step in zip(sample.token_ids, sample.logprobs or [], strict=False):
        top = "  ".join(f"{t}:{lp:.3f}" for t, lp in step.items() if t != token_id)
        print(f"  {token_id}: {step.get(token_id, float('nan')):.3f}  top: {top}")
