"""What a model name means: the one place that turns ``--model`` into a model directory.

- A built-in name (``builtin.BUILTIN_MODELS``): built or converted into the cache on first use.
- A name that looks like a path (:func:`looks_like_path`): a model directory, or a ``.gguf``
  file (converted once into the cache, ``gguf.py``); else, for ``org/name``, the snapshot
  of that Hugging Face hub model if the local Hugging Face cache holds it. Nothing is ever
  downloaded.

A bare name is never a path: ``tiny`` is the built-in model even when the working directory
has a ``tiny/``. :func:`resolve_model` runs in the executor (it may build with torch);
:func:`check_model` is the launcher's look before any stage starts, without torch: what it
refuses is one line, and it is fast once the cache holds the model.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from mpengine.models import gguf
from mpengine.models.builtin import BUILTIN_MODELS, PACKAGED_MODELS, TINY_MODELS, ModelError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def looks_like_path(name: str) -> bool:
    """Has a ``/``, starts with ``.`` or ``~``, or names a ``.gguf`` file."""
    return "/" in name or name.startswith((".", "~")) or name.endswith(".gguf")


def resolve_model(name: str) -> str:
    """The model directory of ``name``, building or converting it on first use."""
    if name in PACKAGED_MODELS:
        return gguf.convert_once(PACKAGED_MODELS[name].path(name))
    if name in TINY_MODELS:
        from mpengine.models.tiny import built_model

        return built_model(name)
    if not looks_like_path(name):
        raise ModelError(
            f"unknown model {name!r}: the built-in models are {BUILTIN_MODELS}; give a local "
            f"directory or GGUF file as a path (./{name}, /abs/dir, ~/dir)"
        )
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return path
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelError(f"model {name!r} is a file but not a GGUF file (*.gguf)")
        return gguf.convert_once(path)
    if (snapshot := cached_hub_snapshot(name)) is not None:
        return snapshot
    raise FileNotFoundError(
        f"model directory {path!r} does not exist, and {name!r} is not a Hugging Face hub "
        "model in the local cache (download it first: hf download NAME)"
    )


def gguf_source(name: str) -> str | None:
    """The GGUF file behind ``name`` (a built-in from a package, or a ``.gguf`` path)."""
    if name in PACKAGED_MODELS:
        return PACKAGED_MODELS[name].path(name)
    path = os.path.expanduser(name)
    return path if path.endswith(".gguf") and os.path.isfile(path) else None


def check_model(model: str, tokenizer: str | None = None) -> None:
    """Refuse, in one line, a model or tokenizer that cannot work: an unknown name, a path to
    nothing, a GGUF file that cannot be converted (or its conversion that the cache cannot
    hold), a GGUF file without a tokenizer and no ``tokenizer``, a tokenizer with more
    tokens than the model's vocabulary. Raises :class:`ModelError` (or ``GgufError``)."""
    if (
        tokenizer
        and looks_like_path(tokenizer)
        and not os.path.isdir(os.path.expanduser(tokenizer))
    ):
        raise ModelError(f"tokenizer directory {tokenizer!r} does not exist")
    source = gguf_source(model)
    vocab_size: int | None = None
    if source is not None:
        entry = gguf.converted_dir(source)
        if entry.is_dir():
            vocab_size = _config_vocab_size(entry)
        else:
            info = gguf.inspect(source)
            if not info.has_tokenizer and not tokenizer:
                raise ModelError(
                    f"{source}: the GGUF file has no tokenizer: give one with --tokenizer DIR"
                )
            gguf.check_room(info)
            vocab_size = info.vocab_size
    elif model in TINY_MODELS:
        return
    elif not looks_like_path(model):
        raise ModelError(
            f"unknown model {model!r}: the built-in models are {BUILTIN_MODELS}; give a local "
            f"directory or GGUF file as a path (./{model}, /abs/dir, ~/dir)"
        )
    elif os.path.isdir(path := os.path.expanduser(model)):
        vocab_size = _config_vocab_size(Path(path))
    elif os.path.exists(path):
        raise ModelError(f"model {model!r} is a file but not a GGUF file (*.gguf)")
    elif model.startswith(("/", ".", "~")):  # (org/name may be a hub id in the local cache)
        raise ModelError(f"model directory {model!r} does not exist")
    if tokenizer and vocab_size is not None:
        _check_vocabulary(tokenizer, vocab_size)


def _config_vocab_size(directory: Path) -> int | None:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None  # (the executor's loader says what is wrong with it)
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) else None


def _check_vocabulary(tokenizer: str, vocab_size: int) -> None:
    """A tokenizer whose ids reach past the model's embedding belongs to another model
    (fewer is fine: models pad their vocabulary)."""
    file = Path(os.path.expanduser(tokenizer)) / "tokenizer.json"
    if not file.is_file():
        return
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # (tokenizers raises its own Exception type)
        raise ModelError(f"tokenizer {str(file)!r} cannot be read: {exc}") from None
    if size > vocab_size:
        raise ModelError(
            f"tokenizer {tokenizer!r} has {size} tokens but the model's vocabulary has "
            f"{vocab_size}: it is not this model's tokenizer"
        )


def cached_hub_snapshot(name: str) -> str | None:
    """The local snapshot directory of Hugging Face hub model ``org/name`` if the local
    cache holds it (``HF_HUB_CACHE`` / ``HF_HOME`` say where), else None. Never downloads,
    whatever ``HF_HUB_OFFLINE`` says. Only a name of that form qualifies: a path that
    happens not to exist (``./x/y``, ``/models/x``, ``~/x``) is never looked up."""
    if not _HUB_ID.fullmatch(name) or ".." in name:
        return None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        path = snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None
    return str(path) if os.path.isdir(path) else None
