"""The request fields that ask for structured outputs, as the engine's
:class:`~mpengine.protocol.StructuredOutputs` (a dict for ``msgspec.convert``): OpenAI's
``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
(``json``, ``json_object``, ``regex``, ``choice``, ``grammar``) and its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. The scheduler
compiles them (a bad schema is a 400 naming it)."""

from __future__ import annotations

import json
from typing import Any

from mpengine.protocol import STRUCTURED_KINDS

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_outputs(
    response_format: dict[str, Any] | None,
    structured: dict[str, Any] | None,
    guided: dict[str, Any],
) -> dict[str, Any] | None:
    """The engine's structured outputs of a request (None for free text); raises
    ``ValueError`` naming the field that cannot be served."""
    asked: list[tuple[str, dict[str, Any]]] = []
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            asked.append(("response_format", spec))
    if structured is not None:
        asked.append(("structured_outputs", _structured(structured)))
    for name, value in guided.items():
        if value is not None:
            asked.append((name, _kind(GUIDED_FIELDS[name], value, name)))
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise ValueError(f"{names}: give one way of structuring the output, not several")
    return asked[0][1] if asked else None


def _response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema: an object with the schema is needed")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:  # a name without a schema: any JSON object
            return {"json_object": True}
        return _kind("json", schema, "response_format.json_schema.schema")
    raise ValueError(
        f"response_format.type: {kind!r} is not supported (text, json_object or json_schema)"
    )


def _structured(value: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("structured_outputs: an object is needed")
    unknown = sorted(set(value) - set(STRUCTURED_KINDS))
    if unknown:
        raise ValueError(
            f"structured_outputs.{unknown[0]}: not supported (json, json_object, regex, "
            "choice or grammar)"
        )
    given = {name: v for name, v in value.items() if v not in (None, False)}
    if len(given) != 1:
        raise ValueError(
            "structured_outputs: give exactly one of json, json_object, regex, choice, grammar"
        )
    ((name, v),) = given.items()
    return _kind(name, v, f"structured_outputs.{name}")


def _kind(kind: str, value: Any, field: str) -> dict[str, Any]:
    if kind == "json":
        if isinstance(value, str):
            return {"json": value}
        if isinstance(value, dict | bool):
            return {"json": json.dumps(value)}
        raise ValueError(f"{field}: a JSON schema (an object, or its JSON text) is needed")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ValueError(f"{field}: a non-empty list of strings is needed")
        return {"choice": value}
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field}: a non-empty string is needed")
    return {kind: value}
