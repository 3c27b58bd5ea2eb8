"""``mpengine chat``'s loop without an engine: commands, the conversation kept across turns,
a reply stopped by Ctrl-C, refused messages; the CLI's flags for generate and chat; how an
HTTP server's answers become outputs."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest

from mpengine.cli import build_parser, config_from_args
from mpengine.cli.args import given_sampling, quiet_by_default, take_model_tag
from mpengine.cli.chat import ChatLoop, Conversation, Line, parse_line
from mpengine.cli.remote import HttpClient, _http_error, _logprob_rows, is_http
from mpengine.client.outputs import CompletionOutput, RequestOutput
from mpengine.errors import InvalidRequestError, RequestFailedError


def delta(text: str, finish_reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", [], [CompletionOutput(0, text, finish_reason=finish_reason)])


class FakeEngine:
    """Replies "reply N" in two pieces; records what each message was sent with.
    ``interrupt_after``: raise KeyboardInterrupt (Ctrl-C) after that many pieces."""

    def __init__(self) -> None:
        self.sent: list[list[dict[str, str]]] = []
        self.interrupt_after: int | None = None
        self.refuse = False
        self.closed = 0

    def reply(self, messages: list[dict[str, str]]) -> Iterator[RequestOutput]:
        self.sent.append(messages)
        if self.refuse:
            raise InvalidRequestError("the prompt is too long")
        try:
            for i, piece in enumerate([f"reply {len(self.sent)}", "!"]):
                if i == self.interrupt_after:
                    raise KeyboardInterrupt
                yield delta(piece, "stop" if i == 1 else None)
        finally:
            self.closed += 1


def run(lines: list[str], engine: FakeEngine, interactive: bool = False, system=None):
    out, err = io.StringIO(), io.StringIO()
    conversation = Conversation(system)
    loop = ChatLoop(engine.reply, conversation, out, err, interactive)
    feed = iter(lines)
    status = loop.run(lambda: next(feed, None))
    return status, out.getvalue(), err.getvalue(), conversation


@pytest.mark.parametrize(
    ("line", "want"),
    [
        ("hello\n", Line("say", "hello")),
        ("  spaced  \n", Line("say", "  spaced  ")),
        ("\n", Line("empty")),
        ("   ", Line("empty")),
        ("/reset", Line("reset")),
        ("/system Be brief. \n", Line("system", "Be brief.")),
        ("/system", Line("system", "")),
        ("/EXIT", Line("exit")),
        ("/quit", Line("exit")),
        ("/help", Line("help")),
        ("/what now", Line("unknown", "what")),
        ("//etc/passwd is a file", Line("say", "/etc/passwd is a file")),
    ],
)
def test_lines_are_messages_or_commands(line: str, want: Line) -> None:
    assert parse_line(line) == want


def test_the_conversation_is_kept_reset_and_given_a_system_prompt() -> None:
    engine = FakeEngine()
    lines = ["Hi", "And then?", "/system Be brief.", "Again", "/reset", "New", "/exit", "unread"]
    status, out, err, conversation = run(lines, engine)
    assert status == 0
    assert out == "reply 1!\nreply 2!\nreply 3!\nreply 4!\n"  # one line per reply, no notes
    assert err == ""  # (a script is told nothing it did not ask for)
    first, second, third, fourth = engine.sent
    assert first == [{"role": "user", "content": "Hi"}]
    assert second == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "reply 1!"},
        {"role": "user", "content": "And then?"},
    ]
    assert third[0] == {"role": "system", "content": "Be brief."} and len(third) == 6
    assert fourth == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "New"},
    ]
    assert conversation.system == "Be brief." and len(conversation.turns) == 2


def test_system_alone_removes_the_system_prompt() -> None:
    engine = FakeEngine()
    run(["/system", "Hi"], engine, system="Start")
    assert engine.sent == [[{"role": "user", "content": "Hi"}]]


def test_ctrl_c_stops_a_reply_keeps_what_was_printed_and_not_the_session() -> None:
    engine = FakeEngine()
    engine.interrupt_after = 1  # after "reply 1"
    status, out, err, conversation = run(["Tell me", "More"], engine, interactive=True)
    assert status == 0 and engine.closed == 2  # (each stream closed: the request aborted)
    assert out.startswith("reply 1\n")
    assert "(stopped)" in err
    assert conversation.turns[:2] == [
        {"role": "user", "content": "Tell me"},
        {"role": "assistant", "content": "reply 1"},
    ]
    engine.interrupt_after = 0  # before any text: the message is dropped with it
    status, out, _, conversation = run(["Tell me", "More"], engine)
    assert status == 0 and out == "\n\n" and conversation.turns == []


def test_ctrl_c_at_the_prompt_clears_the_line_at_a_terminal_and_stops_a_script() -> None:
    reads = iter([KeyboardInterrupt, "Hi", None])

    def read() -> str | None:
        item = next(reads)
        if item is KeyboardInterrupt:
            raise KeyboardInterrupt
        return item

    engine = FakeEngine()
    out, err = io.StringIO(), io.StringIO()
    loop = ChatLoop(engine.reply, Conversation(), out, err, interactive=True)
    assert loop.run(read) == 0
    assert "Ctrl-D or /exit leaves" in err.getvalue() and "reply 1!" in out.getvalue()
    loop = ChatLoop(engine.reply, Conversation(), out, err, interactive=False)
    reads = iter([KeyboardInterrupt])
    with pytest.raises(KeyboardInterrupt):
        loop.run(read)


def test_a_refused_message_is_said_and_not_kept() -> None:
    engine = FakeEngine()
    engine.refuse = True
    status, out, err, conversation = run(["Hi", "/bogus"], engine)
    assert status == 1  # (a script learns that a message failed)
    assert out == "" and "the prompt is too long" in err and "unknown command /bogus" in err
    assert conversation.turns == []
    status, _, _, _ = run(["Hi"], engine, interactive=True)
    assert status == 0  # (a person saw it)


def test_generate_and_chat_take_the_model_positionally_and_log_quietly() -> None:
    parser = build_parser()
    for command in ("generate", "chat"):
        args = parser.parse_args([command, "tiny-llama"])
        take_model_tag(args)
        quiet_by_default(args)
        config = config_from_args(args)
        assert config.model == "tiny-llama" and config.log_level == "WARNING"
        args = parser.parse_args([command, "tiny", "--model", "tiny", "--log-level", "info"])
        take_model_tag(args)
        quiet_by_default(args)
        assert config_from_args(args).log_level == "INFO"
        args = parser.parse_args([command, "tiny", "--model", "tiny-llama"])
        with pytest.raises(SystemExit, match="two models"):
            take_model_tag(args)
        # --address is the running engine's, not the address a launched one would bind.
        args = parser.parse_args([command, "--address", "ipc:///run/x"])
        assert args.engine_address == "ipc:///run/x" and not hasattr(args, "address")
        assert config_from_args(args).address is None


def test_a_server_gets_the_sampling_flags_given_only() -> None:
    args = build_parser().parse_args(["chat", "--temperature", "0", "--stop", "x"])
    assert given_sampling(args) == {"temperature": 0.0, "stop": ["x"]}
    args = build_parser().parse_args(["generate", "--sampling-seed", "3", "--n", "2"])
    assert given_sampling(args) == {"seed": 3, "n": 2}


def test_http_addresses_and_answers() -> None:
    assert is_http("http://h:1") and is_http("https://h") and not is_http("ipc:///x")
    client = HttpClient("http://127.0.0.1:8000/v1/", None, 1.0)
    assert (client.host, client.port, client.base) == ("127.0.0.1", 8000, "")
    assert HttpClient("https://h/proxy/v1", None, 1.0).base == "/proxy"
    with pytest.raises(SystemExit):
        HttpClient("http://", None, 1.0)
    rows = _logprob_rows(
        {
            "tokens": ["token_id:5", "token_id:7"],
            "token_logprobs": [-0.5, -1.0],
            "top_logprobs": [{"token_id:9": -0.1, "token_id:5": -0.5}, None],
        }
    )
    assert [list(row.items()) for row in rows] == [[(5, -0.5), (9, -0.1)], [(7, -1.0)]]
    error = json.dumps({"error": {"message": "bad temperature", "type": "x"}}).encode()
    assert isinstance(_http_error(400, error), InvalidRequestError)
    assert isinstance(_http_error(401, error), PermissionError)
    failed = _http_error(503, b"not json")
    assert isinstance(failed, RequestFailedError) and "503: not json" in str(failed)
