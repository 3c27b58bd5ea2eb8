"""Prometheus metrics of the HTTP front end (``GET /metrics``).

Names are vLLM's where the two overlap, with ``mpengine:`` for ``vllm:``, and every series
carries a ``model_name`` label, so that dashboards built for vLLM work. Each count is produced
once, by one process:

- Request-level metrics are counted only by the HTTP process, from the outputs it receives
  (``RequestTracker``): tokens as they stream in, latencies when a request ends, from the
  engine's timestamps (``RequestOutput.metrics``: epoch seconds, all taken on this host).
  A request made with ``n > 1`` is one request for the histograms; each of its samples
  counts once in ``request_success_total`` (as vLLM counts its parallel samples).
- Engine-wide numbers are the engine's own totals and levels (``EngineStats`` from
  ``client.stats()``), exposed as they were at the latest poll (``EngineCollector``); they
  are never added up here, so no restart or second front end can double them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from mpengine.protocol import STEP_TOKEN_BUCKETS

if TYPE_CHECKING:
    from mpengine.client.outputs import RequestOutput
    from mpengine.protocol import EngineStats

PREFIX = "mpengine:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, with finer ones below 10 ms for small models.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4)
ITL_BUCKETS += (0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0)
REQUEST_BUCKETS += (30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50... up to ``max_model_len`` (vLLM's ``build_1_2_5_buckets``)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        scale *= 10


class ServerMetrics:
    """Every metric the front end exposes, in a registry of its own. Every ``mpengine:``
    series carries the ``engine`` label, the data-parallel replica it is about (``"0"``
    for an engine alone), as vLLM labels its engines; ``series(engine)`` is one
    replica's request-level metrics."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        cache_config: dict[str, object] | None = None,
        num_engines: int = 1,
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name", "engine"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        def seconds(name: str, doc: str) -> Histogram:
            return histogram(name, doc, REQUEST_BUCKETS)

        tokens = token_buckets(max_model_len)
        self._families: dict[str, Counter | Histogram] = {
            "prompt_tokens": counter("prompt_tokens", "Prompt tokens of answered requests."),
            "generation_tokens": counter("generation_tokens", "Generated tokens."),
            "ttft": histogram(
                "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
            ),
            "itl": histogram(
                "inter_token_latency_seconds", "Between a sample's successive outputs.", ITL_BUCKETS
            ),
            "e2e": seconds("e2e_request_latency_seconds", "Arrival to last token."),
            "queue": seconds("request_queue_time_seconds", "Arrival to first scheduled."),
            "prefill": seconds("request_prefill_time_seconds", "First scheduled to first token."),
            "decode": seconds("request_decode_time_seconds", "First token to last token."),
            "inference": seconds(
                "request_inference_time_seconds", "First scheduled to last token."
            ),
            "request_prompt_tokens": histogram(
                "request_prompt_tokens", "Prompt tokens per request.", tokens
            ),
            "request_generation_tokens": histogram(
                "request_generation_tokens", "Generated tokens per request (all samples).", tokens
            ),
        }
        self.request_success = counter(
            "request_success", "Finished samples, by finish reason.", ("finished_reason",)
        )
        self.http_requests = Counter(  # (vLLM's name, without its prefix)
            "http_requests_total",
            "HTTP answers, by handler, method and status class.",
            ["handler", "method", "status"],
            registry=self.registry,
        )
        self._series: dict[int, Series] = {}
        for engine in range(num_engines):  # (each replica's series exist from the start)
            self.series(engine)
        self.engine = EngineCollector(model_name, num_engines)
        self.registry.register(self.engine)
        if cache_config:  # vLLM's info gauge: the KV cache's configuration as labels, value 1
            names = sorted(cache_config)
            info = Gauge(
                PREFIX + "cache_config_info",
                "Information of the KV cache configuration.",
                [*labels, *names],
                registry=self.registry,
            )
            values = [_label(cache_config[name]) for name in names]
            for engine in range(num_engines):
                info.labels(model_name, str(engine), *values).set(1)

    def series(self, engine: int) -> Series:
        """Replica ``engine``'s request-level metrics."""
        if (series := self._series.get(engine)) is None:
            bound = {
                name: family.labels(self.model_name, str(engine))
                for name, family in self._families.items()
            }
            series = self._series[engine] = Series(self, str(engine), **bound)
        return series

    def tracker(self, num_prompt_tokens: int, n: int, ranked: bool = False) -> RequestTracker:
        return RequestTracker(self, num_prompt_tokens, n, ranked, time.monotonic())

    def success(self, reason: str, engine: int = 0) -> None:
        self.series(engine).success(reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(slots=True)
class Series:
    """One replica's request-level metrics, bound to its labels."""

    metrics: ServerMetrics
    engine: str
    prompt_tokens: Any
    generation_tokens: Any
    ttft: Any
    itl: Any
    e2e: Any
    queue: Any
    prefill: Any
    decode: Any
    inference: Any
    request_prompt_tokens: Any
    request_generation_tokens: Any

    def success(self, reason: str) -> None:
        m = self.metrics
        m.request_success.labels(m.model_name, self.engine, reason).inc()


def _label(value: object) -> str:
    """A configuration value as vLLM's info gauges write it (``True``, ``16``, ``None``)."""
    return str(value)


class RequestTracker:
    """One engine request as the HTTP process sees it; feeds the request-level metrics.

    ``on_output`` takes every delta the client library yields; ``on_abandoned`` is called
    when the HTTP client went away and the request was aborted: its open samples count as
    aborted then (their final outputs are no longer delivered). A request the engine
    refused (``on_refused``) counts in no finish reason.

    A ``ranked`` request (``best_of > n``, beam search) arrives whole at its end, one
    finished output per returned sample; its generated tokens are what the outputs' own
    ``num_generated_tokens`` say (every sample's, returned or not, as the usage counts).

    Times are the HTTP process's own, from ``started`` (its prompt tokenized), as vLLM's
    front end takes them: time to first token when the first token arrives (a stream the
    client dropped had none before), end-to-end latency and the request's token counts
    when it ends, aborted too. They count for the replica that ran the request (its
    outputs say which; replica 0 for one that never answered).
    """

    def __init__(
        self,
        metrics: ServerMetrics,
        num_prompt_tokens: int,
        n: int,
        ranked: bool = False,
        started: float = 0.0,
    ) -> None:
        self.metrics = metrics
        self.series: Series | None = None  # its replica's, once known
        self.num_prompt_tokens = num_prompt_tokens
        self.ranked = ranked
        self.started = started  # monotonic seconds
        self.num_generated = 0
        self.open_samples = set(range(n))
        self.last_output_at: dict[int, float] = {}  # sample index -> monotonic seconds
        self.answered = False
        self.first_token_seen = False
        self.ended = False

    def on_output(self, delta: RequestOutput, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.series is None:
            self.series = self.metrics.series(delta.metrics.data_parallel_rank)
        m = self.series
        if not self.answered:
            self.answered = True
            m.prompt_tokens.inc(self.num_prompt_tokens)
        if self.ranked and delta.num_generated_tokens:
            m.generation_tokens.inc(delta.num_generated_tokens)
            self.num_generated += delta.num_generated_tokens
        if not self.first_token_seen and any(s.token_ids for s in delta.outputs):
            self.first_token_seen = True
            m.ttft.observe(max(0.0, now - self.started))
        for sample in delta.outputs:
            if sample.token_ids:
                if not self.ranked:
                    m.generation_tokens.inc(len(sample.token_ids))
                    self.num_generated += len(sample.token_ids)
                last = self.last_output_at.get(sample.index)
                if last is not None:
                    m.itl.observe(now - last)
                self.last_output_at[sample.index] = now
            if sample.finish_reason is not None and sample.index in self.open_samples:
                self.open_samples.discard(sample.index)
                m.success(sample.finish_reason)
        if delta.finished:
            t = delta.metrics  # the engine's times, for what happens inside it
            if t.scheduled_time:
                m.queue.observe(max(0.0, t.scheduled_time - t.arrival_time))
                m.inference.observe(max(0.0, t.finished_time - t.scheduled_time))
                if t.first_token_time:
                    m.prefill.observe(max(0.0, t.first_token_time - t.scheduled_time))
                    m.decode.observe(max(0.0, t.finished_time - t.first_token_time))
            self._ended(now)

    def _ended(self, now: float) -> None:
        if self.ended:
            return
        self.ended = True
        m = self.series or self.metrics.series(0)
        m.e2e.observe(max(0.0, now - self.started))
        m.request_prompt_tokens.observe(self.num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_generated)

    def on_refused(self) -> None:
        """The engine refused the request (bad input, overloaded): it never ran, so it
        finished nothing, as vLLM counts."""
        self.open_samples.clear()

    def on_abandoned(self, now: float | None = None) -> None:
        series = self.series or self.metrics.series(0)
        for _ in self.open_samples:
            series.success("abort")
        self.open_samples.clear()
        if self.answered:  # (its prompt tokens were counted: its histograms count it too)
            self._ended(time.monotonic() if now is None else now)


class EngineCollector(Collector):
    """The engine's own totals and levels, as of the latest ``EngineStats`` of each replica
    (``update``), labelled by replica (``engine``)."""

    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        self.model_name = model_name
        self.num_engines = num_engines
        self.stats: dict[int, EngineStats] = {}
        # Stages restarted by each replica's launcher, and how often (the replica itself
        # started again counts as its stage "replica").
        self.restarts: dict[int, dict[str, int]] = {}
        self.up: dict[int, bool] = {}  # whether each replica takes requests now

    def update(self, stats: EngineStats, engine: int = 0) -> None:
        self.stats[engine] = stats

    def collect(self) -> Iterator[Metric]:
        yield from self._replica_metrics()
        polled = sorted(self.stats.items())
        if polled:
            yield from self._engine_metrics(polled)
            yield from self._stage_metrics(polled)

    def _replica_metrics(self) -> Iterator[Metric]:
        """Each replica's restarts (its stages', and its own as ``replica``) and whether
        it takes requests."""
        m = self.model_name
        restarts = CounterMetricFamily(
            PREFIX + "stage_restarts",
            "Stages restarted after they died, by stage.",
            labels=["model_name", "engine", "stage"],
        )
        up = GaugeMetricFamily(
            PREFIX + "engine_up",
            "Whether the replica takes requests (0: its stage died, or it is out of reach).",
            labels=["model_name", "engine"],
        )
        for engine in range(self.num_engines):
            counts = self.restarts.get(engine, {})
            stages = (
                "scheduler",
                "executor",
                "output",
                *(("replica",) if "replica" in counts else ()),
            )
            for stage in stages:
                restarts.add_metric([m, str(engine), stage], counts.get(stage, 0))
            up.add_metric([m, str(engine)], float(self.up.get(engine, engine in self.stats)))
        yield restarts
        yield up

    def _engine_metrics(self, polled: list[tuple[int, EngineStats]]) -> Iterator[Metric]:
        """Each replica's levels and totals from its stats."""
        m = self.model_name

        def family(
            kind: type, name: str, doc: str, value: Callable[[EngineStats], float]
        ) -> Metric:
            metric = kind(PREFIX + name, doc, labels=["model_name", "engine"])
            for engine, stats in polled:
                metric.add_metric([m, str(engine)], value(stats))
            return metric

        def used(stats: EngineStats) -> float:
            return 1.0 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield family(
            gauge,
            "num_requests_running",
            "Sequences in the running batch.",
            lambda s: s.num_running,
        )
        yield family(
            gauge,
            "num_requests_waiting",
            "Sequences waiting for admission or preempted.",
            lambda s: s.num_waiting + s.num_preempted,
        )
        yield family(gauge, "kv_cache_usage_perc", "KV cache usage (1 = full).", used)
        yield family(
            counter,
            "num_preemptions",
            "Preemptions since the engine started.",
            lambda s: s.preemptions,
        )
        yield family(
            counter,
            "num_fair_preemptions",
            "Preemptions of a tenant over its share for one waiting under it.",
            lambda s: s.fair_preemptions,
        )
        yield family(
            gauge, "num_tenants_running", "Tenants with sequences running.", lambda s: s.num_tenants
        )
        yield family(
            counter,
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            lambda s: s.prefix_cache_queries,
        )
        yield family(
            counter,
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            lambda s: s.prefix_cache_hits,
        )
        tokens = HistogramMetricFamily(
            PREFIX + "iteration_tokens_total",
            "Tokens computed per engine step.",
            labels=["model_name", "engine"],
        )
        for engine, stats in polled:
            if stats.step_tokens:
                bounds = [*(str(float(b)) for b in STEP_TOKEN_BUCKETS), "+Inf"]
                cumulative = list(itertools.accumulate(stats.step_tokens))
                buckets = list(zip(bounds, cumulative, strict=True))
                tokens.add_metric([m, str(engine)], buckets, float(stats.computed_tokens))
        if tokens.samples:
            yield tokens
        yield family(counter, "steps", "Steps output-processed.", lambda s: s.done)
        yield family(
            gauge,
            "lockstep_lag_steps",
            "Steps planned but not yet output-processed.",
            lambda s: s.step - s.done,
        )

    def _stage_metrics(self, polled: list[tuple[int, EngineStats]]) -> Iterator[Metric]:
        # From the step breakdown (EngineStats.stages): each stage's running totals as of
        # the latest step that reached the scheduler (``StageTimes``: ``busy`` seconds of
        # work, ``wall`` busy + waiting on a peer). Adjust here if that breakdown changes.
        labels = ["model_name", "engine", "stage"]
        busy = CounterMetricFamily(
            PREFIX + "stage_busy_seconds", "Seconds each stage spent working.", labels=labels
        )
        wait = CounterMetricFamily(
            PREFIX + "stage_wait_seconds",
            "Seconds each stage spent waiting on a peer (ring, lockstep counter).",
            labels=labels,
        )
        for engine, stats in polled:
            for stage, times in sorted(stats.stages.items()):
                busy.add_metric([self.model_name, str(engine), stage], times.busy)
                wait.add_metric(
                    [self.model_name, str(engine), stage], max(0.0, times.wall - times.busy)
                )
        yield busy
        yield wait
