"""The chat template module (the one implementation the server, the client and the CLI
render with), and how the engine shares a template's files with remote clients."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from mpengine.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    message_dicts,
    message_texts,
    read_chat_files,
)
from mpengine.protocol import (
    CHAT_TEMPLATE_FILES,
    TokenizerFile,
    TokenizerQuery,
    encoder,
    scheduler_reply_decoder,
)
from mpengine.runtime.edges import Sent
from mpengine.runtime.front import FrontDoor

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
CONFIG = {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_renders_the_models_template_with_its_special_tokens() -> None:
    files = {"tokenizer_config.json": json.dumps({**CONFIG, "chat_template": TEMPLATE}).encode()}
    template = ChatTemplate.from_files(files)
    assert template.render(template.messages(MESSAGES)) == (
        "<s><system>Be brief.</s><user>Hi</s><assistant>"
    )
    assert template.render(MESSAGES, add_generation_prompt=False).endswith("<user>Hi</s>")
    assert template.content_format == "string"


def test_chat_template_jinja_wins_and_older_layouts_are_read() -> None:
    """chat_template.jinja (transformers 5) over tokenizer_config.json's; named templates
    (the default one); special tokens kept only in special_tokens_map.json."""
    files = {
        "tokenizer_config.json": json.dumps(
            {"chat_template": [{"name": "default", "template": "named"}, {"name": "x"}]}
        ),
        "special_tokens_map.json": json.dumps(CONFIG),
    }
    assert ChatTemplate.from_files(files).render(MESSAGES) == "named"
    files["chat_template.jinja"] = "{{ eos_token }}{{ messages | length }}"
    template = ChatTemplate.from_files(files)
    assert template.render(MESSAGES) == "</s>2"
    assert template.special_tokens["bos_token"] == "<s>"
    # A template given replaces the model's.
    assert ChatTemplate.from_files(files, "{{ bos_token }}!").render(MESSAGES) == "<s>!"


def test_a_model_without_a_template_cannot_chat() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template") as info:
        ChatTemplate.from_files({}).render(MESSAGES)
    assert info.value.param == "messages"
    broken = ChatTemplate.from_files({"chat_template.jinja": b"{% for m in messages %}"})
    assert broken.template is None  # (does not compile: chat off, with a warning)


def test_continue_final_message_ends_where_its_text_does() -> None:
    template = ChatTemplate("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "The ans"}]
    assert template.render(messages, False, continue_final_message=True) == "[Q][The ans"
    with pytest.raises(ChatTemplateError, match="exclude each other"):
        template.render(messages, True, continue_final_message=True)


def test_messages_are_normalised_without_touching_the_callers() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    before = json.dumps(messages)
    records = message_dicts(messages)
    assert records[0]["content"] == "a\nb" and records[1]["content"] == ""
    assert records[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert json.dumps(messages) == before
    parts = message_dicts(messages[:1], "openai")[0]["content"]
    assert parts == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert message_texts(messages) == ["a", "b"]


@pytest.mark.parametrize(
    ("messages", "match", "param"),
    [
        ([{"content": "no role"}], "'role'", "messages.0"),
        (["text"], "'role'", "messages.0"),
        ([{"role": "user", "content": 5}], "not int", "messages.0.content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "text only", None),
        ([{"role": "user", "content": [{"type": "text", "text": None}]}], "needs a string", None),
    ],
)
def test_bad_messages_name_the_field(messages: list, match: str, param: str | None) -> None:
    with pytest.raises(ChatTemplateError, match=match) as info:
        message_dicts(messages)
    assert info.value.param.startswith(param or "messages.0.content.0")


def test_a_template_is_a_file_or_its_text(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE == load_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match="looks like a path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% if %}")


class Edge:
    max_frame_bytes = 1 << 20

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, client_id: bytes, payload: bytes) -> Sent:
        self.sent.append(payload)
        return Sent.OK


def test_the_engine_shares_the_files_a_chat_template_needs(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    (tmp_path / "config.json").write_text("{}")  # (not a tokenizer file: not sent)
    edge = Edge()
    door = FrontDoor(edge, None, SimpleNamespace(tokenizer=str(tmp_path)))  # type: ignore[arg-type]
    door.handle(b"client", encoder.encode(TokenizerQuery(7)))
    reply = scheduler_reply_decoder().decode(edge.sent[0])
    assert isinstance(reply, TokenizerFile) and reply.query_id == 7 and reply.data == b"{}"
    assert reply.chat_files == read_chat_files(tmp_path)
    assert set(reply.chat_files) == {"tokenizer_config.json", "chat_template.jinja"}
    assert set(CHAT_TEMPLATE_FILES) >= set(reply.chat_files)
    rendered = ChatTemplate.from_files(reply.chat_files).render(MESSAGES)
    assert rendered == ChatTemplate.from_dir(tmp_path).render(MESSAGES)


def test_tokenizer_files_of_older_and_newer_engines_decode() -> None:
    """chat_files is a field added at the end: an older client skips it, a newer client of
    an older engine sees none."""

    class OldTokenizerFile(msgspec.Struct, array_like=True, tag="TokenizerFile"):
        query_id: int
        data: bytes

    new = encoder.encode(TokenizerFile(1, b"tok", {"chat_template.jinja": b"x"}))
    assert msgspec.msgpack.decode(new, type=OldTokenizerFile) == OldTokenizerFile(1, b"tok")
    old = encoder.encode(OldTokenizerFile(1, b"tok"))
    assert msgspec.msgpack.decode(old, type=TokenizerFile).chat_files == {}
