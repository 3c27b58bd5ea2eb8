"""The start-up audit of a decoder's attention (``executor/model_audit.py``).

Tiny random models of several architectures, built offline from transformers' configs. Each
refused one loaded before and then generated wrong tokens without an error (found by a
greedy-parity sweep over 73 architectures against transformers' own ``generate``); the
accepted ones match it token for token.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mpengine.config import EngineConfig
from mpengine.executor.attention import ATTENTION_NAME
from mpengine.executor.model_audit import UnsupportedModel, audit_attention
from mpengine.executor.model_loader import load_model
from mpengine.executor.paged_attention import register_attention
from tests.e2e.test_executor import build_model

BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def build(model_type: str, **overrides: object) -> torch.nn.Module:
    register_attention()
    config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME).eval()


def audit(model: torch.nn.Module):
    layers = model.config.get_text_config().num_hidden_layers
    return audit_attention(model, layers, causal_lm=True, device=torch.device("cpu"))


@pytest.mark.parametrize(
    ("model_type", "overrides", "geometry"),
    [
        ("llama", {}, (4, 2, 16)),
        ("qwen3", {"head_dim": 32}, (4, 2, 32)),
        # GPT-2's code has no KV-head groups: a stray num_key_value_heads in its config
        # shaped the cache (2 heads for its 4), and the native kernels read past the keys.
        ("gpt2", {}, (4, 4, 16)),
    ],
)
def test_served_models_show_their_geometry(model_type, overrides, geometry) -> None:
    found = audit(build(model_type, **overrides))
    assert (found.num_heads, found.num_kv_heads, found.head_dim) == geometry


@pytest.mark.parametrize(
    ("model_type", "overrides", "message"),
    [
        ("bloom", {"n_head": 4}, "compute attention themselves"),
        ("mamba", {"state_size": 8, "expand": 2}, "MambaMixer layers run a causal convolution"),
        (
            "jamba",
            {
                "num_experts": 1,
                "attn_layer_period": 2,
                "attn_layer_offset": 1,
                "mamba_d_state": 8,
                "use_mamba_kernels": False,
            },
            "causal convolution",
        ),
        ("diffllama", {}, "calls attention 2 times"),
        ("gemma2", {"head_dim": 16, "sliding_window": 4096}, "softcap"),
        (
            "gpt_oss",
            {
                "head_dim": 16,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "sliding_window": 4096,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            r"s_aux \(attention sinks\)",
        ),
        (
            "deepseek_v3",
            {
                "q_lora_rank": 32,
                "kv_lora_rank": 16,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "first_k_dense_replace": 1,
                "n_group": 1,
                "topk_group": 1,
                "num_key_value_heads": 4,
            },
            r"keys \(24\) and values \(16\) differ",
        ),
        ("stablelm", {}, "do not pass the forward's keyword arguments"),
        ("doge", {"keep_window_size": 32}, "attention mask of its own"),
    ],
)
def test_models_served_wrong_are_refused(model_type, overrides, message) -> None:
    with pytest.raises(UnsupportedModel, match=message):
        audit(build(model_type, **overrides))


def test_the_audit_leaves_the_paged_attention_in_place() -> None:
    from transformers import AttentionInterface

    from mpengine.executor.paged_attention import paged_attention_forward

    with pytest.raises(UnsupportedModel):
        audit(build("bloom", n_head=4))
    audit(build("llama"))
    assert AttentionInterface._global_mapping[ATTENTION_NAME] is paged_attention_forward


@pytest.mark.parametrize(
    ("model_type", "overrides", "message"),
    [
        ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}, "falcon models"),
        ("gpt_neo", {"num_layers": 2, "attention_types": [[["global"], 2]]}, "gpt_neo models"),
        ("llama4_text", {"attention_chunk_size": 32, "head_dim": 16}, "chunks of 32"),
        ("xglm", {"attention_heads": 4, "num_layers": 2, "d_model": 64}, "XGLMForCausalLM"),
    ],
)
def test_loading_refuses_with_the_reason(tmp_path, model_type, overrides, message) -> None:
    """Refused by load_model, in one line (a bare KeyError: 'mpengine_paged' before)."""
    path = build_model(tmp_path / model_type, model_type, **overrides)
    with pytest.raises(NotImplementedError, match=message):
        load_model(EngineConfig(model=path, max_model_len=128))
