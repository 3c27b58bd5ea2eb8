"""Deterministic tiny Hugging Face models, built offline for tests and benchmarks.

`build(arch, out_dir, preset)` writes a model directory that `transformers` loads with
`AutoModelForCausalLM` (qwen3, llama, gpt2) or `AutoModel` (bert), plus a byte-level BPE
tokenizer trained on the bundled corpus (see `tiny_tokenizer`); embedding models also get
sentence-transformers' `modules.json` and pooling configuration. Building twice gives
byte-identical files. `built_model(name)` maps the short names in KNOWN_MODELS to a
directory in the model cache, building it on first use.

Weights are random but not HF's default init (std 0.02): that gives nearly flat logits
(tiny Llama: median top-1/top-2 gap 0.05, 2% of greedy steps below 1e-3, where a different
but correct kernel may flip the choice), and tied models that repeat one token forever.
Here every linear layer keeps its input's scale (std 1/sqrt(fan_in)) and the logits have
a standard deviation of about LOGIT_STD: the median gap is ~1 and no step in several
hundred comes within 1e-4. Norm scales and biases are random too, so an engine that
skips one of them produces different tokens.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenizers
import torch
import transformers
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.pytorch_utils import Conv1D
from transformers.utils import logging as hf_logging

import mpengine.models.tiny_tokenizer as tiny_tokenizer
from mpengine.models.builtin import TINY_MODELS
from mpengine.models.cache import build_once, cache_root
from mpengine.models.tiny_tokenizer import (
    BERT_TOKENIZER,
    GPT2_TOKENIZER,
    LLAMA_TOKENIZER,
    QWEN3_TOKENIZER,
    TokenizerSpec,
    corpus_digest,
    train_tokenizer,
    write_tokenizer,
)

SEED = 20240611
# Target standard deviation of the logits over the vocabulary.
LOGIT_STD = 4.0
# The norm applied just before the output projection, by architecture.
_FINAL_NORMS = ("model.norm", "transformer.ln_f")

# Short name -> (arch, preset): the built-in tiny models.
KNOWN_MODELS = TINY_MODELS

# Embedding models: (arch, preset) -> the sentence-transformers pooling mode they declare
# (then normalised), as all-MiniLM-L6-v2 (mean) and Qwen3-Embedding (last token) do.
_POOLING: dict[tuple[str, str], str] = {
    ("bert", "tiny"): "mean",
    ("qwen3", "embed"): "last",
    ("qwen3", "0.6b-shape-embed"): "last",
}

_TOKENIZERS: dict[str, TokenizerSpec] = {
    "qwen3": QWEN3_TOKENIZER,
    "llama": LLAMA_TOKENIZER,
    "gpt2": GPT2_TOKENIZER,
    "bert": BERT_TOKENIZER,
}


def _decoder(
    hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, **extra: object
) -> dict[str, object]:
    """A Llama-family decoder's hyper-parameters (Qwen3 and Llama name them alike)."""
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=4096,
        **extra,
    )


_GPT2_NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
# Architecture hyper-parameters, as keyword arguments of the HF config class.
_PRESETS: dict[tuple[str, str], dict[str, object]] = {
    # Tied embeddings as in Qwen3-0.6B, and head_dim 32 != hidden / heads as in every
    # Qwen3 (0.6B: 1024 hidden, 16 heads of 128).
    ("qwen3", "tiny"): _decoder(64, 4, 4, 2, 192, head_dim=32, tie_word_embeddings=True),
    # ~26M parameters: big enough that the forward pass dominates a step. Untied like
    # Qwen3-8B; its greedy text is also more varied than a tied one's.
    ("qwen3", "small"): _decoder(512, 8, 8, 4, 1408, head_dim=64, tie_word_embeddings=False),
    # Qwen3-0.6B's dimensions with random weights, for benchmarks on a device (~600M
    # parameters: 2.4 GB of float32 in the cache). The embedding and LM head have the real
    # model's 151,936 rows (the LM head and sampling over them are a visible share of a
    # decode step), though the built-in tokenizer names only the first 2,048.
    ("qwen3", "0.6b-shape"): _decoder(
        1024, 28, 16, 8, 3072, head_dim=128, vocab_size=151_936, tie_word_embeddings=True
    ),
    ("llama", "tiny"): _decoder(64, 2, 4, 2, 160, tie_word_embeddings=False),
    ("gpt2", "tiny"): dict(
        n_embd=64, n_layer=2, n_head=4, n_inner=256, n_positions=2048, **_GPT2_NO_DROPOUT
    ),
    ("bert", "tiny"): dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
}
# Decoder embedding models (Qwen3-Embedding style): a causal LM whose directory declares
# last-token pooling, so it embeds and generates.
_PRESETS["qwen3", "embed"] = _PRESETS["qwen3", "tiny"]
_PRESETS["qwen3", "0.6b-shape-embed"] = _PRESETS["qwen3", "0.6b-shape"]


@dataclass(frozen=True)
class ModelSpec:
    """Everything that determines a built model's files."""

    arch: str
    preset: str
    hparams: tuple[tuple[str, object], ...]
    tokenizer: TokenizerSpec

    @property
    def is_causal_lm(self) -> bool:
        return self.arch != "bert"

    def digest(self) -> str:
        """A short hash of everything a build depends on: the spec, the builder's code,
        the corpus and the library versions. Any change gives a new cache entry."""
        key = {
            "spec": asdict(self),
            "builder": _builder_digest(),
            "corpus": corpus_digest(),
            "versions": [transformers.__version__, tokenizers.__version__, torch.__version__],
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


@functools.cache
def _builder_digest() -> str:
    """A hash of this module and the tokenizer module: editing either invalidates the cache,
    with no version number to forget to bump."""
    digest = hashlib.sha256()
    for module in (__file__, tiny_tokenizer.__file__):
        digest.update(Path(module).read_bytes())
    return digest.hexdigest()


def model_spec(arch: str, preset: str = "tiny") -> ModelSpec:
    """The spec of `arch` at `preset`; raises ValueError for an unknown combination."""
    if (arch, preset) not in _PRESETS:
        raise ValueError(f"unknown arch/preset {arch}/{preset}; known: {sorted(_PRESETS)}")
    hparams = tuple(sorted(_PRESETS[arch, preset].items()))
    return ModelSpec(arch, preset, hparams, _TOKENIZERS[arch])


def model_config(spec: ModelSpec) -> PretrainedConfig:
    """The Hugging Face config of `spec`: its hyper-parameters, the vocabulary size of its
    tokenizer (unless they say a larger one, as real models pad theirs), and the ids of its
    BOS / EOS / padding tokens."""
    hparams = {"vocab_size": train_tokenizer(spec.tokenizer).get_vocab_size(), **dict(spec.hparams)}
    config = AutoConfig.for_model(spec.arch, **hparams, **_special_ids(spec))
    config.dtype = torch.float32
    return config


def _special_ids(spec: ModelSpec) -> dict[str, int]:
    roles = ("bos_token", "eos_token", "pad_token")
    ids = {f"{role}_id": spec.tokenizer.role_id(role) for role in roles}
    return {key: value for key, value in ids.items() if value is not None}


def build(arch: str, out_dir: str | os.PathLike[str], preset: str = "tiny") -> Path:
    """Write the model `arch` at `preset` (see KNOWN_MODELS) into `out_dir`.

    The directory holds config.json, model.safetensors (float32), generation_config.json
    (causal LMs), tokenizer.json and tokenizer_config.json. Needs no network.
    """
    spec = model_spec(arch, preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(spec.tokenizer, out)
    auto_class = AutoModelForCausalLM if spec.is_causal_lm else AutoModel
    # HF's own init draws from the global generator: keep the caller's state untouched.
    with torch.random.fork_rng(devices=[]):
        model = auto_class.from_config(model_config(spec), dtype=torch.float32)
    _init_weights(model)
    if spec.is_causal_lm:
        # Only the token ids: sampling defaults here would become an engine's defaults.
        model.generation_config = GenerationConfig(**_special_ids(spec))
    with _quiet_progress_bars():
        model.save_pretrained(out)
    if (pooling := _POOLING.get((arch, preset))) is not None:
        _write_sentence_transformers(out, pooling, model.config.hidden_size)
    return out


def _write_sentence_transformers(out: Path, pooling: str, hidden_size: int) -> None:
    """The files sentence-transformers reads: Transformer -> Pooling -> Normalize."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    flags = {"cls": "cls_token", "mean": "mean_tokens", "last": "lasttoken"}
    settings = {"word_embedding_dimension": hidden_size}
    settings |= {f"pooling_mode_{flag}": mode == pooling for mode, flag in flags.items()}
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(settings, indent=2))


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' progress bars for one block, restoring the caller's setting."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@torch.no_grad()
def _init_weights(model: PreTrainedModel) -> None:
    """Overwrite every parameter from one seeded generator, in module order."""
    generator = torch.Generator().manual_seed(SEED)
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    tied = output is not None and output.weight is embedding.weight
    hidden = embedding.embedding_dim
    # Tied: the embedding is the output projection, so its scale sets the logits'. Untied:
    # a unit-scale embedding, as large as what each layer adds to the residual stream.
    embed_std = LOGIT_STD / hidden**0.5 if tied else 1.0
    seen: set[int] = set()
    names = {module: name for name, module in model.named_modules()}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied weight: initialised once, as the embedding
                continue
            seen.add(id(param))
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if module is output and not tied:
                param.copy_(noise * (LOGIT_STD / hidden**0.5))
            elif isinstance(module, nn.Embedding):
                param.copy_(noise * embed_std)
            elif isinstance(module, nn.Linear | Conv1D) and name == "weight":
                fan_in = param.shape[1] if isinstance(module, nn.Linear) else param.shape[0]
                param.copy_(noise / fan_in**0.5)
            elif name == "bias":
                param.copy_(noise * 0.1)
            else:  # the scale of a RMSNorm / LayerNorm: around one, not exactly one
                param.copy_(1.0 + noise * 0.2)
                if names[module] in _FINAL_NORMS:
                    # With tied embeddings the final hidden state still resembles the input
                    # token's embedding, whose logit then wins: greedy decoding repeats one
                    # token forever. Random signs here decorrelate the two.
                    signs = torch.randint(0, 2, param.shape, generator=generator) * 2 - 1
                    param.mul_(signs)


def built_model(name: str) -> str:
    """The directory of the built-in model ``name`` (a key of KNOWN_MODELS), built into the
    model cache on first use (once, however many engines ask at the same time: see
    ``mpengine.models.cache``). Model names in general: ``mpengine.models.resolve``."""
    arch, preset = KNOWN_MODELS[name]
    final = cache_root() / f"{name}-{model_spec(arch, preset).digest()}"
    return str(build_once(final, lambda out: build(arch, out, preset), f"the model {name!r}"))


@torch.no_grad()
def greedy_margins(
    model: PreTrainedModel, input_ids: list[int], num_steps: int
) -> tuple[list[int], list[float]]:
    """Greedy-decode exactly `num_steps` tokens (EOS suppressed); return the tokens and,
    per step, the gap between the two largest raw logits.

    A gap below ~1e-4 is a near-tie: float noise in a correct engine could flip it."""
    prompt = torch.tensor([input_ids], device=model.device)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=num_steps,
        min_new_tokens=num_steps,
        output_logits=True,
        return_dict_in_generate=True,
    )
    top2 = torch.stack(out.logits)[:, 0].float().topk(2).values
    return out.sequences[0, len(input_ids) :].tolist(), (top2[:, 0] - top2[:, 1]).tolist()
