"""A request's structured outputs as llguidance grammar text, checked without a tokenizer."""

from __future__ import annotations

import functools
import json

import llguidance
import msgspec
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from mpengine.protocol import StructuredOutputs

# JSON without free whitespace between tokens (as vLLM's ``disable_any_whitespace``): a
# model cannot pad its output with blanks until max_tokens, and the JSON is compact.
_JSON_OPTIONS = {"whitespace_flexible": False}
MAX_MESSAGE_CHARS = 500


class InvalidGrammar(ValueError):
    """A schema, regex or grammar the library refuses; the message names which."""


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON text) of ``spec``; raises :class:`InvalidGrammar`."""
    return _compiled(msgspec.json.encode(spec))


def check(spec: StructuredOutputs) -> None:
    """Raise :class:`InvalidGrammar` if ``spec`` cannot be compiled (cached: a schema
    checked once is not parsed again)."""
    grammar_text(spec)


@functools.lru_cache(maxsize=256)
def _compiled(encoded: bytes) -> str:
    spec = msgspec.json.decode(encoded, type=StructuredOutputs)
    kind = spec.kind
    try:
        grammar = _grammar(spec)
    except (ValueError, TypeError, GbnfToLarkError) as exc:  # not JSON, bad GBNF
        raise InvalidGrammar(f"structured_outputs.{kind}: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        message = " ".join(error.split())  # the library's caret drawings on one line
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 3] + "..."
        raise InvalidGrammar(f"structured_outputs.{kind}: {message}")
    return grammar


def _grammar(spec: StructuredOutputs) -> str:
    build = llguidance.LLMatcher
    if spec.json is not None:
        schema = json.loads(spec.json)
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema is an object (or true/false)")
        return build.grammar_from_json_schema(spec.json, defaults=_JSON_OPTIONS)
    if spec.json_object:
        return build.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if spec.regex is not None:
        return build.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        alternatives = " | ".join(json.dumps(choice) for choice in spec.choice)
        return build.grammar_from_lark(f"start: {alternatives}")
    assert spec.grammar is not None
    grammar = spec.grammar
    if "::=" in grammar:  # GBNF (llama.cpp's, xgrammar's EBNF): Lark is what llguidance reads
        grammar = gbnf_to_lark(grammar)
    return build.grammar_from_lark(grammar)
