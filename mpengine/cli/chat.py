"""``mpengine chat [MODEL]``: talk with a model through its chat template.

Each line read is a user message; the reply streams as it is generated, and both join the
conversation, which every later message is sent with. Lines starting with ``/`` are
commands (:data:`COMMANDS`). With a terminal: a ``> `` prompt (with line editing when
``readline`` is there), Ctrl-C during a reply stops that reply, at the prompt it only
clears the line; Ctrl-D leaves. From a pipe: one message per line, each reply printed on
stdout followed by a newline, nothing else there (notes go to stderr), so a script can
drive it.

The engine is one it launches (engine flags, MODEL), or a running one (``--address``: its
IPC address, or ``mpengine serve``'s URL, whose ``/v1/chat/completions`` it streams).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from mpengine.cli.args import add_text_command_args, command_logging, prepare_text_command
from mpengine.cli.remote import HttpClient, engine_client, request_params
from mpengine.errors import InvalidRequestError, RequestFailedError

COMMANDS = """\
  /system TEXT  set the system prompt (kept by /reset; /system alone: none)
  /reset        forget the conversation
  /help         this list
  /exit         leave (as Ctrl-D does)
  //TEXT        send TEXT starting with one '/'
Ctrl-C during a reply stops it: the part printed stays in the conversation (a reply
stopped before its first word drops that message too)."""

PROMPT = "> "

Reply = Callable[[list[dict[str, str]]], Iterator[Any]]  # messages -> RequestOutput deltas


def add_parser(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser(
        "chat",
        help="chat with a model through its chat template, with an engine it launches (or a "
        "running one: --address); one message per line from a pipe",
        description="Chat with a model through its chat template. Commands:\n" + COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chat.add_argument("--system", default=None, help="the system prompt to start with")
    chat.add_argument(
        "--chat-template",
        default=None,
        help="a chat template (a file, or the template's text) instead of the model's (not "
        "with an http:// address)",
    )
    add_text_command_args(chat, "chat with", max_tokens_default="the rest of the context")
    chat.set_defaults(func=cmd_chat)


@dataclass(slots=True)
class Conversation:
    """The system prompt and the turns so far (user and assistant messages, alternating)."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, user: str) -> list[dict[str, str]]:
        """What to send for the user's next message."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.turns, {"role": "user", "content": user}]

    def add(self, user: str, reply: str) -> None:
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]

    def reset(self) -> None:
        self.turns.clear()


@dataclass(frozen=True, slots=True)
class Line:
    """What an input line asks for: ``say`` (send ``text``), ``system`` (set it to
    ``text``), ``reset``, ``help``, ``exit``, ``unknown`` (the command ``text``) or
    ``empty``."""

    kind: str
    text: str = ""


def parse_line(line: str) -> Line:
    text = line.rstrip("\r\n")
    if not text.strip():
        return Line("empty")
    if text.startswith("//"):
        return Line("say", text[1:])
    if not text.startswith("/"):
        return Line("say", text)
    name, _, rest = text[1:].strip().partition(" ")
    match name.lower():
        case "system":
            return Line("system", rest.strip())
        case "reset" | "clear":
            return Line("reset")
        case "help" | "?":
            return Line("help")
        case "exit" | "quit" | "bye":
            return Line("exit")
    return Line("unknown", name)


class ChatLoop:
    """Reads lines, runs commands, sends messages through ``reply`` and prints what comes
    back (on ``out``; notes on ``err``)."""

    def __init__(
        self,
        reply: Reply,
        conversation: Conversation,
        out: TextIO,
        err: TextIO,
        interactive: bool,
    ) -> None:
        self.reply = reply
        self.conversation = conversation
        self.out = out
        self.err = err
        self.interactive = interactive
        self.num_failed = 0  # messages the engine (or server) refused

    def run(self, read: Callable[[], str | None]) -> int:
        """Until ``/exit`` or the end of input (``read`` returns None); the exit status: 1
        when a script's message was refused (a person saw it happen)."""
        while (line := self._read(read)) is not None:
            if not self.handle(parse_line(line)):
                break
        else:
            if self.interactive:
                self.out.write("\n")  # (after the prompt Ctrl-D left on the line)
        return 1 if self.num_failed and not self.interactive else 0

    def _read(self, read: Callable[[], str | None]) -> str | None:
        while True:
            try:
                return read()
            except KeyboardInterrupt:
                if not self.interactive:  # (a script's Ctrl-C: stop, as any command does)
                    raise
                self.out.write("\n")
                self._note("(Ctrl-D or /exit leaves)")

    def handle(self, line: Line) -> bool:
        """Act on one line; False: leave."""
        match line.kind:
            case "say":
                self.say(line.text)
            case "system":
                self.conversation.system = line.text or None
                self._confirm(f"system prompt: {line.text}" if line.text else "no system prompt")
            case "reset":
                self.conversation.reset()
                self._confirm("conversation forgotten")
            case "help":
                self._note(COMMANDS)
            case "exit":
                return False
            case "unknown":
                self._note(f"unknown command /{line.text}: /help lists them (//TEXT sends TEXT)")
        return True

    def say(self, text: str) -> None:
        """Send the user's message with the conversation; print the reply as it comes and
        keep it (what was printed of it, when Ctrl-C stopped it)."""
        pieces: list[str] = []
        finish_reason = None
        stopped = False
        try:
            with contextlib.closing(self.reply(self.conversation.messages(text))) as deltas:
                for delta in deltas:
                    self.out.write(delta.text)
                    self.out.flush()
                    pieces.append(delta.text)
                    finish_reason = delta.finish_reason or finish_reason
        except KeyboardInterrupt:  # (closing the stream aborted the request)
            stopped = True
        except (InvalidRequestError, RequestFailedError) as exc:
            if pieces:
                self.out.write("\n")
            self._note(f"mpengine: {exc}")
            self.num_failed += 1
            return
        self.out.write("\n")
        self.out.flush()
        reply = "".join(pieces)
        if stopped:
            self._confirm("(stopped)")
        elif finish_reason == "length":
            self._confirm("(the reply reached --max-tokens or the context's end)")
        if reply or not stopped:
            self.conversation.add(text, reply)

    def _note(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def _confirm(self, text: str) -> None:
        """A note for a person at a terminal (a script knows what it asked for)."""
        if self.interactive:
            self._note(text)


def cmd_chat(args: argparse.Namespace) -> int:
    prepare_text_command(args)
    if args.n != 1:
        raise SystemExit("mpengine: chat prints one reply: --n must be 1")
    interactive = sys.stdin.isatty()
    with command_logging(args.log_level, "chat"), engine_client(args) as client:
        reply = _replies(client, args)
        if interactive:
            print("/help lists the commands; Ctrl-D leaves", file=sys.stderr)
        loop = ChatLoop(reply, Conversation(args.system), sys.stdout, sys.stderr, interactive)
        return loop.run(_terminal_reader() if interactive else _pipe_reader(sys.stdin))


def _replies(client: Any, args: argparse.Namespace) -> Reply:
    """How a message gets its reply: the client's chat stream, with the flags' sampling."""
    if isinstance(client, HttpClient):
        if args.chat_template is not None:
            raise SystemExit("mpengine: --chat-template: the server renders with its own")
        fields = request_params(client, args)
        return lambda messages: client.chat_stream(messages, fields)
    # A reply's length: the flag, the model's default, else what the context has left.
    params = request_params(client, args, {"max_tokens": client.info.max_model_len})
    try:  # (a model without a template, or a bad --chat-template: said once, at the start)
        client.apply_chat_template(
            [{"role": "user", "content": "hi"}], chat_template=args.chat_template
        )
    except InvalidRequestError as exc:
        raise SystemExit(f"mpengine: cannot chat: {exc} (--chat-template gives one)") from None
    return lambda messages: client.chat_stream(messages, params, chat_template=args.chat_template)


def _pipe_reader(stream: TextIO) -> Callable[[], str | None]:
    def read() -> str | None:
        line = stream.readline()
        return line if line else None

    return read


def _terminal_reader() -> Callable[[], str | None]:
    with contextlib.suppress(ImportError):  # line editing and history, where there is one
        import readline  # noqa: F401

    def read() -> str | None:
        try:
            return input(PROMPT)
        except EOFError:
            return None

    return read
