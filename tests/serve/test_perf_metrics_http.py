"""GET /perf_metrics (`serve --perf-metrics-max-requests N`, trtllm-serve's per-request metrics) over real HTTP: each
finished sequence's record holds its own draft counts and times (those its choice's `metrics` report), the latest N
are kept, each is returned once."""

from __future__ import annotations

import time

import httpx
import pytest

from dflash_trt.runtime.stats import RequestMetrics
from dflash_trt.serve.metrics import ServerMetrics
from tests.conftest import run_main
from tests.serve.test_openai_server import MODEL, live_server

QUESTION = [{"role": "user", "content": "Name three rivers of Europe."}]


@pytest.fixture(scope="module")
def perf_server(smollm2_pipeline):
    with live_server(smollm2_pipeline, max_batch_size=4, perf_metrics_max_requests=2) as (base, _):
        yield base


def test_a_record_holds_the_requests_own_counts_and_times(perf_server):
    assert httpx.get(perf_server + "/perf_metrics").json() == []
    httpx.get(perf_server + "/metrics")  # the iterations so far
    before = time.perf_counter()  # the server runs in this process: the same clock
    body = httpx.post(perf_server + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": QUESTION, "max_tokens": 24, "temperature": 0}).json()
    after = time.perf_counter()
    m = body["choices"][0]["metrics"]
    [record] = httpx.get(perf_server + "/perf_metrics").json()
    assert httpx.get(perf_server + "/perf_metrics").json() == []  # returned once
    assert record["request_id"] == 1 and set(record["perf_metrics"]) == {"first_iter", "last_iter", "timing_metrics",
                                                                          "speculative_decoding"}
    # the iterations that decoded it, alone: the first reports its prefill and its first verify step
    iters = httpx.get(perf_server + "/metrics").json()
    p = record["perf_metrics"]
    assert [i["iter"] for i in iters] == list(range(p["first_iter"], p["last_iter"] + 1))
    assert p["last_iter"] - p["first_iter"] + 1 == m["verify_steps"]
    assert iters[0]["inflightBatchingStats"]["numContextRequests"] == 1
    spec = record["perf_metrics"]["speculative_decoding"]
    assert spec == {"acceptance_rate": pytest.approx(m["accepted_tokens"] / m["drafted_tokens"]),
                    "total_accepted_draft_tokens": m["accepted_tokens"], "total_draft_tokens": m["drafted_tokens"]}
    t = record["perf_metrics"]["timing_metrics"]
    assert before <= t["arrival_time"] <= t["first_scheduled_time"] <= t["first_token_time"] <= t["last_token_time"]
    assert t["last_token_time"] <= after
    assert t["first_scheduled_time"] - t["arrival_time"] == pytest.approx(m["queue_time_s"], abs=1e-6)
    assert t["first_token_time"] - t["first_scheduled_time"] == pytest.approx(m["time_to_first_token_s"], abs=1e-6)
    assert t["last_token_time"] - t["first_scheduled_time"] == pytest.approx(m["total_time_s"], abs=1e-6)


def test_the_latest_records_are_kept_and_a_sequence_that_drafted_nothing_has_no_speculative_part(perf_server):
    httpx.get(perf_server + "/perf_metrics")  # what earlier tests left
    out = httpx.post(perf_server + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "The rivers of Europe", "max_tokens": 8, "n": 3, "temperature": 0})
    assert out.status_code == 200
    records = httpx.get(perf_server + "/perf_metrics").json()
    assert len(records) == 2 and records[1]["request_id"] == records[0]["request_id"] + 1  # 3 finished, 2 kept
    httpx.get(perf_server + "/metrics")
    httpx.post(perf_server + "/v1/completions", timeout=120, json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    [one] = httpx.get(perf_server + "/perf_metrics").json()  # its only token came from the prefill: nothing drafted
    assert one["request_id"] == records[1]["request_id"] + 1
    assert set(one["perf_metrics"]) == {"first_iter", "last_iter", "timing_metrics"}
    [it] = httpx.get(perf_server + "/metrics").json()  # one iteration: the one reporting its prefill
    assert one["perf_metrics"]["first_iter"] == one["perf_metrics"]["last_iter"] == it["iter"]


def test_records_need_the_flag_and_count_cached_tokens_with_a_prefix_cache():
    metrics = ServerMetrics("m", lambda: 0, lambda: 0)
    m = RequestMetrics(prompt_tokens=10, completion_tokens=3, drafted_tokens=8, accepted_tokens=1, cached_tokens=6,
                       time_to_first_token_s=0.5, total_time_s=2.0)
    from dflash_trt.runtime.stats import GenerationResult

    metrics.finished(GenerationResult([1, 2, 3], "stop", m), 0.25, arrival=100.0)
    assert metrics.perf_metrics() == []  # not kept without perf_metrics_max_requests
    cached = ServerMetrics("m2", lambda: 0, lambda: 0, prefix_cache=lambda: None, perf_metrics_max_requests=5)
    cached.finished(GenerationResult([1, 2, 3], "stop", m), 0.25, arrival=100.0)
    assert cached.perf_metrics() == [{"request_id": 1, "perf_metrics": {
        "timing_metrics": {"arrival_time": 100.0, "first_scheduled_time": 100.25, "first_token_time": 100.75,
                           "last_token_time": 102.25},
        "kv_cache_metrics": {"num_reused_tokens": 6, "num_missed_tokens": 4},
        "speculative_decoding": {"acceptance_rate": 0.125, "total_accepted_draft_tokens": 1, "total_draft_tokens": 8}}}]


def test_the_serve_flag(monkeypatch, capsys):
    import dflash_trt.serve.app as app_module

    made = {}

    def capture(pipe, *args, **kwargs):  # the options serve passes: stop before serving
        made.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(app_module, "create_app", capture)
    code, _, _ = run_main(monkeypatch, capsys, "serve", "--port", "0", "--perf-metrics-max-requests", "50")
    assert code == 0 and made["perf_metrics_max_requests"] == 50
    code, _, _ = run_main(monkeypatch, capsys, "serve", "--port", "0")
    assert code == 0 and made["perf_metrics_max_requests"] == 0
    code, _, err = run_main(monkeypatch, capsys, "serve", "--port", "0", "--perf-metrics-max-requests", "-1")
    assert code == 2 and "--perf-metrics-max-requests" in err
