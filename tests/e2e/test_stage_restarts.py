"""A stage that dies is restarted and loses no request (the output processor, the
executor): every stream carries on with exactly the tokens and text of an undisturbed run,
seeded samples included; a crash loop gives up with ``EngineDeadError``; nothing leaks
(the ``start_engine`` fixture checks /dev/shm)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

import mpengine
from mpengine import SamplingParams
from mpengine.testing.engine import wait_idle
from tests.e2e.test_server_cli import serving

TIMEOUT_S = 60.0
PROMPTS = [[5 + i, 6, 7, 8 + i] for i in range(8)]


def workload() -> list[SamplingParams]:
    """Greedy and seeded samples, n up to 3, stop strings that may match: what a restarted
    output processor has to rebuild."""
    params = []
    for i in range(len(PROMPTS)):
        sampling = dict(temperature=0.0) if i % 2 else dict(temperature=0.8, seed=i)
        stop = ["ab", "q"] if i % 3 == 0 else []
        params.append(
            SamplingParams(max_tokens=160, ignore_eos=True, n=1 + i % 3, stop=stop, **sampling)
        )
    return params


class Streams:
    """One thread per prompt reading its stream (``params``: by prompt index); ``tokens``
    so far, per prompt and sample."""

    def __init__(self, client: mpengine.Client, params: dict[int, SamplingParams]) -> None:
        self.tokens: dict[int, dict[int, list[int]]] = {i: {} for i in params}
        self.texts: dict[int, dict[int, list[str]]] = {i: {} for i in params}
        self.errors: dict[int, BaseException] = {}
        self.threads = [
            threading.Thread(target=self._read, args=(client, i, p), daemon=True)
            for i, p in params.items()
        ]
        for thread in self.threads:
            thread.start()

    def _read(self, client: mpengine.Client, i: int, params: SamplingParams) -> None:
        try:
            for delta in client.stream(PROMPTS[i], params, timeout=TIMEOUT_S):
                for sample in delta.outputs:
                    self.tokens[i].setdefault(sample.index, []).extend(sample.token_ids)
                    self.texts[i].setdefault(sample.index, []).append(sample.text)
        except BaseException as exc:
            self.errors[i] = exc

    def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready():
            assert time.monotonic() < deadline, f"never: {what}"
            time.sleep(0.005)

    def least(self) -> int:
        """The fewest tokens any stream has so far."""
        return min(len(t) for outs in self.tokens.values() for t in outs.values() or [[]])

    def join(self) -> None:
        for thread in self.threads:
            thread.join(TIMEOUT_S)
            assert not thread.is_alive(), "a stream hung"

    def results(self) -> dict[int, tuple[dict, dict]]:
        return {
            i: (self.tokens[i], {k: "".join(v) for k, v in self.texts[i].items()})
            for i in self.tokens
        }


def undisturbed(client: mpengine.Client, params: list[SamplingParams]) -> dict[int, tuple]:
    outs = client.generate_many(PROMPTS, params, timeout=TIMEOUT_S)
    return {
        i: ({s.index: s.token_ids for s in out.outputs}, {s.index: s.text for s in out.outputs})
        for i, out in enumerate(outs)
    }


def kill_output(engine: mpengine.Engine, stage: str = "output") -> int:
    """SIGKILL the output processor (or ``stage``); its pid."""
    pid = engine.pids[stage]
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_restarted(engine: mpengine.Engine, old_pid: int, stage: str = "output") -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while engine.pids[stage] == old_pid or engine.recovering:
        assert engine.dead is None, engine.dead
        assert time.monotonic() < deadline, "the output processor was not restarted"
        time.sleep(0.005)


@pytest.mark.parametrize("stage", ["output", "executor"])
def test_a_killed_stage_loses_no_stream(start_engine, stage) -> None:
    engine = start_engine(model="tiny", log_level="WARNING")
    params = workload()
    with engine.client() as client, mpengine.Client(engine.address) as remote:
        want = undisturbed(client, params)
        # Half the streams from a client the launcher supervises, half from one it does not.
        streams = Streams(client, dict(enumerate(params[:4])))
        other = Streams(remote, {i: params[i] for i in range(4, len(PROMPTS))})
        for s in (streams, other):
            s.wait_for(lambda s=s: sum(map(len, s.tokens.values())) >= 4, "streams started")
        streams.wait_for(lambda: streams.least() >= 10 and other.least() >= 10, "10 tokens each")
        pid = kill_output(engine, stage)
        streams.join()
        other.join()
        got = streams.results() | other.results()
        assert not streams.errors and not other.errors, (streams.errors, other.errors)
        assert got == want
        assert engine.pids[stage] != pid and engine.restarts.total == {stage: 1}
        stats = client.stats()
        assert (stats.resyncs, stats.executor_restarts) == ((1, 0) if stage == "output" else (0, 1))
        # It serves new requests as before.
        again = client.generate(PROMPTS[1], params[1], timeout=TIMEOUT_S)
        assert {s.index: s.token_ids for s in again.outputs} == want[1][0]
        stats = wait_idle(client, timeout=TIMEOUT_S)  # (it frees blocks once fed back)
        assert stats.num_free_blocks == stats.num_blocks


def test_restarts_beyond_the_limit_give_up(start_engine) -> None:
    """Two restarts allowed: the third death ends the engine, its streams fail with
    ``EngineDeadError`` at once, and it leaves nothing behind."""
    engine = start_engine(model="tiny", log_level="WARNING", max_stage_restarts=2)
    params = SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0.0)
    with engine.client() as client:
        streams = Streams(client, dict.fromkeys(range(len(PROMPTS)), params))
        for _ in range(2):
            before = streams.least()
            streams.wait_for(lambda b=before: streams.least() > b + 2, "tokens flowing")
            wait_restarted(engine, kill_output(engine))
        kill_output(engine)
        streams.join()
        assert len(streams.errors) == len(PROMPTS)
        assert all(isinstance(e, mpengine.EngineDeadError) for e in streams.errors.values())
        assert engine.stopped.wait(10) and "output stage died" in (engine.dead or "")
        assert engine.restarts.total == {"output": 2}


@pytest.mark.parametrize("stage", ["output", "executor"])
def test_a_crash_during_a_restart_is_restarted_too(start_engine, stage) -> None:
    """The restarted stage killed as soon as it exists (while it starts, or just after):
    one more restart, and the streams still carry on unharmed."""
    engine = start_engine(model="tiny", log_level="WARNING")
    params = workload()
    with engine.client() as client:
        want = undisturbed(client, params)
        streams = Streams(client, dict(enumerate(params)))
        streams.wait_for(lambda: streams.least() >= 10, "10 tokens each")
        first = kill_output(engine, stage)
        deadline = time.monotonic() + TIMEOUT_S
        while engine.pids[stage] == first:
            assert time.monotonic() < deadline, f"no second {stage}"
        os.kill(engine.pids[stage], signal.SIGKILL)
        streams.join()
        assert not streams.errors, streams.errors
        assert streams.results() == want
        assert engine.restarts.total == {stage: 2}


# What each kind of request becomes when a stage restarts under it: carried on (with the
# undisturbed result), or failed with an error saying to retry it.
REBUILT = {
    "output": {
        "plain": True,
        "best_of": True,  # replayed, held back again, with the scores fed back
        "best_of_logprobs": False,  # the logprobs it held back: never fed back
        "beams": True,  # a beam search starts over
    },
    "executor": {"best_of": True, "beams": True},  # (starts over too: a lost step's beams)
}
KINDS = {
    "best_of": SamplingParams(max_tokens=200, ignore_eos=True, n=1, best_of=2, seed=1),
    "best_of_logprobs": SamplingParams(max_tokens=200, ignore_eos=True, n=1, best_of=2,
                                       seed=1, logprobs=2),
    "beams": SamplingParams(max_tokens=200, ignore_eos=True, n=1, beam_width=2,
                            use_beam_search=True),
    "plain": SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0),
}  # fmt: skip


@pytest.mark.parametrize("stage", sorted(REBUILT))
def test_what_cannot_be_rebuilt_fails_to_be_retried(start_engine, stage) -> None:
    """A request whose state a restarted stage cannot rebuild ends with an error saying to
    retry it; the others carry on, with their undisturbed results."""
    engine = start_engine(model="tiny", log_level="WARNING")
    kinds = REBUILT[stage]
    with engine.client() as client:
        want = {
            kind: client.generate([9, 9, 9], KINDS[kind], timeout=TIMEOUT_S)
            for kind, rebuilt in kinds.items()
            if rebuilt
        }
        long = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)
        streams = Streams(client, dict.fromkeys(range(len(PROMPTS)), long))
        streams.wait_for(lambda: streams.least() >= 5, "5 tokens each")
        results: dict[str, dict[str, object]] = {kind: {} for kind in kinds}

        def run(kind: str) -> None:
            try:
                results[kind]["out"] = client.generate([9, 9, 9], KINDS[kind], timeout=TIMEOUT_S)
            except BaseException as exc:
                results[kind]["error"] = exc

        threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in kinds]
        for thread in threads:
            thread.start()

        def admitted() -> bool:
            stats = client.stats()
            return stats.num_waiting == 0 and stats.num_running >= len(PROMPTS) + len(kinds)

        streams.wait_for(admitted, "admitted")
        wait_restarted(engine, kill_output(engine, stage), stage)
        for thread in threads:
            thread.join(TIMEOUT_S)
        streams.join()
        assert not streams.errors
    for kind, rebuilt in kinds.items():
        out, error = results[kind].get("out"), results[kind].get("error")
        if not rebuilt:
            message = str(error) if error is not None else out.outputs[0].error  # type: ignore[union-attr]
            assert "retry it" in (message or ""), (kind, results[kind])
            continue
        assert error is None and len(out.token_ids) == 200, (kind, results[kind])  # type: ignore[union-attr]
        assert out.token_ids == want[kind].token_ids and out.text == want[kind].text, kind  # type: ignore[union-attr]
        score, wanted = out.outputs[0].cumulative_logprob, want[kind].outputs[0].cumulative_logprob  # type: ignore[union-attr]
        assert (score is None) == (wanted is None), kind
        assert wanted is None or score == pytest.approx(wanted, rel=1e-4, abs=1e-3), kind


def test_http_streams_go_on_across_a_restart(tmp_path: Path) -> None:
    """``mpengine serve``: its streams carry on across the output processor's restart with
    the text of an undisturbed run; the restart is counted in ``/metrics``."""
    with serving(tmp_path / "serve") as served:
        api = openai.OpenAI(base_url=served.base_url, api_key="none", timeout=TIMEOUT_S)
        body = dict(model="tiny", max_tokens=120, temperature=0.0, extra_body={"ignore_eos": True})
        prompts = [[5 + i, 6, 7] for i in range(4)]
        want = [api.completions.create(prompt=[p], **body).choices[0].text for p in prompts]
        texts: dict[int, list[str]] = {i: [] for i in range(len(prompts))}
        errors: list[BaseException] = []

        def read(i: int) -> None:
            try:
                for chunk in api.completions.create(prompt=[prompts[i]], stream=True, **body):
                    texts[i].append(chunk.choices[0].text)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in texts]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + TIMEOUT_S
        while min(map(len, texts.values())) < 10:
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.005)
        engine_dir = Path(served.address.removeprefix("ipc://")).parent
        record = json.loads((engine_dir / "engine.json").read_text())
        os.kill(record["stages"]["output"], signal.SIGKILL)
        for thread in threads:
            thread.join(TIMEOUT_S)
        assert not errors, errors
        assert ["".join(texts[i]) for i in texts] == want
        with urllib.request.urlopen(served.url + "/metrics", timeout=TIMEOUT_S) as reply:
            metrics = reply.read().decode()
        assert (
            'mpengine:stage_restarts_total{engine="0",model_name="tiny",stage="output"} 1.0'
            in metrics
        )
        with urllib.request.urlopen(served.url + "/health", timeout=TIMEOUT_S) as reply:
            assert reply.status == 200


def test_a_killed_scheduler_ends_streams_to_be_retried_and_the_engine_serves_again(
    start_engine,
) -> None:
    """The scheduler held every request: its death ends every stream at once with an
    error saying to retry; the engine starts again but for the launcher, and both clients
    (one the launcher supervises, one it does not) serve new requests on their old
    connections."""
    engine = start_engine(model="tiny", log_level="WARNING")
    params = SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0.0)
    with engine.client() as client, mpengine.Client(engine.address) as remote:
        ours = Streams(client, dict.fromkeys(range(4), params))
        theirs = Streams(remote, dict.fromkeys(range(4, 8), params))
        for streams in (ours, theirs):
            streams.wait_for(lambda s=streams: s.least() >= 2, "streams under way")
        pid = kill_output(engine, "scheduler")
        killed_at = time.monotonic()
        ours.join()
        theirs.join()
        assert time.monotonic() - killed_at < 2.0
        errors = list(ours.errors.values()) + list(theirs.errors.values())
        assert len(errors) == 8 and all(isinstance(e, mpengine.EngineDeadError) for e in errors)
        assert all("retry" in str(e) for e in errors), errors
        short = SamplingParams(max_tokens=8, temperature=0.0)
        for c in (client, remote):
            assert len(c.generate(PROMPTS[0], short, timeout=TIMEOUT_S).token_ids) == 8
        assert engine.pids["scheduler"] != pid and engine.restarts.total == {"scheduler": 1}
        assert engine.dead is None
