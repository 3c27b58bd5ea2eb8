"""Chat: ``Client.chat`` is ``generate`` on the prompt the model's chat template renders
(the token ids transformers' ``apply_chat_template`` gives), and ``mpengine chat`` driven
through a pipe keeps the conversation, forgets it on ``/reset``, takes ``/system``, with an
engine it launches, a running one at its IPC address, or ``mpengine serve`` at its URL
(``generate --address`` as well)."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import mpengine
from mpengine.cli.args import CLI_SAMPLING
from mpengine.models.resolve import resolve_model
from mpengine.protocol import SamplingParams, TokenizerQuery
from mpengine.testing.engine import wait_until
from tests.e2e.test_server_cli import serving

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
MAX_TOKENS = 6
RUN_TIMEOUT_S = 180  # one CLI run (an engine start included)
CLI = [sys.executable, "-m", "mpengine.cli"]


@pytest.fixture(scope="module")
def engines(start_engine):
    """An engine per model, started on first use and shared by the module's tests."""
    started: dict[str, mpengine.Engine] = {}

    def engine(model: str = "tiny") -> mpengine.Engine:
        if model not in started:
            started[model] = start_engine(model=model, runtime="serial", log_level="WARNING")
        return started[model]

    return engine


def cli_params(info: mpengine.EngineInfo) -> SamplingParams:
    """What ``mpengine chat --temperature 0 --max-tokens 6`` asks for."""
    given = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    return SamplingParams(**{**CLI_SAMPLING, **info.sampling_defaults, **given})


def hf_prompt_ids(model: str, messages: list[dict], **kwargs) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    kwargs.setdefault("add_generation_prompt", True)
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("model", ["tiny", "tiny-llama"])  # (tiny-llama's template adds BOS)
def test_chat_is_generate_on_the_rendered_prompt(engines, model: str) -> None:
    client = engines(model).client()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = hf_prompt_ids(model, MESSAGES)
    out = client.chat(MESSAGES, params)
    assert out.prompt_token_ids == ids == client.apply_chat_template(MESSAGES)
    assert out.token_ids == client.generate(ids, params).token_ids
    assert len(out.token_ids) == MAX_TOKENS
    bos = AutoTokenizer.from_pretrained(resolve_model(model)).bos_token_id
    assert bos is None or ids.count(bos) <= 1  # (the template's only: none added)


def test_chat_batches_streams_and_runs_async(engines) -> None:
    engine = engines()
    client = engine.client()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    other = [{"role": "user", "content": "What is the sea?"}]
    one, two = client.chat([MESSAGES, other], params)
    assert one.token_ids == client.chat(MESSAGES, params).token_ids
    assert two.token_ids == client.chat(other, params).token_ids != one.token_ids
    streamed = list(client.chat_stream(MESSAGES, params))
    assert streamed[-1].finished and "".join(d.text for d in streamed) == one.text
    assert [t for d in streamed for t in d.token_ids] == one.token_ids

    async def chat_async() -> tuple[list[int], str]:
        async with engine.async_client() as aclient:
            whole = await aclient.chat(MESSAGES, params)
            deltas = [d async for d in aclient.chat_stream(MESSAGES, params)]
            return whole.token_ids, "".join(d.text for d in deltas)

    assert asyncio.run(asyncio.wait_for(chat_async(), 60)) == (one.token_ids, one.text)
    # Continuing the final message, a template of the caller's, template variables.
    partial = [*other, {"role": "assistant", "content": "The sea is"}]
    continued = client.chat(partial, params, continue_final_message=True)
    assert continued.prompt_token_ids == hf_prompt_ids(
        "tiny", partial, add_generation_prompt=False, continue_final_message=True
    )
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ suffix }}"
    out = client.chat(other, params, chat_template=template, chat_template_kwargs={"suffix": "A:"})
    assert out.prompt_token_ids == client.tokenize("user: What is the sea?\nA:")


def test_chat_refuses_what_it_cannot_render(engines) -> None:
    client = engines().client()
    with pytest.raises(mpengine.InvalidRequestError, match="empty"):
        client.chat([])
    with pytest.raises(mpengine.InvalidRequestError, match="text only"):
        client.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(mpengine.InvalidRequestError, match="chat_template"):
        client.chat(MESSAGES, chat_template="no/such/template.jinja")
    with pytest.raises(TypeError, match="request_id"):
        client.chat([MESSAGES, MESSAGES], request_id="x")


def test_a_client_fetches_the_tokenizer_and_template_once(engines, monkeypatch) -> None:
    fetches = []
    query = mpengine.Client._query

    def counting(client, make, timeout):
        fetches.append(make)
        return query(client, make, timeout)

    monkeypatch.setattr(mpengine.Client, "_query", counting)
    with mpengine.Client(engines().address) as client:  # (remote: everything by the wire)
        client.tokenize("hello")
        params = SamplingParams(max_tokens=2)
        client.chat(MESSAGES, params)
        client.chat(MESSAGES, params, chat_template="{{ messages[0].content }}")
    assert fetches.count(TokenizerQuery) == 1


def expected_replies(client: mpengine.Client, lines: list[str]) -> list[str]:
    """What ``mpengine chat`` should print for ``lines`` (messages, /reset, /system)."""
    params = cli_params(client.info)
    system, turns, replies = None, [], []
    for line in lines:
        if line == "/reset":
            turns = []
        elif line.startswith("/system "):
            system = line.removeprefix("/system ")
        else:
            head = [{"role": "system", "content": system}] if system else []
            messages = [*head, *turns, {"role": "user", "content": line}]
            reply = client.chat(messages, params).text
            turns += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]
            replies.append(reply)
    return replies


def chat_command(
    *args: str, lines: list[str], env: dict | None = None
) -> subprocess.CompletedProcess:
    cmd = [*CLI, "chat", *args, "--temperature", "0", "--max-tokens", str(MAX_TOKENS)]
    return subprocess.run(
        cmd,
        input="".join(line + "\n" for line in lines),  # then end of input: Ctrl-D
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
    )


LINES = ["Hello there", "And then?", "/reset", "And then?", "/system Be brief.", "Who are you?"]


def test_chat_command_keeps_the_conversation(engines) -> None:
    engine = engines()
    client = engine.client()
    replies = expected_replies(client, LINES)
    # The second message was sent with the first turn: alone it gets another reply.
    assert replies[1] != replies[2] == expected_replies(client, ["And then?"])[0]
    done = chat_command("--address", engine.address, lines=LINES)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "".join(reply + "\n" for reply in replies)
    assert done.stderr == ""


def test_ctrl_c_stops_a_reply_and_not_the_chat(engines) -> None:
    """SIGINT during a reply aborts its request, and the chat goes on: the next message is
    sent (and stopped in turn); the end of input leaves with status 0."""
    engine = engines()
    client = engine.client()
    cmd = [*CLI, "chat", "--address", engine.address, "--max-tokens", "4000", "--ignore-eos"]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        before = client.stats()
        proc.stdin.write(b"Tell me a story\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], RUN_TIMEOUT_S)
        assert ready, "no reply was streamed"
        proc.send_signal(signal.SIGINT)
        wait_until(client, lambda s: s.aborted == before.aborted + 1, 30, "the first abort")
        proc.stdin.write(b"Go on\n")
        proc.stdin.flush()
        wait_until(client, lambda s: s.admitted == before.admitted + 2, 30, "the next message")
        proc.send_signal(signal.SIGINT)
        stats = wait_until(client, lambda s: s.aborted == before.aborted + 2, 30, "an abort")
        assert stats.step - before.step < 1000  # (neither reply ran to its 4000 tokens)
        out, err = proc.communicate(b"", timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err.decode()
    assert out.count(b"\n") >= 2 and b"Traceback" not in err


def test_chat_command_launches_a_quiet_engine(engines) -> None:
    """``mpengine chat MODEL``: the stages' INFO lines are not printed (--log-level info
    brings them back)."""
    (reply,) = expected_replies(engines().client(), ["Hello there"])
    done = chat_command("tiny", "--runtime", "serial", lines=["Hello there", "/exit", "unread"])
    assert done.returncode == 0, done.stderr
    assert done.stdout == reply + "\n"
    assert " INFO " not in done.stderr, done.stderr


def test_generate_reaches_a_running_engine(engines) -> None:
    engine = engines()
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want = engine.client().generate("Hello there", params)
    cmd = [*CLI, "generate", "--address", engine.address, "--json", "--prompt", "Hello there"]
    cmd += ["--max-tokens", "5", "--temperature", "0", "--ignore-eos"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["token_ids"] == want.token_ids


def test_chat_and_generate_over_http(tmp_path: Path) -> None:
    key = "chat-test-key"
    with serving(tmp_path, "--runtime", "serial", env={"MPENGINE_API_KEY": key}) as served:
        with mpengine.Client(served.address) as client:
            replies = expected_replies(client, LINES)
        env = {**os.environ, "MPENGINE_API_KEY": key}
        done = chat_command("--address", served.url, lines=LINES, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "".join(reply + "\n" for reply in replies)
        # generate prints the same through the server as through the engine's address.
        args = ["--json", "--prompt", "Hello there", "--max-tokens", "5", "--temperature", "0"]
        args += ["--ignore-eos", "--logprobs", "2"]
        outputs = []
        for address in (served.url, served.address):
            cmd = [*CLI, "generate", "--address", address, *args]
            run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
            assert run.returncode == 0, run.stderr
            outputs.append(json.loads(run.stdout))
        assert outputs[0] == outputs[1] and len(outputs[0]["token_ids"]) == 5
        refused = chat_command("--address", served.url, "--api-key", "nope", lines=["Hi"])
        assert refused.returncode == 1 and "refused the API key" in refused.stderr


def test_a_chatting_client_imports_neither_torch_nor_transformers(engines) -> None:
    code = (
        "import sys, mpengine\n"
        f"with mpengine.Client({engines().address!r}) as client:\n"
        f"    assert client.chat({MESSAGES!r}, mpengine.SamplingParams(max_tokens=2)).token_ids\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
