"""vLLM's flags: a deployment script's command line parses; each flag is served as asked,
named in one note where it has no effect, or refused with the reason; counts as vLLM
writes them."""

from __future__ import annotations

import argparse
import shlex

import pytest

from mpengine.cli import build_parser, config_from_args, vllm_flags
from mpengine.cli.args import parse_count

# What deployment scripts pass to `vllm serve` (a Kubernetes example, a systemd unit...).
DEPLOYMENT = shlex.split(
    "serve Qwen/Qwen3-0.6B --host 0.0.0.0 --port 8000 --trust-remote-code -tp 1 -pp 1 "
    "--disable-log-stats --enable-chunked-prefill --max-logprobs 20 --kv-cache-dtype auto "
    "--load-format auto --revision main --max-model-len 4k --gpu-memory-utilization 0.9 "
    "--max-num-seqs 128 --dtype half --enable-prefix-caching --reasoning-parser qwen3 "
    "--disable-log-requests --enable-log-requests --disable-uvicorn-access-log "
    "--uvicorn-log-level info --served-model-name qwen"
)


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def test_a_deployment_command_line_is_accepted_and_its_pointless_flags_named(capsys) -> None:
    args = parse(DEPLOYMENT)
    vllm_flags.check(args)
    note = capsys.readouterr().err
    assert note.count("mpengine: note: no effect here:") == 1  # one line, every flag in it
    for flag in ("--trust-remote-code", "--disable-log-stats", "--enable-chunked-prefill"):
        assert flag in note
    assert "--max-logprobs 20" in note and "--reasoning-parser qwen3" in note
    for served in ("--pipeline-parallel-size", "--kv-cache-dtype", "--load-format"):
        assert served not in note  # served as asked: nothing to say
    config = config_from_args(args)
    assert config.max_model_len == 4000 and config.dtype == "float16"
    assert args.enable_log_requests and args.disable_uvicorn_access_log


@pytest.mark.parametrize(
    "flags, reason",
    [
        (["-pp", "2"], "--pipeline-parallel-size 2 cannot be served: layers are not split"),
        (["--pipeline-parallel-size", "4"], "--pipeline-parallel-size 4 cannot be served"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 cannot be served: the KV cache has"),
        (["--quantization", "awq"], "--quantization awq cannot be served"),
        (["--enable-lora"], "--enable-lora cannot be served: LoRA adapters are not supported"),
        (["--load-format", "tensorizer"], "--load-format tensorizer cannot be served"),
    ],
)
def test_values_that_cannot_be_honoured_are_refused_with_the_reason(flags, reason) -> None:
    with pytest.raises(SystemExit) as refused:
        vllm_flags.check(parse(["serve", "tiny", *flags]))
    assert reason in str(refused.value.code)


def test_every_flag_of_the_table_parses_with_serve(capsys) -> None:
    """Each spelling, with a value of its kind; none is refused with its served value."""
    for flag in vllm_flags.TABLE:
        for name in flag.names:
            value = (
                []
                if flag.kind == vllm_flags.SWITCH
                else [str(flag.served[0] if flag.served else 1)]
            )
            args = parse(["serve", "tiny", name, *value])
            assert getattr(args, flag.dest) not in (None, False), name
            if not flag.refused or flag.served:
                vllm_flags.check(args)
    capsys.readouterr()


def test_the_help_says_what_each_flag_does() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "vLLM's flags" in text
    assert "--trust-remote-code no effect: models run with transformers' own classes" in text
    assert "other values refused: layers are not split in stages" in text


@pytest.mark.parametrize(
    "text, count",
    [
        ("4096", 4096),
        ("4k", 4000),
        ("4K", 4096),
        ("25.6k", 25_600),
        ("1M", 1 << 20),
        ("2m", 2_000_000),
    ],
)
def test_counts_take_vllms_units(text: str, count: int) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["4x", "k", "1.5", "1.0001k", "-4k", ""])
def test_counts_that_are_not_whole_numbers_of_tokens_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_count(text)


def test_count_flags_take_units() -> None:
    args = parse(["generate", "--max-num-batched-tokens", "8K", "--max-model-len", "32k"])
    config = config_from_args(args)
    assert config.max_num_batched_tokens == 8192 and config.max_model_len == 32_000
