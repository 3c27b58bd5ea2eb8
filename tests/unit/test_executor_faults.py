"""Fault injection is a subclass the stage picks at start, only when a switch is set: the
executor that serves has no fault branches."""

from __future__ import annotations

import inspect
import re

import pytest

import mpengine.executor.executor as executor_module
from mpengine.config import EngineConfig
from mpengine.executor import Executor, create_executor
from mpengine.executor.faults import FaultyExecutor


def test_the_stage_runs_a_faulty_executor_only_when_a_switch_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[EngineConfig] = []
    # No model: what is constructed is all that matters here.
    monkeypatch.setattr(
        Executor, "__init__", lambda self, config, backend=None, ranks=None: built.append(config)
    )
    monkeypatch.delenv("MPENGINE_FAULT_STEPS", raising=False)
    monkeypatch.delenv("MPENGINE_FAULT_SEQS", raising=False)
    config = EngineConfig.from_kwargs(model="tiny")
    assert type(create_executor(config)) is Executor
    monkeypatch.setenv("MPENGINE_FAULT_SEQS", "3, 7")
    faulty = create_executor(config)
    assert isinstance(faulty, FaultyExecutor)
    assert faulty.fault_seqs == {3, 7} and not faulty.fault_steps
    monkeypatch.setenv("MPENGINE_FAULT_STEPS", "6")
    assert create_executor(config).fault_steps == {6}  # type: ignore[attr-defined]
    assert built == [config] * 3
    source = inspect.getsource(executor_module)
    assert not re.search(r"fault_|InjectedFault|MPENGINE_FAULT", source)
