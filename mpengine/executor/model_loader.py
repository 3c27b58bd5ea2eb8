"""Load a Hugging Face model for execution and check that it fits the design.

Three kinds: a causal LM (generates; embeds too when its directory declares pooling or
``--pooling`` says how), a decoder base model (``Qwen3Model``: embeds only), both run paged
with :data:`~mpengine.executor.attention.ATTENTION_NAME` swapped in; and an encoder (BERT
family: embeds only), run with upstream attention over padded batches of whole prompts, no
KV cache. The model code stays upstream's. What the engine cannot reproduce exactly is
rejected here, at start-up, with a message that says what to change (for decoders, after a
test forward that shows what their attention does: ``model_audit``).

Pooling is read where sentence-transformers writes it: ``modules.json`` lists the modules
(a ``Pooling`` module's ``config.json`` names the mode, a ``Normalize`` module normalises),
``sentence_bert_config.json`` the longest input.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
)
from transformers.distributed import DistributedConfig
from transformers.utils import logging as hf_logging

from mpengine.config import EngineConfig
from mpengine.executor.attention import ATTENTION_NAME
from mpengine.executor.model_audit import AttentionGeometry, UnsupportedModel, audit_attention
from mpengine.executor.paged_attention import register_attention
from mpengine.executor.tensor_parallel import check_plan
from mpengine.models.resolve import resolve_model
from mpengine.protocol import INT32_MAX, Pooling, PoolingInfo, SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# RoPE variants that choose their frequencies from max(position_ids): in a flattened batch
# that is the largest position of any request, not of the request itself.
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for paged execution, with the geometry the KV cache needs."""

    model: torch.nn.Module
    path: str
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    pooling: PoolingInfo | None = None  # None: cannot embed
    can_generate: bool = True
    sampling_defaults: dict[str, int | float] = field(default_factory=dict)

    @property
    def is_encoder(self) -> bool:
        return self.pooling is not None and self.pooling.is_encoder


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """``auto``: float32 on the CPU (exact and fast enough there); the checkpoint's dtype on
    a GPU, bfloat16 when the checkpoint is float32 or says nothing."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = _DTYPES.get(stored)
    return stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16


def load_model(config: EngineConfig) -> LoadedModel:
    """Load ``config.model`` (paged attention for decoders) and validate it."""
    path = resolve_model(config.model)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    hf_config = AutoConfig.from_pretrained(path)
    text_config = hf_config.get_text_config()
    kind = _model_kind(hf_config)
    declared = sentence_transformers_pooling(path)
    max_model_len = _max_model_len(config, text_config, declared.max_seq_length)
    _check_rope(text_config, max_model_len)
    _check_sliding_window(text_config, max_model_len)
    _check_chunked_attention(text_config, max_model_len)

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, text_config, device)
    model = _from_pretrained(path, kind, hf_config, dtype, config.tensor_parallel_size)
    model.to(device).eval()
    geometry = _attention_geometry(model, kind, text_config, device)
    pooling = _pooling_info(config, kind, declared, text_config.hidden_size)
    output = model.get_output_embeddings() if kind == "causal" else None
    vocab_size = (output or model.get_input_embeddings()).weight.shape[0]
    logger.info(
        "loaded %s (%s) on %s as %s, max_model_len %d, pooling %s",
        path,
        type(model).__name__,
        device,
        dtype,
        max_model_len,
        pooling,
    )
    return LoadedModel(
        model=model,
        path=path,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        eos_token_ids=_eos_token_ids(path, text_config) if kind == "causal" else [],
        num_layers=text_config.num_hidden_layers,
        num_heads=geometry.num_heads,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        pooling=pooling,
        can_generate=kind == "causal",
        sampling_defaults=(
            sampling_defaults(path, config.generation_config) if kind == "causal" else {}
        ),
    )


def check_tensor_parallel(config: EngineConfig) -> None:
    """Refuse a model that ``tensor_parallel_size`` ranks cannot split, from its config
    alone (each rank, before it joins the others: ``tensor_parallel.check_plan``)."""
    hf_config = AutoConfig.from_pretrained(resolve_model(config.model))
    device = resolve_device(config.device)
    size, per_host = config.tensor_parallel_size, config.ranks_per_node
    check_plan(hf_config, _model_kind(hf_config), size, device, per_host)


def _from_pretrained(
    path: str, kind: str, hf_config: PretrainedConfig, dtype: torch.dtype, tp_size: int = 1
) -> torch.nn.Module:
    """The model of ``kind`` (see :func:`_model_kind`): an encoder with upstream attention,
    a decoder with the paged attention function; split by its tensor-parallel plan over
    ``tp_size`` ranks (their process group created already, see ``tensor_parallel``)."""
    hf_logging.disable_progress_bar()  # the stage logs its own one-line summary
    if kind == "encoder":
        # Upstream attention (SDPA) with a padding mask: bidirectional, no KV cache.
        return AutoModel.from_pretrained(path, attn_implementation="sdpa", dtype=dtype)
    register_attention()
    auto_class = AutoModelForCausalLM if kind == "causal" else AutoModel
    try:
        kwargs = {}
        if tp_size > 1:
            kwargs["distributed_config"] = DistributedConfig(tp_size=tp_size)
        return auto_class.from_pretrained(
            path, attn_implementation=ATTENTION_NAME, dtype=dtype, **kwargs
        )
    except KeyError as exc:
        if exc.args != (ATTENTION_NAME,):
            raise
        raise NotImplementedError(
            f"{hf_config.model_type} models cannot be served: their code does not take "
            "an attention function through transformers' attention interface"
        ) from None


def _attention_geometry(
    model: torch.nn.Module, kind: str, text_config: PretrainedConfig, device: torch.device
) -> AttentionGeometry:
    """A decoder's, as its test forward shows it (``model_audit``, which refuses what the
    paged attention cannot serve); an encoder's (upstream attention), from its config."""
    if kind != "encoder":
        try:
            return audit_attention(model, text_config.num_hidden_layers, kind == "causal", device)
        except UnsupportedModel as exc:
            raise NotImplementedError(
                f"{type(model).__name__} cannot be served exactly: {exc}"
            ) from None
    num_heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    return AttentionGeometry(num_heads, num_kv_heads, head_dim)


def _model_kind(hf_config: PretrainedConfig) -> str:
    """``causal`` (a causal LM head), ``decoder`` (a decoder's base model, such as
    ``Qwen3Model``: embeddings only) or ``encoder`` (BERT family); anything else is refused.
    The checkpoint's architecture decides: a ``BertModel`` checkpoint has a causal-LM class
    in transformers, but is an encoder."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_MAPPING_NAMES,
    )

    model_type = hf_config.model_type
    if getattr(hf_config, "is_encoder_decoder", False):
        raise NotImplementedError(f"encoder-decoder models ({model_type}) are not supported")
    architectures = getattr(hf_config, "architectures", None) or []
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        causal_heads = {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)}
        if not any(arch in causal_heads for arch in architectures):
            return "encoder"
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        causal_heads = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
        if not architectures or any(arch in causal_heads for arch in architectures):
            return "causal"
        if MODEL_MAPPING_NAMES.get(model_type) in architectures:
            return "decoder"
    raise NotImplementedError(
        f"{model_type!r} ({', '.join(architectures) or 'no architecture'}) is neither a "
        "causal language model, a decoder base model nor a BERT-family encoder"
    )


@dataclass(frozen=True, slots=True)
class DeclaredPooling:
    """What a sentence-transformers model directory says (all None when it says nothing)."""

    pooling: Pooling | None = None
    normalize: bool | None = None
    max_seq_length: int | None = None


# sentence-transformers' pooling modes (flags and the newer single name) -> ours.
_ST_MODES: dict[str, Pooling] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
    "cls": "cls",
    "mean": "mean",
    "lasttoken": "last",
}


def sentence_transformers_pooling(path: str) -> DeclaredPooling:
    """Read ``modules.json`` and the files it points to. Modules this engine cannot apply
    (a ``Dense`` projection, max pooling) are refused rather than silently skipped."""
    root = Path(path)
    try:
        modules = json.loads((root / "modules.json").read_text())
    except FileNotFoundError:
        return DeclaredPooling()
    pooling: Pooling | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            settings = json.loads((root / module.get("path", "") / "config.json").read_text())
            modes = [m for k, m in _ST_MODES.items() if settings.get(k) is True]
            if isinstance(settings.get("pooling_mode"), str):
                modes.append(_ST_MODES.get(settings["pooling_mode"], settings["pooling_mode"]))
            if len(set(modes)) != 1 or modes[0] not in ("cls", "mean", "last"):
                raise NotImplementedError(
                    f"{root / module.get('path', '')}: pooling {settings} is not supported "
                    "(one of CLS, mean or last-token pooling is)"
                )
            pooling = modes[0]
        else:
            raise NotImplementedError(
                f"{root / 'modules.json'}: the module {module.get('type')!r} is not supported "
                "(Transformer, Pooling and Normalize are)"
            )
    max_seq_length = None
    with contextlib.suppress(FileNotFoundError):
        bert_config = json.loads((root / "sentence_bert_config.json").read_text())
        max_seq_length = bert_config.get("max_seq_length")
    return DeclaredPooling(pooling, normalize if pooling else None, max_seq_length)


def _pooling_info(
    config: EngineConfig, kind: str, declared: DeclaredPooling, hidden_size: int
) -> PoolingInfo | None:
    """How the model embeds: ``config.pooling`` when set, else what its directory declares,
    else the kind's convention (decoder base models: last token; encoders: CLS). A causal
    LM that declares nothing embeds only when ``--pooling`` says how."""
    pooling = config.pooling if config.pooling != "auto" else declared.pooling
    if config.pooling == "cls" and kind != "encoder":
        raise ValueError(
            "pooling cls needs an encoder model: the first token of a causal model attends "
            "to nothing but itself (use last or mean)"
        )
    if pooling == "none":
        if kind != "causal":
            raise ValueError(
                "pooling none leaves this model nothing to do: it cannot generate (it has no "
                "language-model head), only embed"
            )
        return None
    if pooling is None:
        if kind == "causal":
            return None
        pooling = "last" if kind == "decoder" else "cls"
    normalize = declared.normalize if declared.normalize is not None else True
    return PoolingInfo(pooling, normalize, hidden_size, is_encoder=kind == "encoder")


def _max_model_len(
    config: EngineConfig, text_config: PretrainedConfig, declared: int | None = None
) -> int:
    """``config.max_model_len``, checked against the model's positions; by default those
    positions, or less where sentence-transformers declares a shorter input."""
    supported = getattr(text_config, "max_position_embeddings", None) or getattr(
        text_config, "n_positions", None
    )
    if config.max_model_len is None and declared:
        return int(min(declared, supported or declared))
    if config.max_model_len is None:
        if supported is None:
            raise ValueError("the model states no maximum length: set max_model_len")
        return int(supported)
    if supported is not None and config.max_model_len > supported:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's maximum of {supported}"
        )
    return config.max_model_len


def _rope_types(text_config: PretrainedConfig) -> list[tuple[str, dict]]:
    """(rope_type, parameters) for every RoPE configuration of the model (several when
    layer types have their own)."""
    params = getattr(text_config, "rope_parameters", None) or getattr(
        text_config, "rope_scaling", None
    )
    if not isinstance(params, dict):
        return []
    if "rope_type" in params or "type" in params:
        return [(str(params.get("rope_type", params.get("type"))), params)]
    return [
        (str(p.get("rope_type", p.get("type"))), p) for p in params.values() if isinstance(p, dict)
    ]


def _check_rope(text_config: PretrainedConfig, max_model_len: int) -> None:
    """Position-dependent RoPE matches a per-request computation only while no position
    exceeds the original context, where both variants keep their unscaled frequencies
    (dynamic NTK grows past ``max_position_embeddings``, longrope switches to its long
    factors past ``original_max_position_embeddings``)."""
    for rope_type, params in _rope_types(text_config):
        if not any(kind in rope_type for kind in _POSITION_DEPENDENT_ROPE):
            continue
        original = params.get("original_max_position_embeddings") or getattr(
            text_config, "original_max_position_embeddings", None
        )
        if original is None and "dynamic" in rope_type:
            original = getattr(text_config, "max_position_embeddings", None)
        if original is None or max_model_len > original:
            raise NotImplementedError(
                f"RoPE type {rope_type!r} picks its frequencies from the longest position in "
                f"the batch; set max_model_len <= {original} (the original context) to use it"
            )


def _check_sliding_window(text_config: PretrainedConfig, max_model_len: int) -> None:
    """A window at least as long as the model never binds; shorter ones are not implemented."""
    window = getattr(text_config, "sliding_window", None)
    if window is None or window >= max_model_len:
        return
    layer_types = getattr(text_config, "layer_types", None)
    # Qwen2-style configs may keep a window while marking every layer full attention.
    if layer_types and "sliding_attention" not in layer_types:
        return
    raise NotImplementedError(
        f"sliding-window attention (window {window}) is not supported: "
        f"set max_model_len <= {window}"
    )


def _check_chunked_attention(text_config: PretrainedConfig, max_model_len: int) -> None:
    """Llama 4's chunked attention (a layer attends within aligned chunks only) binds once
    a context is longer than a chunk; it is not implemented."""
    chunk = getattr(text_config, "attention_chunk_size", None)
    if chunk is not None and chunk < max_model_len:
        raise NotImplementedError(
            f"chunked attention (chunks of {chunk}) is not supported: set max_model_len <= {chunk}"
        )


# generation_config.json's names of the sampling defaults vLLM takes from it.
GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(path: str, source: str) -> dict[str, int | float]:
    """The default sampling parameters ``source`` gives (see ``EngineConfig``'s
    ``generation_config``): the values its generation_config.json sets, each checked
    alone (one out of range is left out, with a warning)."""
    if source in ("none", "vllm"):
        return {}
    directory = path if source == "auto" else source
    file = os.path.join(directory, "generation_config.json")
    if source != "auto" and not os.path.isfile(file):
        raise FileNotFoundError(f"generation_config: no generation_config.json in {source!r}")
    try:
        with open(file, encoding="utf-8") as f:
            values = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("generation_config: %s cannot be read (%s): no defaults from it", file, exc)
        return {}
    defaults: dict[str, int | float] = {}
    for name, field_name in GENERATION_DEFAULTS.items():
        value = values.get(name) if isinstance(values, dict) else None
        if value is None:
            continue
        if (
            field_name in ("top_k", "max_tokens")
            and isinstance(value, float)
            and value.is_integer()
        ):
            value = int(value)  # (written 20.0)
        if field_name == "max_tokens" and isinstance(value, int) and value > INT32_MAX:
            value = INT32_MAX  # (as many as fit)
        try:
            # As the parameters hold it (top_k -1 is 0, "no top-k").
            value = getattr(SamplingParams(**{field_name: value}), field_name)
        except (TypeError, ValueError) as exc:
            logger.warning("generation_config: %s=%r left out: %s", name, value, exc)
            continue
        defaults[field_name] = value
    if defaults:
        logger.info(
            "default sampling parameters from %s: %s (--generation-config none: the engine's)",
            file,
            defaults,
        )
    return defaults


def _eos_token_ids(path: str, text_config: PretrainedConfig) -> list[int]:
    eos: int | list[int] | None = None
    with contextlib.suppress(OSError):  # no generation_config.json
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    if eos is None:
        eos = getattr(text_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
