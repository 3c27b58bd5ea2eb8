"""The front end's Prometheus metrics: a known sequence of outputs counts exactly, and the
engine's own numbers are exposed as they are."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mpengine.client.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mpengine.metrics import RequestTracker, ServerMetrics, token_buckets
from mpengine.protocol import STEP_TOKEN_BUCKETS, EngineStats, StageTimes


def values(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    """Every sample of the exposition, parsed back as Prometheus would."""
    parsed = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            assert sample.labels.pop("model_name") == "m"
            if sample.name.startswith("mpengine:"):  # every series names its replica
                assert sample.labels.pop("engine") == "0", sample.name
            parsed[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return parsed


def delta(
    index: int,
    token_ids: list[int],
    finish: str | None = None,
    finished: bool = False,
    timing: RequestMetrics | None = None,
) -> RequestOutput:
    """What ``AsyncClient.stream`` yields: one sample's new tokens."""
    sample = CompletionOutput(index, "x" * len(token_ids), token_ids, finish)
    return RequestOutput("r", [1, 2, 3], [sample], finished, metrics=timing or RequestMetrics())


def observed_once(v: dict[tuple[str, tuple], float], *expected: tuple[str, float]) -> None:
    """Each histogram ``name`` holds one observation, of ``value``."""
    for name, value in expected:
        assert v[f"mpengine:{name}_count", ()] == 1, name
        assert v[f"mpengine:{name}_sum", ()] == pytest.approx(value), name


def test_one_request_counts_exactly() -> None:
    metrics = ServerMetrics("m", 4096)
    tracker = RequestTracker(metrics, num_prompt_tokens=5, n=2, started=0.0)
    timing = RequestMetrics(
        arrival_time=100.0, scheduled_time=100.5, first_token_time=101.0, finished_time=103.0
    )
    tracker.on_output(delta(0, [7]), now=1.0)
    tracker.on_output(delta(1, [8]), now=1.1)
    tracker.on_output(delta(0, [9]), now=1.5)
    tracker.on_output(delta(1, [10], "stop"), now=1.75)
    tracker.on_output(delta(0, [11, 12], "length", finished=True, timing=timing), now=2.0)
    v = values(metrics)
    assert v["mpengine:prompt_tokens_total", ()] == 5
    assert v["mpengine:generation_tokens_total", ()] == 6
    assert v["mpengine:request_success_total", (("finished_reason", "stop"),)] == 1
    assert v["mpengine:request_success_total", (("finished_reason", "length"),)] == 1
    # Gaps per sample: 0.5 and 0.5 for sample 0, 0.65 for sample 1.
    assert v["mpengine:inter_token_latency_seconds_count", ()] == 3
    assert v["mpengine:inter_token_latency_seconds_sum", ()] == pytest.approx(1.65)
    observed_once(
        v,
        ("time_to_first_token_seconds", 1.0),  # the HTTP process's times, from started
        ("request_queue_time_seconds", 0.5),  # the engine's
        ("request_prefill_time_seconds", 0.5),
        ("request_decode_time_seconds", 2.0),
        ("request_inference_time_seconds", 2.5),
        ("e2e_request_latency_seconds", 2.0),
        ("request_prompt_tokens", 5),
        ("request_generation_tokens", 6),
    )
    assert v["mpengine:time_to_first_token_seconds_bucket", (("le", "1.0"),)] == 1
    assert v["mpengine:time_to_first_token_seconds_bucket", (("le", "0.75"),)] == 0


def test_an_abandoned_request_counts_its_open_samples_as_aborted() -> None:
    """... and is a request of the histograms too, as vLLM counts aborted ones: a dropped
    stream counted its prompt tokens in prompt_tokens_total but had no TTFT, and was in no
    histogram."""
    metrics = ServerMetrics("m", 4096)
    tracker = RequestTracker(metrics, num_prompt_tokens=3, n=3, started=0.0)
    tracker.on_output(delta(0, [1], "length"), now=0.25)
    tracker.on_output(delta(1, [2]), now=0.5)
    tracker.on_abandoned(now=1.0)
    tracker.on_abandoned(now=2.0)  # once only
    v = values(metrics)
    assert v["mpengine:request_success_total", (("finished_reason", "length"),)] == 1
    assert v["mpengine:request_success_total", (("finished_reason", "abort"),)] == 2
    assert v["mpengine:prompt_tokens_total", ()] == 3
    observed_once(
        v,
        ("time_to_first_token_seconds", 0.25),
        ("e2e_request_latency_seconds", 1.0),
        ("request_prompt_tokens", 3),
        ("request_generation_tokens", 2),
    )
    assert v["mpengine:request_prompt_tokens_sum", ()] == v["mpengine:prompt_tokens_total", ()]
    unanswered = RequestTracker(metrics, num_prompt_tokens=7, n=1, started=0.0)
    unanswered.on_abandoned(now=1.0)  # no output: no prompt tokens counted, no histogram
    assert values(metrics)["mpengine:request_prompt_tokens_count", ()] == 1


def test_engine_numbers_are_the_engines_own() -> None:
    metrics = ServerMetrics("m", 4096)
    assert ("mpengine:num_preemptions_total", ()) not in values(metrics)  # no stats yet
    fields = dict.fromkeys(EngineStats.__struct_fields__, 0)
    fields.update(
        query_id=1,
        step=50,
        done=48,
        num_running=3,
        num_waiting=2,
        num_preempted=1,
        num_blocks=200,
        num_free_blocks=150,
        preemptions=7,
        stages={
            "executor": StageTimes(steps=48, wall=4.0, busy=3.0, phases={}, waits={}),
            "output": StageTimes(steps=48, wall=2.0, busy=0.5, phases={}, waits={}),
        },
    )
    metrics.engine.update(EngineStats(**fields))
    v = values(metrics)
    assert v["mpengine:num_requests_running", ()] == 3
    assert v["mpengine:num_requests_waiting", ()] == 3  # waiting and preempted
    assert v["mpengine:kv_cache_usage_perc", ()] == 0.25
    assert v["mpengine:num_preemptions_total", ()] == 7
    assert v["mpengine:steps_total", ()] == 48
    assert v["mpengine:lockstep_lag_steps", ()] == 2
    assert v["mpengine:stage_busy_seconds_total", (("stage", "executor"),)] == 3.0
    assert v["mpengine:stage_wait_seconds_total", (("stage", "executor"),)] == 1.0
    assert v["mpengine:stage_wait_seconds_total", (("stage", "output"),)] == 1.5
    fields.update(preemptions=9)
    metrics.engine.update(EngineStats(**fields))
    assert values(metrics)["mpengine:num_preemptions_total", ()] == 9  # set, never summed


def test_iteration_tokens_and_cache_config() -> None:
    """vLLM's ``iteration_tokens_total`` (steps by tokens computed, from the engine's
    per-bucket counts) and ``cache_config_info`` (the configuration as labels, value 1)."""
    metrics = ServerMetrics("m", 4096, {"block_size": 16, "enable_prefix_caching": True})
    fields = dict.fromkeys(EngineStats.__struct_fields__, 0)
    counts = [0] * (len(STEP_TOKEN_BUCKETS) + 1)
    counts[0], counts[3], counts[-1] = 5, 2, 1  # 5 steps of 1 token, 2 of 17-32, 1 of 20,000
    fields.update(stages={}, step_tokens=counts, computed_tokens=5 + 2 * 30 + 20_000)
    metrics.engine.update(EngineStats(**fields))
    v = values(metrics)
    bucket = "mpengine:iteration_tokens_total_bucket"
    assert v[bucket, (("le", "1.0"),)] == 5 and v[bucket, (("le", "16.0"),)] == 5
    assert v[bucket, (("le", "32.0"),)] == 7 and v[bucket, (("le", "16384.0"),)] == 7
    assert v[bucket, (("le", "+Inf"),)] == 8
    assert v["mpengine:iteration_tokens_total_count", ()] == 8
    assert v["mpengine:iteration_tokens_total_sum", ()] == 20_065
    info = (("block_size", "16"), ("enable_prefix_caching", "True"))
    assert v["mpengine:cache_config_info", info] == 1


def test_token_buckets_follow_1_2_5() -> None:
    assert token_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert token_buckets(1) == [1]


def test_a_ranked_request_is_one_request_of_every_sample_s_tokens() -> None:
    """best_of > n (or beam search): the result arrives whole, one finished output per
    returned sample, the first carrying every sample's tokens (returned or not)."""
    metrics = ServerMetrics("m", 4096)
    tracker = RequestTracker(metrics, num_prompt_tokens=4, n=2, ranked=True, started=0.0)
    timing = RequestMetrics(
        arrival_time=10.0, scheduled_time=10.25, first_token_time=11.0, finished_time=12.0
    )
    first = delta(0, [5, 6, 7], "length", timing=timing)
    first.num_generated_tokens = 9  # three samples of three tokens; two returned
    tracker.on_output(first, now=1.0)
    tracker.on_output(delta(1, [8, 9, 10], "length", finished=True, timing=timing), now=1.0)
    v = values(metrics)
    assert v["mpengine:generation_tokens_total", ()] == 9
    assert v["mpengine:request_success_total", (("finished_reason", "length"),)] == 2
    assert v["mpengine:inter_token_latency_seconds_count", ()] == 0
    observed_once(
        v,
        ("time_to_first_token_seconds", 1.0),
        ("e2e_request_latency_seconds", 1.0),
        ("request_generation_tokens", 9),
    )
