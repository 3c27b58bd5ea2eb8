"""Pooling kernels and the sentence-transformers configuration, without an engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mpengine.executor.model_loader import sentence_transformers_pooling
from mpengine.executor.pooler import CLS, LAST, MEAN, Pooler, finalize, padded_groups, pool_padded


def test_chunked_pooling_equals_pooling_the_whole_prompt():
    """Three sequences (mean, CLS, last) computed in chunks across two steps give what
    pooling their whole hidden states gives."""
    torch.manual_seed(0)
    hidden_size, lengths = 8, [7, 5, 6]
    whole = [torch.randn(n, hidden_size) for n in lengths]
    kinds = np.array([MEAN, CLS, LAST])
    slots = np.array([3, 0, 5])
    pooler = Pooler(num_slots=8, hidden_size=hidden_size, device=torch.device("cpu"))
    pooler.acc.fill_(7.0)  # stale state from earlier sequences
    pooler.reset(slots)
    cut = [4, 2, 6]  # tokens computed in step 1; the rest in step 2 (the last one ends there)
    step1 = torch.cat([h[:c] for h, c in zip(whole, cut, strict=True)])
    num1 = np.array(cut)
    pooler.accumulate(step1, kinds, slots, np.zeros(3, int), num1, np.cumsum(num1) - num1)
    rest = [1, 0]  # sequences 0 and 1 finish in step 2
    step2 = torch.cat([whole[i][cut[i] :] for i in rest])
    num2 = np.array([lengths[i] - cut[i] for i in rest])
    first2 = np.cumsum(num2) - num2
    pooler.accumulate(step2, kinds[rest], slots[rest], np.array(cut)[rest], num2, first2)
    got = pooler.finish(step2, kinds[rest], slots[rest], first2 + num2 - 1, np.array(lengths)[rest])
    torch.testing.assert_close(got[0], whole[1][0])  # CLS
    torch.testing.assert_close(got[1], whole[0].mean(0))  # mean
    last = pooler.finish(step1, kinds[2:], slots[2:], np.array([len(step1) - 1]), np.array([6]))
    torch.testing.assert_close(last[0], whole[2][-1])


def test_padded_pooling_and_finalize():
    torch.manual_seed(1)
    hidden = torch.randn(3, 5, 4)
    lengths = torch.tensor([5, 2, 3])
    mask = torch.arange(5)[None, :] < lengths[:, None]
    got = pool_padded(hidden, mask, lengths, np.array([MEAN, LAST, CLS]))
    torch.testing.assert_close(got[0], hidden[0].mean(0))
    torch.testing.assert_close(got[1], hidden[1, 1])
    torch.testing.assert_close(got[2], hidden[2, 0])
    out = finalize(got, np.array([True, False, True]), np.array([4, 4, 2]))
    assert out.dtype == np.float32 and out.shape == (3, 4)
    np.testing.assert_allclose(out[0], torch.nn.functional.normalize(got[0], dim=0), atol=1e-6)
    np.testing.assert_allclose(out[1], got[1], atol=1e-6)
    expected = torch.nn.functional.normalize(got[2, :2], dim=0)
    np.testing.assert_allclose(out[2], [*expected.tolist(), 0, 0], atol=1e-6)


def write_modules(root: Path, modules: list[str], pooling: dict | None = None) -> Path:
    entries = [
        {
            "idx": i,
            "name": str(i),
            "path": "" if name == "Transformer" else f"{i}_{name}",
            "type": f"sentence_transformers.models.{name}",
        }
        for i, name in enumerate(modules)
    ]
    (root / "modules.json").write_text(json.dumps(entries))
    if pooling is not None:
        index = modules.index("Pooling")
        (root / f"{index}_Pooling").mkdir()
        (root / f"{index}_Pooling" / "config.json").write_text(json.dumps(pooling))
    return root


def test_sentence_transformers_configuration(tmp_path: Path):
    assert sentence_transformers_pooling(str(tmp_path)).pooling is None
    mean = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
    write_modules(tmp_path, ["Transformer", "Pooling", "Normalize"], mean)
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": 256}')
    declared = sentence_transformers_pooling(str(tmp_path))
    assert (declared.pooling, declared.normalize, declared.max_seq_length) == ("mean", True, 256)


@pytest.mark.parametrize(
    ("modules", "pooling", "match"),
    [
        (["Transformer", "Pooling", "Dense"], {"pooling_mode_cls_token": True}, "Dense"),
        (["Transformer", "Pooling"], {"pooling_mode_max_tokens": True}, "not supported"),
    ],
)
def test_unsupported_sentence_transformers_modules_are_refused(tmp_path, modules, pooling, match):
    write_modules(tmp_path, modules, pooling)
    with pytest.raises(NotImplementedError, match=match):
        sentence_transformers_pooling(str(tmp_path))


def test_last_token_and_no_normalize(tmp_path: Path):
    write_modules(tmp_path, ["Transformer", "Pooling"], {"pooling_mode_lasttoken": True})
    declared = sentence_transformers_pooling(str(tmp_path))
    assert (declared.pooling, declared.normalize) == ("last", False)


def test_padded_groups_trade_padding_for_calls():
    lengths = np.array([5, 200, 6, 7, 190, 8])
    groups = padded_groups(lengths, call_tokens=100.0)
    assert [sorted(g.tolist()) for g in groups] == [[0, 2, 3, 5], [1, 4]]
    # A call worth more than any padding: one batch; worth nothing: one per length.
    assert len(padded_groups(lengths, call_tokens=1e9)) == 1
    assert len(padded_groups(lengths, call_tokens=0.0)) == len(set(lengths.tolist()))
