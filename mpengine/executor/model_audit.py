"""What a decoder's attention really does, found out by one test forward at start-up.

The engine runs the model's own code and swaps in only the attention function, so it serves
a model exactly when every layer's attention goes through that function once per forward
and nothing else keeps state between steps. Models that break this load and run all the
same, and then generate wrong tokens without an error: layers that compute attention
themselves (BLOOM, XGLM), state-space, convolution or linear-attention layers whose state no
KV cache holds (Mamba, Jamba, Falcon-H1, LFM2, Qwen3-Next...), two attention calls per layer
(DiffLlama), attention arguments the paged kernels do not apply (GPT-OSS's sinks, Gemma 2's
logit soft-capping), a model-made mask (Doge), or layers that drop the step's metadata.

:func:`audit_attention` runs a five-token forward with a recording function in place of the
paged one (its result is zeros: only the calls matter) and refuses such models with a
message naming the cause. It also returns the geometry the calls show (query heads, KV
heads, head size), which the KV cache is sized from: a config's ``num_key_value_heads`` that
the model's code does not use (GPT-2's configs may carry one) must not shape the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from mpengine.executor.attention import ATTENTION_NAME, METADATA_KWARG

# Forward arguments that reach the attention function and that it handles (or that do not
# change attention): anything else with a value is refused.
HANDLED_KWARGS = frozenset(
    {
        METADATA_KWARG,
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "output_router_logits",
        "sliding_window",  # checked against max_model_len (model_loader)
        "is_causal",
    }
)
PROBE_TOKENS = 5


@dataclass(frozen=True, slots=True)
class AttentionGeometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(slots=True)
class _Call:
    layer_idx: object
    module: int
    heads: int
    kv_heads: int
    key_dim: int
    value_dim: int
    has_mask: bool
    kwargs: frozenset[str]
    has_metadata: bool


class UnsupportedModel(NotImplementedError):
    """The model cannot be served exactly; the message says why."""


def audit_attention(
    model: torch.nn.Module, num_layers: int, causal_lm: bool, device: torch.device
) -> AttentionGeometry:
    """Run the test forward; raise :class:`UnsupportedModel` for a model the paged
    attention cannot serve exactly, else return the attention geometry it showed."""
    stateful = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if any(isinstance(child, torch.nn.Conv1d) for child in m.children())
        }
    )
    if stateful:
        raise UnsupportedModel(
            f"its {', '.join(stateful)} layers run a causal convolution: state-space, "
            "convolution and linear-attention layers keep state between steps that the paged "
            "KV cache does not hold"
        )
    calls = _record(model, causal_lm, device)
    if not calls:
        raise UnsupportedModel(
            "its layers compute attention themselves instead of calling transformers' "
            "attention interface, so they cannot use the paged KV cache"
        )
    per_module: dict[int, int] = {}
    for call in calls:
        per_module[call.module] = per_module.get(call.module, 0) + 1
    if max(per_module.values()) > 1:
        raise UnsupportedModel(
            f"a layer calls attention {max(per_module.values())} times per forward "
            "(differential attention or the like); each call would overwrite the layer's cache"
        )
    if len(per_module) < num_layers:
        raise UnsupportedModel(
            f"only {len(per_module)} of its {num_layers} layers use attention: the others "
            "(recurrent, state-space or linear-attention layers) keep state between steps that "
            "the paged KV cache does not hold"
        )
    layer_ids = sorted(str(c.layer_idx) for c in calls)
    if layer_ids != sorted(str(i) for i in range(num_layers)):
        raise UnsupportedModel(
            f"its attention layers are numbered {layer_ids}, not 0..{num_layers - 1}: the "
            "engine finds each layer's cache by its layer_idx"
        )
    if not all(c.has_metadata for c in calls):
        raise UnsupportedModel(
            "its layers do not pass the forward's keyword arguments on to the attention "
            "function, which needs them to find the step's sequences in the paged cache"
        )
    if any(c.has_mask for c in calls):
        raise UnsupportedModel(
            "it builds an attention mask of its own, which the paged attention cannot apply"
        )
    unknown = sorted(set().union(*(c.kwargs for c in calls)) - HANDLED_KWARGS)
    if unknown:
        named = {"s_aux": "attention sinks", "softcap": "attention logit soft-capping"}
        what = ", ".join(f"{k} ({named[k]})" if k in named else k for k in unknown)
        raise UnsupportedModel(
            f"its attention takes arguments the paged attention does not apply: {what}"
        )
    shapes = {(c.heads, c.kv_heads, c.key_dim, c.value_dim) for c in calls}
    if len(shapes) > 1:
        raise UnsupportedModel(
            f"its layers' attention shapes differ ({sorted(shapes)}): the paged KV cache "
            "has one shape for all layers"
        )
    ((heads, kv_heads, key_dim, value_dim),) = shapes
    if key_dim != value_dim:
        raise UnsupportedModel(
            f"its keys ({key_dim}) and values ({value_dim}) differ in size (multi-head "
            "latent attention or the like): the paged KV cache holds equal sizes"
        )
    if heads % kv_heads:
        raise UnsupportedModel(f"{heads} query heads do not share {kv_heads} KV heads evenly")
    return AttentionGeometry(heads, kv_heads, key_dim)


def _record(model: torch.nn.Module, causal_lm: bool, device: torch.device) -> list[_Call]:
    """The attention calls of one forward of ``PROBE_TOKENS`` tokens."""
    calls: list[_Call] = []
    marker = object()  # stands for the step's metadata: does it reach every call?

    def record(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: object,
    ) -> tuple[torch.Tensor, None]:
        calls.append(
            _Call(
                layer_idx=getattr(module, "layer_idx", None),
                module=id(module),
                heads=query.shape[1],
                kv_heads=key.shape[1],
                key_dim=key.shape[-1],
                value_dim=value.shape[-1],
                has_mask=attention_mask is not None,
                kwargs=frozenset(k for k, v in kwargs.items() if v is not None and v is not False),
                has_metadata=kwargs.get(METADATA_KWARG) is marker,
            )
        )
        batch, _, tokens, _ = query.shape
        return query.new_zeros(batch, tokens, query.shape[1], value.shape[-1]), None

    mapping = AttentionInterface._global_mapping
    paged = mapping[ATTENTION_NAME]
    mapping[ATTENTION_NAME] = record
    inputs = {
        "input_ids": torch.arange(PROBE_TOKENS, device=device)[None],
        "position_ids": torch.arange(PROBE_TOKENS, device=device)[None],
        "use_cache": False,
        METADATA_KWARG: marker,
    }
    if causal_lm:
        inputs["logits_to_keep"] = 1
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception as exc:  # the model's code cannot run this way at all
        raise UnsupportedModel(f"its test forward failed: {type(exc).__name__}: {exc}") from None
    finally:
        mapping[ATTENTION_NAME] = paged
    return calls
