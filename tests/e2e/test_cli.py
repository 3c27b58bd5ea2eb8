"""The command line: help documents every engine flag; generate prints completions, embed
embeddings."""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

import mpengine
from mpengine.cli import build_parser, config_from_args, main, parse_bytes
from mpengine.config import EngineConfig
from mpengine.models.resolve import resolve_model


def test_help_documents_every_engine_flag():
    gen = build_parser()._subparsers._group_actions[0].choices["generate"]
    text = gen.format_help()
    for name in EngineConfig.__struct_fields__:
        assert "--" + name.replace("_", "-") in text, name


def test_generate_prints_completions():
    cmd = [
        sys.executable,
        "-m",
        "mpengine.cli",
        "generate",
        "--model",
        "tiny",
        "--json",
        "--prompt",
        "Hello there",
        "--prompt",
        "The sea",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--runtime",
        "processes",
        "--log-level",
        "WARNING",
        "--logprobs",
        "2",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["Hello there", "The sea"]
    assert all(len(r["token_ids"]) == 5 and r["finish_reason"] == "length" for r in records)
    for r in records:  # per token, [id, logprob] pairs: the sampled token first, then top 2
        assert [step[0][0] for step in r["logprobs"]] == r["token_ids"]
        assert all(2 <= len(step) <= 3 and all(lp <= 0 for _, lp in step) for step in r["logprobs"])
    assert "tokens/s" in done.stderr


def test_embed_prints_embeddings():
    texts = ["Hello there", "The sea is calm"]
    cmd = [sys.executable, "-m", "mpengine.cli", "embed", "--model", "tiny-bert"]
    cmd += ["--dimensions", "16", "--truncate-prompt-tokens", "5", "--log-level", "WARNING"]
    done = subprocess.run([*cmd, *texts], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    tokenizer = Tokenizer.from_file(os.path.join(resolve_model("tiny-bert"), "tokenizer.json"))
    assert [r["index"] for r in records] == [0, 1]
    # At most 5 tokens each ("The sea is calm" has 6 with [CLS] and [SEP]).
    assert [r["num_prompt_tokens"] for r in records] == [
        min(5, len(tokenizer.encode(t).ids)) for t in texts
    ]
    assert records[1]["num_prompt_tokens"] == 5
    for record in records:  # the first 16 values, normalised (tiny-bert's default)
        assert len(record["embedding"]) == 16
        assert abs(np.linalg.norm(record["embedding"]) - 1.0) < 1e-5
    assert records[0]["embedding"] != records[1]["embedding"]
    assert "embeddings" in done.stderr
    bad = [sys.executable, "-m", "mpengine.cli", "embed", "--dimensions", "0", "x"]
    done = subprocess.run(bad, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "dimensions" in done.stderr


def test_generate_reports_failed_samples_and_exits_1():
    """A sample the engine fails is printed with its error, and the exit status says so."""
    cmd = [sys.executable, "-m", "mpengine.cli", "generate", "--model", "tiny", "--json"]
    cmd += ["--prompt", "Hello there", "--max-tokens", "5", "--runtime", "serial"]
    env = {**os.environ, "MPENGINE_FAULT_SEQS": "0,1,2,3"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1, done.stderr
    (record,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert record["finish_reason"] == "error" and "injected" in record["error"]
    assert "sample 0 failed" in done.stderr


@pytest.fixture(scope="module")
def running_engine():
    """A running engine that ``generate --address`` reaches (no engine launched per call)."""
    with mpengine.launch(model="tiny", runtime="serial", log_level="WARNING") as engine:
        yield engine


def test_generate_stream_prints_what_generate_prints(running_engine, capsys):
    argv = ["generate", "--address", running_engine.address, "--prompt", "Once upon"]
    argv += ["--max-tokens", "6", "--ignore-eos", "--temperature", "0", "--logprobs", "2"]
    assert main(argv) == 0
    whole = capsys.readouterr().out
    assert main([*argv, "--stream"]) == 0
    streamed = capsys.readouterr()
    assert streamed.out == whole and "[6 tokens, finish_reason=length]" in whole
    assert len(whole.splitlines()) == 2 + 6  # text, count, one line per token
    assert main([*argv, "--stream", "--n", "2"]) == 0  # not streamable: said, then printed
    several = capsys.readouterr()
    assert "--stream prints one prompt's text with n = 1" in several.err
    assert several.out.count("[6 tokens, finish_reason=length]") == 2


def test_generate_takes_the_models_defaults_for_flags_not_given(tmp_path, capsys):
    """The sampling flags had defaults of their own (greedy, 64 tokens), so a model's
    generation_config.json never counted, though --generation-config is a flag."""
    model = tmp_path / "model"
    shutil.copytree(resolve_model("tiny"), model)
    file = model / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "max_new_tokens": 5}))
    argv = ["generate", "--model", str(model), "--runtime", "serial", "--prompt", "Once upon"]
    argv += ["--ignore-eos", "--log-level", "WARNING", "--json"]

    def num_tokens(*flags: str) -> int:
        assert main([*argv, *flags]) == 0
        return len(json.loads(capsys.readouterr().out)["token_ids"])

    assert num_tokens() == 5  # the model's max_new_tokens
    assert num_tokens("--max-tokens", "7") == 7  # a flag wins
    assert num_tokens("--generation-config", "none") == 64  # the CLI's own default


def test_refused_requests_and_unreachable_engines_fail_in_one_line(
    running_engine, tmp_path, capsys
):
    argv = ["generate", "--address", running_engine.address, "--prompt", ""]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "mpengine: the engine refused the request: the prompt is empty" in err
    assert "Traceback" not in err
    stale = tmp_path / "stale.sock"  # a socket file nobody listens on
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(stale))
    for argv, message in [
        (["stats", f"ipc://{stale}", "--timeout", "0.5"], "nothing listens there"),
        (["stats", f"ipc://{tmp_path}/nobody"], f"{tmp_path}/nobody does not exist"),
        (["stats", "garbage"], "'garbage' is not an ipc:// or tcp:// address"),
        (["stacks", "garbage"], "'garbage' is not an ipc:// address"),
        (["stacks", f"ipc://{tmp_path}/nobody"], "no running engine found"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert message in str(exit_info.value.code), argv
    # An engine that cannot start: the launcher's one line, no stage traceback.
    argv = ["generate", "--model", "no-such-model", "--runtime", "serial", "--prompt", "x"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "Traceback" not in err
    if not torch.cuda.is_available():
        argv = ["generate", "--model", "tiny", "--device", "cuda", "--runtime", "serial"]
        assert main([*argv, "--prompt", "x"]) == 1
        err = capsys.readouterr().err
        assert "torch sees no CUDA device" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("signum", "status", "line"),
    [
        (signal.SIGINT, 130, "mpengine: interrupted"),
        (signal.SIGTERM, 143, "mpengine: stopped by SIGTERM"),
        (signal.SIGHUP, 129, "mpengine: stopped by SIGHUP"),
    ],
)
def test_ctrl_c_or_sigterm_stops_the_engine_cleanly(signum, status, line):
    """A signal mid-generation: one line, exit status 128 + signal, no stage or segment
    left (``timeout`` and ``docker stop`` send SIGTERM, a closed terminal SIGHUP)."""
    engine_id = f"sig{int(signum)}x{os.getpid()}"
    cmd = [sys.executable, "-m", "mpengine.cli", "generate", "--model", "tiny", "--stream"]
    cmd += ["--prompt", "hi", "--max-tokens", "4000", "--ignore-eos", "--engine-id", engine_id]
    cmd += ["--log-level", "WARNING"]

    def default_sigint() -> None:  # a background job may have inherited SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no token was streamed"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == status, err.decode()
    assert err.decode().strip().endswith(line) and b"Traceback" not in err
    assert not [name for name in os.listdir("/dev/shm") if engine_id in name]


def test_sizes_take_units_and_vllm_names_work():
    """Byte sizes take binary units; vLLM's --enable-prefix-caching and `serve MODEL` work
    (vLLM's --swap-space 4 means GiB: here 4 bytes, refused at start, see below)."""
    assert parse_bytes("4GiB") == parse_bytes("4G") == parse_bytes("4gb") == 4 << 30
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("1.5GiB") == 3 << 29
    assert parse_bytes("4096") == 4096 and parse_bytes("64k") == 65536
    assert parse_bytes("4Gi") == 4 << 30 and parse_bytes("9007199254740993") == 2**53 + 1
    for bad in ("", "GiB", "4 parsecs", "-1G", "4ib", "9" * 400, "1e9"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "tiny-llama", "--swap-space", "2GiB", "--no-enable-prefix-caching"]
    )
    assert args.model_tag == "tiny-llama" and args.swap_space == 2 << 30
    config = config_from_args(parser.parse_args(["generate", "--kv-cache-bytes", "256MiB"]))
    assert config.kv_cache_bytes == 256 << 20
    assert config_from_args(args).prefix_caching is False


def test_vllm_spellings_and_flags_without_effect(capsys):
    """--dtype half, lower-case --log-level; a flag the others make pointless is named."""
    parser = build_parser()
    args = ["generate", "--dtype", "half", "--log-level", "debug", "--swap-space", "4"]
    config = config_from_args(
        parser.parse_args([*args, "--runtime", "serial", "--async-depth", "1"])
    )
    assert config.dtype == "float16" and config.log_level == "DEBUG"
    notes = capsys.readouterr().err
    assert "--swap-space has no effect without --preemption-mode swap" in notes
    assert "--async-depth has no effect with --runtime serial" in notes
    config_from_args(parser.parse_args(["generate", "--swap-space", "4GiB"]))
    with pytest.raises(SystemExit, match="at --async-depth"):  # the flag, not `$.async_depth`
        config_from_args(parser.parse_args(["generate", "--async-depth", "3"]))


def test_a_swap_space_that_holds_no_block_is_refused_at_start():
    with pytest.raises(mpengine.EngineStartError, match="swap_space \\(4 bytes\\) holds no KV"):
        mpengine.launch(model="tiny", preemption_mode="swap", swap_space=4, log_level="ERROR")


def test_bad_flags_fail_clearly():
    cmd = [sys.executable, "-m", "mpengine.cli", "generate", "--temperature", "-1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "temperature" in done.stderr
    cmd = [sys.executable, "-m", "mpengine.cli", "generate", "--async-depth", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--async-depth" in done.stderr
    cmd = [sys.executable, "-m", "mpengine.cli", "serve", "--port", "99999"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "99999 is not a port" in done.stderr


def test_serve_then_connect_and_stats(tmp_path):
    """``mpengine serve`` in the foreground: clients connect by address (the socket's, or
    the directory serve was given), ``mpengine stats`` reads its counters, SIGTERM stops it
    cleanly."""
    address = f"ipc://{tmp_path}/engine"
    cmd = [
        sys.executable,
        "-m",
        "mpengine.cli",
        "serve",
        "tiny",  # the model, positional as in `vllm serve MODEL`
        "--address",
        address,
        "--port",
        "0",  # any free port: 8000 may be taken on this host
        "--num-gpu-blocks-override",
        "64",
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "serve printed nothing"
        line = proc.stdout.readline()
        assert "serving" in line, line
        request_address = line.rsplit(" at ", 1)[1].strip()
        assert request_address == f"{address}/requests.sock"
        with mpengine.Client(request_address) as client:
            out = client.generate("hi", mpengine.SamplingParams(max_tokens=3, ignore_eos=True))
            assert len(out.token_ids) == 3
        # The address serve was given (the directory) works as well as its socket's.
        stats = subprocess.run(
            [sys.executable, "-m", "mpengine.cli", "stats", address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stats.returncode == 0, stats.stderr
        counters = json.loads(stats.stdout)
        assert counters["finished"] == 1 and counters["num_blocks"] == 64
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert not os.path.exists(f"{tmp_path}/engine/requests.sock"), "socket file left behind"
