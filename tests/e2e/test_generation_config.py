"""The model's default sampling parameters (its generation_config.json), as vLLM takes them:
for the fields a request leaves out, through the client library and the HTTP API."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from mpengine import SamplingParams
from mpengine.executor.model_loader import sampling_defaults
from mpengine.models.resolve import resolve_model
from mpengine.server.schemas import ChatCompletionRequest, CompletionRequest

QWEN3 = {  # what Qwen3's generation_config.json says, beside fields that are not sampling's
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def model_with(tmp_path: Path, generation_config: dict) -> Path:
    """A copy of the tiny model whose generation_config.json has these fields too."""
    path = tmp_path / "model"
    shutil.copytree(resolve_model("tiny"), path)
    file = path / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **generation_config}))
    return path


def test_the_sampling_fields_of_generation_config_are_read(tmp_path, caplog) -> None:
    path = model_with(tmp_path, {**QWEN3, "eos_token_id": 2, "max_new_tokens": 64})
    assert sampling_defaults(str(path), "auto") == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "max_tokens": 64,
    }
    assert sampling_defaults(str(path), "none") == sampling_defaults(str(path), "vllm") == {}
    assert sampling_defaults(str(path), str(path)) == sampling_defaults(str(path), "auto")
    with pytest.raises(FileNotFoundError, match=r"no generation_config\.json"):
        sampling_defaults(str(path), str(tmp_path))
    # As the parameters hold them: top_k -1 is "no top-k" (0); whole numbers written as
    # floats are integers; max_new_tokens past int32 is as many as fit.
    odd = model_with(tmp_path / "odd", {"top_k": -1, "max_new_tokens": 2.0**40})
    assert sampling_defaults(str(odd), "auto") == {"top_k": 0, "max_tokens": 2**31 - 1}
    whole = model_with(tmp_path / "whole", {"top_k": 20.0, "max_new_tokens": 64.0})
    defaults = sampling_defaults(str(whole), "auto")
    assert defaults == {"top_k": 20, "max_tokens": 64} and type(defaults["top_k"]) is int
    # A value out of range is left out, with the reason; the others stay.
    bad = model_with(tmp_path / "bad", {"top_p": 5.0, "repetition_penalty": 1.1})
    with caplog.at_level(logging.WARNING, "mpengine.executor.model_loader"):
        assert sampling_defaults(str(bad), "auto") == {"repetition_penalty": 1.1}
    assert "top_p=5.0 left out" in caplog.text


def test_requests_take_the_defaults_for_the_fields_they_leave_out() -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1}
    plain = CompletionRequest(prompt="x").sampling_params(16, None, defaults=defaults)
    assert (plain.temperature, plain.top_k, plain.top_p, plain.repetition_penalty) == (
        0.6,
        20,
        0.95,
        1.1,
    )
    chat = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], temperature=0.0, top_k=-1
    )
    given = chat.sampling_params(16, None, defaults=defaults)
    assert (given.temperature, given.top_k, given.top_p) == (0.0, 0, 0.95)
    # Beam search is deterministic: no sampling knob (and no penalty) applies to it.
    beams = CompletionRequest(prompt="x", use_beam_search=True, n=2)
    assert beams.sampling_params(16, None, defaults=defaults).repetition_penalty == 1.0


def test_the_engine_gives_its_clients_the_models_defaults(start_engine, tmp_path) -> None:
    path = model_with(tmp_path, {"temperature": 0.0, "max_new_tokens": 5})
    engine = start_engine(model=str(path), num_gpu_blocks_override=64)
    with engine.client(timeout=60) as client:
        assert client.info.sampling_defaults == {"temperature": 0.0, "max_tokens": 5}
        # No parameters: greedy, 5 tokens (the engine's own defaults: sampled, 16).
        out = client.generate([5, 6, 7], timeout=60)
        want = client.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=5))
        assert out.token_ids == want.token_ids and len(out.token_ids) == 5
    plain = start_engine(model=str(path), num_gpu_blocks_override=64, generation_config="none")
    with plain.client(timeout=60) as client:
        assert client.info.sampling_defaults == {}
        out = client.generate([5, 6, 7], SamplingParams(ignore_eos=True), timeout=60)
        assert len(out.token_ids) == SamplingParams().max_tokens
