"""GGUF files as models: checked without torch, converted once into the model cache.

transformers loads a GGUF file by dequantizing it into an ordinary model (``from_pretrained(
DIR, gguf_file=NAME)``, needing the ``gguf`` package), and rebuilds its tokenizer and chat
template from the file's metadata. Doing that at every start costs tens of seconds, so the
result is saved once as an ordinary model directory (safetensors in float32, as dequantized;
the tokenizer, its chat template and the generation config), keyed by the file's SHA-256
and the converter's version: the same file under another name or path is the same entry.

:func:`inspect` reads the header only (``gguf``'s reader maps the file; no torch): the
launcher runs it before any stage starts, so a file that is not a GGUF, is truncated, holds
an architecture or a quantization type that transformers cannot dequantize, or has no
tokenizer and no ``--tokenizer`` beside it, is refused in one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mpengine.models.cache import build_once, cache_root

logger = logging.getLogger(__name__)

# Bump when the converted directory's files change for the same GGUF file.
CONVERTER_VERSION = 1

# llama.cpp's architecture names that transformers knows under another name.
_ARCH_ALIASES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
# Architectures transformers converts but this engine cannot serve (it says why).
_NOT_SERVED = {
    "t5": "an encoder-decoder model",
    "t5encoder": "an encoder-decoder model",
    "umt5": "an encoder-decoder model",
    "mamba": "a state-space model (no attention to page)",
}


class GgufError(ValueError):
    """A GGUF file that cannot be served: one line naming the file and the reason."""


@dataclass(frozen=True, slots=True)
class GgufInfo:
    path: str
    architecture: str
    has_tokenizer: bool
    vocab_size: int
    # Parameters as dequantized (float32: 4 bytes each, the converted entry's size).
    num_parameters: int


def inspect(path: str) -> GgufInfo:
    """Read and check ``path``'s header; raises :class:`GgufError`."""
    try:
        import gguf
        from gguf.quants import _type_traits  # the types it dequantizes
    except ImportError:
        raise GgufError(
            f"{path}: GGUF files need the gguf package (pip install gguf accelerate)"
        ) from None
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, OSError) as exc:
        raise GgufError(f"{path}: not a readable GGUF file ({exc})") from None
    size = os.path.getsize(path)
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if not reader.tensors or end > size:
        raise GgufError(f"{path}: truncated GGUF file ({size} bytes, its tensors need {end})")
    field = reader.fields.get("general.architecture")
    if field is None:
        raise GgufError(f"{path}: the GGUF file names no architecture (general.architecture)")
    architecture = str(field.contents())
    _check_architecture(path, architecture)
    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    unknown = sorted(
        {t.tensor_type.name for t in reader.tensors} - {q.name for q in (*_type_traits, *plain)}
    )
    if unknown:
        raise GgufError(
            f"{path}: quantization type {', '.join(unknown)} cannot be dequantized by the "
            "gguf package installed"
        )
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise GgufError(f"{path}: the GGUF file has no token embedding (token_embd.weight)")
    return GgufInfo(
        path=path,
        architecture=architecture,
        has_tokenizer="tokenizer.ggml.tokens" in reader.fields,
        vocab_size=int(embedding.shape[-1]),
        num_parameters=sum(int(t.n_elements) for t in reader.tensors),
    )


def _check_architecture(path: str, architecture: str) -> None:
    name = _ARCH_ALIASES.get(architecture, architecture)
    if name in _NOT_SERVED:
        raise GgufError(f"{path}: {architecture} is {_NOT_SERVED[name]}, which is not served")
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    except ImportError:  # (a transformers that moved it: its loader will say)
        return
    known = set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"}
    if name not in known and architecture not in known:
        raise GgufError(
            f"{path}: transformers cannot load GGUF files of architecture {architecture!r} "
            f"(it loads {', '.join(sorted(known - set(_NOT_SERVED)))})"
        )


def converted_dir(path: str) -> Path:
    """The cache entry of ``path``'s conversion (which may not exist yet)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(hashlib.file_digest(f, "sha256").digest())
    transformers_version = importlib.metadata.version("transformers")
    digest.update(f"{CONVERTER_VERSION}:{transformers_version}".encode())
    return cache_root() / f"gguf-{digest.hexdigest()[:16]}"


def check_room(info: GgufInfo) -> None:
    """Refuse before converting when the cache cannot hold the entry."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as exc:
        raise GgufError(
            f"{info.path}: the model cache {root} is not writable ({exc.strerror or exc}): set "
            "MPENGINE_CACHE_DIR to a writable directory"
        ) from None
    need = info.num_parameters * 4 + (64 << 20)  # float32 weights, the tokenizer, slack
    free = shutil.disk_usage(root).free
    if free < need:
        raise GgufError(
            f"{info.path}: the model cache {root} has {free >> 20} MiB free, the converted "
            f"model needs {need >> 20} MiB: free space there or set MPENGINE_CACHE_DIR"
        )


def convert_once(path: str) -> str:
    """The directory of ``path`` converted (converting it now unless the cache holds it)."""
    final = converted_dir(path)
    return str(build_once(final, lambda out: convert(path, out), f"the conversion of {path}"))


def convert(path: str, out: Path) -> None:
    """Dequantize ``path`` into a model directory ``out`` (float32 safetensors, config,
    generation config, and the tokenizer with its chat template when the file has one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    info = inspect(path)
    directory, name = os.path.split(os.path.abspath(path))
    logger.warning(
        "converting %s into the model cache (once: %.0fM parameters, about %d s here)",
        path,
        info.num_parameters / 1e6,
        max(5, info.num_parameters // 5_000_000),
    )
    hf_logging.disable_progress_bar()
    with _tqdm_disabled():  # (transformers' GGUF loader has a bar of its own)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    # Saved as what it now is: an ordinary float32 model, no longer "quantized with gguf".
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    model.save_pretrained(out)
    if info.has_tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _tqdm_disabled() -> Iterator[None]:
    saved = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TQDM_DISABLE"]
        else:
            os.environ["TQDM_DISABLE"] = saved
