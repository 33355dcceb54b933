"""The server's metrics, under trtllm-serve's names.

- `GET /prometheus/metrics`: Prometheus text exposition (prometheus-client) of the `trtllm_` metrics of
  TensorRT-LLM's MetricsCollector, with its types and default buckets, every one labelled `model_name` (the served
  model name) and `engine_type` ("dflash-trt"; trtllm-serve writes "undefined" in both):
  - per finished sequence: `trtllm_request_success_total{finished_reason}` (a counter; TensorRT-LLM's values:
    "stop", "length", "cancelled" for a sequence aborted (its client left, or the server shut down), the
    runtime's "abort"), the histograms
    `trtllm_e2e_request_latency_seconds` (arrival to last token), `trtllm_time_to_first_token_seconds` (arrival to
    first token), `trtllm_time_per_output_token_seconds` ((last - first token) / (tokens - 1), with 2 tokens or
    more), `trtllm_request_queue_time_seconds` (arrival to first scheduled), `trtllm_request_prefill_time_seconds`
    (first scheduled to first token), `trtllm_request_decode_time_seconds` (first to last token, with 2 tokens or
    more) and `trtllm_request_inference_time_seconds` (first scheduled to last token); as TensorRT-LLM, a time
    whose end the sequence never reached (the first token of one aborted before it) is not observed, nor a span of
    0 s; the counters `trtllm_prompt_tokens_total` / `trtllm_generation_tokens_total`; with
    `--enable-prefix-caching`, `trtllm_prompt_cached_tokens_total` and the histogram
    `trtllm_prompt_cached_tokens_per_request` (prompt tokens whose K/V came from the prefix cache);
  - per iteration (the entries of GET /metrics, each as it is recorded): the gauges `trtllm_iteration_latency_seconds`,
    `trtllm_max_num_active_requests`, `trtllm_cpu_memory_usage_bytes` (this process's resident memory),
    `trtllm_gpu_memory_usage_bytes` (on a GPU only), `trtllm_num_context_requests`, `trtllm_num_generation_requests`,
    `trtllm_num_scheduled_requests`, `trtllm_total_context_tokens`, `trtllm_avg_decoded_tokens_per_iter`,
    `trtllm_prefill_batch_occupancy` (context requests / max batch size), `trtllm_spec_decode_acceptance_length`
    (speculative mode only), the histogram `trtllm_prefill_batch_tokens` (the prompt tokens read in an iteration that
    read some) and the counter `trtllm_num_requests_completed_total` (the sum of `numCompletedRequests`).
    trtllm-serve feeds these from the latest iteration a background task finds each time a request ends, so its
    counters skip the iterations in between; here every iteration counts;
  - `trtllm_num_requests_running` / `trtllm_num_requests_waiting` (gauges, sequences): read live at each scrape
    (trtllm-serve's are the latest iteration's numActiveRequests / numQueuedRequests);
  - speculative-decoding counters: `trtllm_spec_decode_num_draft_tokens_total` /
    `trtllm_spec_decode_num_accepted_tokens_total` (TensorRT-LLM's names; counted per finished sequence, where it
    sums its iterations), per draft position `trtllm_spec_decode_drafted_tokens_total{token_position}` /
    `trtllm_spec_decode_accepted_tokens_total{token_position}` (TensorRT-LLM's names and label, per finished
    sequence, from its `RequestMetrics.drafted_per_position` / `accepted_per_position`: position 0 is the first
    drafted token of a block; in a draft tree a position is a node's depth less one, all the nodes at that depth
    counted as drafted and the accepted path's one as accepted, so a tree's position 0 may draft several tokens per
    step; a series appears with its first count, and the positions stop at the last one drafted), and
    `trtllm_spec_decode_num_verify_steps_total` (this server's own), and with
    `--enable-prefix-caching` vLLM's `trtllm_prefix_cache_queries_total` / `trtllm_prefix_cache_hits_total`, in prompt
    tokens. Acceptance length = (generation tokens - the requests that generated a token, the count of
    `trtllm_time_to_first_token_seconds`) / verify steps; acceptance rate = accepted / draft tokens.

  Left out, as nothing here measures them (no made-up values): TensorRT-LLM's KV cache block metrics
  (`trtllm_kv_cache_*`: this KV cache is one tensor per batch, with no blocks, pools or host offload),
  `trtllm_num_paused_requests` and `trtllm_pinned_memory_usage_bytes` (nothing pauses, nothing pinned is counted),
  `trtllm_max_batch_size_static/runtime`, `trtllm_max_num_tokens_runtime` (no runtime tuner),
  `trtllm_spec_decode_draft_overhead`, the perplexity histograms (no logprobs
  are computed unless a request asks), `trtllm_scheduled_batch_size` and the `trtllm_*_config_info` gauges.
- `trtllm_request_error_total{http_code}`: every request answered with an HTTP error status (a 4xx or 5xx: bad
  requests, a missing API key, a body too large, a failed generation, an unknown path), counted by the
  `CountErrors` middleware of `dflash_trt.serve.app`; an error inside a stream that already answered 200 is not
  counted (its status was sent).
- `GET /metrics`: trtllm-serve's JSON list of iteration stats, one entry per decode step of the
  in-flight batch (`timestamp` (local time, `TIMESTAMP_FORMAT`, as TensorRT-LLM's PyTorch backend writes it), `iter`,
  `iterLatencyMS` (the step and the prefill it reports in `numCtxTokens`), `numActiveRequests` (decoding, and being
  prefilled in chunks), `numQueuedRequests`, `numCompletedRequests` (sequences that left the batch since the previous
  entry: finished in its step, at their first token, or aborted), `maxNumActiveRequests` (`--max-batch-size`), `gpuMemUsage`
  (bytes in use on the GPU; 0 on the CPU), `cpuMemUsage` (this process's resident memory in bytes, where
  TensorRT-LLM's PyTorch backend writes 0), `pinnedMemUsage` (0), `inflightBatchingStats` (with
  `avgNumDecodedTokensPerIter`: tokens per decoded sequence in the step, and `microBatchId` 0),
  `specDecodingStats` with `numDraftTokens`, `numAcceptedTokens`, `numRequestsWithDraftTokens`,
  `acceptanceLength`: tokens emitted per request in that step), the last MAX_ITER_STATS steps, each
  returned once (trtllm-serve drains its queue the same way).
- `GET /perf_metrics` (with `serve --perf-metrics-max-requests N`, TensorRT-LLM's `perf_metrics_max_requests`):
  trtllm-serve's per-request records of the last N finished sequences, each returned once: `request_id` (an
  integer, in order of finishing) and `perf_metrics` with `timing_metrics` (`arrival_time`, `first_scheduled_time`,
  `first_token_time`, `last_token_time`: seconds on the steady clock, Python's `time.perf_counter`, CLOCK_MONOTONIC
  on Linux), `first_iter` / `last_iter` (the decode steps, numbered as GET /metrics' `iter`, that reported its
  prefill and its last token), `speculative_decoding` (`acceptance_rate`, `total_accepted_draft_tokens`, `total_draft_tokens`; only
  when the sequence drafted, as trtllm-serve) and, with prefix caching, `kv_cache_metrics` in tokens
  (`num_reused_tokens`, `num_missed_tokens`: this cache keeps tokens, not TensorRT-LLM's blocks). trtllm-serve's
  `server_*` times (its disaggregated serving's) are not given.

Every metric counts sequences (choices): a request with n = 2 counts twice.

The request counters and the iterations' counts differ in two ways. A sequence cancelled while still queued (its
client left) counts in `trtllm_request_success_total{finished_reason="cancelled"}` (with its queue time), but in no
iteration's `numCompletedRequests` (nor `trtllm_num_requests_completed_total`): it never joined a batch. TensorRT-LLM's
PyExecutor does the same with a request cancelled in its waiting queue: it is removed from the queue, and only
requests in the active batch are finished (FinishReason CANCELLED) and counted as completed in an iteration. And a
`/health_generate` probe is a request like any other (counted in the iterations and the request metrics), as
trtllm-serve's probe is a chat request through its chat endpoint.
"""

from __future__ import annotations

import collections
import datetime
import os
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily

from dflash_trt.runtime.decode_batch import StepStats
from dflash_trt.runtime.stats import GenerationResult

#: GET /metrics' `timestamp` (TensorRT-LLM's PyExecutor writes its IterationStats.timestamp so: local time)
TIMESTAMP_FORMAT = "%m-%d-%Y %H:%M:%S.%f"


def _rss_bytes() -> int:
    """This process's resident memory in bytes (Linux /proc/self/statm; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def finished_reason(finish_reason: str) -> str:
    """The `finished_reason` label of a sequence that ended for the runtime's `finish_reason`: TensorRT-LLM's
    CompletionOutput.finish_reason ("stop", "length", and "cancelled" where the runtime says "abort": a client that
    left, the server's shutdown; tensorrt_llm/executor/result.py)."""
    return "cancelled" if finish_reason == "abort" else finish_reason


#: Iterations (decode steps) kept for GET /metrics between two reads.
MAX_ITER_STATS = 1000
ENGINE_TYPE = "dflash-trt"
# TensorRT-LLM's MetricsCollector's default buckets (seconds; tokens for the last two), so that dashboards and
# alerts written against trtllm-serve find the same `le` series
#: e2e latency, queue time, decode time and inference time
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
PREFILL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                   640.0, 2560.0)
#: prompt tokens served from the prefix cache, per sequence
CACHED_TOKENS_BUCKETS = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: prompt tokens read in one iteration
PREFILL_BATCH_TOKENS_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class ServerMetrics:
    """Prometheus metrics in their own registry (several servers in one process do not clash) and the
    iteration stats of GET /metrics.

    Args:
        model_name: the `model_name` label (the served model name).
        running / waiting: callables giving the sequences in the current batch / in the queue.
        prefix_cache: a callable giving the engine's `PrefixCache` (or None): its lookups are exported as
            counters (those of the cache itself: requests that look it up, per sequence), and each finished
            sequence's cached prompt tokens; None: neither is exported.
        perf_metrics_max_requests: finished sequences whose records GET /perf_metrics keeps (the latest);
            0: none (the endpoint answers []).
        max_batch_size: the sequences the in-flight batch holds at most (GET /metrics' `maxNumActiveRequests`).
        device: where the model runs ("cpu", "cuda", "cuda:N"): on a GPU, GET /metrics' `gpuMemUsage` is its
            memory in use (bytes, all processes, as `cudaMemGetInfo` gives it: TensorRT-LLM's); 0 on the CPU.
        speculative: the server decodes speculatively (mode "dflash"): the iterations' acceptance length is
            exported as `trtllm_spec_decode_acceptance_length` (TensorRT-LLM's, which has it with a drafter only).
    """

    def __init__(self, model_name: str, running, waiting, prefix_cache=None, perf_metrics_max_requests: int = 0,
                 max_batch_size: int = 0, device: str = "cpu", speculative: bool = True):
        disable_created_metrics()  # no *_created series (as vLLM and TensorRT-LLM expose them)
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine_type": ENGINE_TYPE}
        names = list(labels)
        r = self.registry
        self._success = Counter("trtllm_request_success", "Count of successfully processed requests.",
                                names + ["finished_reason"], registry=r)
        self._labels = labels

        def hist(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**labels)

        def count(name, doc):
            return Counter(name, doc, names, registry=r).labels(**labels)

        def gauge(name, doc):  # its series appears once it is set (no value before one is measured)
            return Gauge(name, doc, names, registry=r)

        self.e2e = hist("trtllm_e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                        LATENCY_BUCKETS)
        self.ttft = hist("trtllm_time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.tpot = hist("trtllm_time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                         TPOT_BUCKETS)
        self.queue = hist("trtllm_request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)
        self.prefill = hist("trtllm_request_prefill_time_seconds", "Histogram of prefill (context) phase duration in "
                            "seconds (first_token_time - first_scheduled_time).", PREFILL_BUCKETS)
        self.decode = hist("trtllm_request_decode_time_seconds", "Histogram of decode (generation) phase duration in "
                           "seconds (last_token_time - first_token_time).", LATENCY_BUCKETS)
        self.inference = hist("trtllm_request_inference_time_seconds", "Histogram of total inference duration in "
                              "seconds (last_token_time - first_scheduled_time).", LATENCY_BUCKETS)
        self.prompt_tokens = count("trtllm_prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = count("trtllm_generation_tokens", "Number of generation tokens processed.")
        self.draft_tokens = count("trtllm_spec_decode_num_draft_tokens",
                                  "Draft tokens handed to the target for verification.")
        self.accepted_tokens = count("trtllm_spec_decode_num_accepted_tokens",
                                     "Draft tokens the target accepted (and that were emitted).")
        self.verify_steps = count("trtllm_spec_decode_num_verify_steps",
                                  "Target forward passes after prefill, summed over requests.")
        # per draft position (`token_position`: 0 for the first drafted token of a block), TensorRT-LLM's; a series
        # appears with its first count, as there
        self._drafted_at = Counter("trtllm_spec_decode_drafted_tokens", "Total drafted tokens per speculative "
                                   "decoding position.", names + ["token_position"], registry=r)
        self._accepted_at = Counter("trtllm_spec_decode_accepted_tokens", "Total accepted tokens per speculative "
                                    "decoding position.", names + ["token_position"], registry=r)
        self.cached_tokens = self.cached_per_request = None
        if prefix_cache is not None:
            r.register(_PrefixCacheCounters(prefix_cache, labels))
            self.cached_tokens = count("trtllm_prompt_cached_tokens",
                                       "Prompt tokens served from the prefix cache, summed over finished sequences.")
            self.cached_per_request = hist("trtllm_prompt_cached_tokens_per_request",
                                           "Histogram of cached prompt tokens per request.", CACHED_TOKENS_BUCKETS)
        gauge("trtllm_num_requests_running", "Sequences in the batch being decoded.").labels(**labels).set_function(
            running)
        gauge("trtllm_num_requests_waiting", "Sequences queued, not yet in the batch.").labels(**labels).set_function(
            waiting)
        # the iterations' (GET /metrics' entries), each set as an iteration is recorded (`_export_iteration`)
        self.completed = count("trtllm_num_requests_completed", "Total number of completed requests across iterations")
        if max_batch_size > 0:
            gauge("trtllm_max_num_active_requests", "Maximum number of active requests").labels(**labels).set(
                max_batch_size)
        self._iter_gauges = {key: gauge(name, doc) for key, name, doc in (
            ("iterLatencyMS", "trtllm_iteration_latency_seconds", "Iteration latency in seconds"),
            ("cpuMemUsage", "trtllm_cpu_memory_usage_bytes", "CPU memory usage in bytes (this process's resident)"),
            ("numContextRequests", "trtllm_num_context_requests", "Number of context (prefill) requests"),
            ("numGenRequests", "trtllm_num_generation_requests", "Number of generation (decode) requests"),
            ("numScheduledRequests", "trtllm_num_scheduled_requests", "Number of scheduled requests"),
            ("numCtxTokens", "trtllm_total_context_tokens", "Total number of context tokens"),
            ("avgNumDecodedTokensPerIter", "trtllm_avg_decoded_tokens_per_iter",
             "Average number of decoded tokens per iteration"),
            ("prefillBatchOccupancy", "trtllm_prefill_batch_occupancy",
             "Fraction of max active slots occupied by context requests."),
        ) + ((("gpuMemUsage", "trtllm_gpu_memory_usage_bytes", "GPU memory usage in bytes"),)
             if device.startswith("cuda") else ()) + (
            (("acceptanceLength", "trtllm_spec_decode_acceptance_length", "Acceptance length in speculative decoding"),)
            if speculative else ())}
        self._errors = Counter("trtllm_request_error", "Total request errors, labeled by HTTP status code.",
                               names + ["http_code"], registry=r)
        self.prefill_batch_tokens = hist("trtllm_prefill_batch_tokens", "Histogram of total context tokens per "
                                         "iteration.", PREFILL_BATCH_TOKENS_BUCKETS)
        self._waiting = waiting
        self._iters: collections.deque[dict] = collections.deque(maxlen=MAX_ITER_STATS)
        self._iter = 0
        self._lock = threading.Lock()
        self._perf: collections.deque[dict] | None = (collections.deque(maxlen=perf_metrics_max_requests)
                                                      if perf_metrics_max_requests > 0 else None)
        self._perf_id = 0
        self._prefix_cache = prefix_cache
        self._max_batch_size, self._device = max_batch_size, device

    def request_error(self, http_code: int) -> None:
        """Count one request answered with an HTTP error status (`http_code` >= 400):
        `trtllm_request_error_total{http_code}`, TensorRT-LLM's MetricsCollector.log_request_error."""
        self._errors.labels(**self._labels, http_code=str(http_code)).inc()

    def finished(self, result: GenerationResult, queue_time_s: float, arrival: float | None = None,
                 iterations: tuple[int, int] | None = None) -> None:
        """Record one finished sequence (queue time: seconds from its arrival to its prefill; prompt tokens:
        those read, fewer for one aborted while its prompt was read in chunks; arrival: its `time.perf_counter()`
        when queued, and `iterations`: (first, last), the decode steps in which it was first scheduled and got
        its last token (`Sequence.first_iter` / `last_iter`), for GET /perf_metrics)."""
        m = result.metrics
        if self._perf is not None and arrival is not None:
            self._record_perf(m, queue_time_s, arrival, iterations)
        self._success.labels(**self._labels, finished_reason=finished_reason(result.finish_reason)).inc()
        # TensorRT-LLM's spans (`timing_metrics`' times): arrival -> first scheduled (queue) -> first token ->
        # last token; a span with no end or of 0 s is not observed, as there. One aborted before its first token
        # has no latency (as one cancelled in the queue); a scoring request (max_tokens 0 with echo) has one, and
        # no first token.
        last_token = m.completion_tokens or result.finish_reason != "abort"
        decode_s = m.total_time_s - m.time_to_first_token_s
        for histogram, seconds, reached in (
                (self.e2e, queue_time_s + m.total_time_s, last_token),
                (self.inference, m.total_time_s, last_token),
                (self.ttft, queue_time_s + m.time_to_first_token_s, m.completion_tokens),
                (self.prefill, m.time_to_first_token_s, m.completion_tokens),
                (self.decode, decode_s, m.completion_tokens > 1),
                (self.tpot, decode_s / max(m.completion_tokens - 1, 1), m.completion_tokens > 1)):
            if reached and seconds > 0:
                histogram.observe(seconds)
        self.queue.observe(queue_time_s)  # 0 s too (scheduled at once), as TensorRT-LLM's
        if self.cached_tokens is not None:
            self.cached_tokens.inc(m.cached_tokens)
            self.cached_per_request.observe(m.cached_tokens)
        self.prompt_tokens.inc(m.prompt_tokens)
        self.generation_tokens.inc(m.completion_tokens)
        self.draft_tokens.inc(m.drafted_tokens)
        self.accepted_tokens.inc(m.accepted_tokens)
        self.verify_steps.inc(m.verify_steps)
        # the positions up to the last one drafted, each count above 0 (TensorRT-LLM's)
        drafted, accepted = m.drafted_per_position, m.accepted_per_position
        for pos in range(max((i + 1 for i, c in enumerate(drafted) if c), default=0)):
            if drafted[pos]:
                self._drafted_at.labels(**self._labels, token_position=str(pos)).inc(drafted[pos])
            if accepted[pos]:
                self._accepted_at.labels(**self._labels, token_position=str(pos)).inc(accepted[pos])

    def cancelled_in_queue(self, queue_time_s: float) -> None:
        """Record a sequence whose client left while it was queued: finished_reason "cancelled" (as an abort
        during decoding is counted), and its queue time; no tokens, no latency."""
        self._success.labels(**self._labels, finished_reason=finished_reason("abort")).inc()
        self.queue.observe(queue_time_s)

    def iteration(self, step: StepStats) -> None:
        """Record one decode step of the engine's batch (`DecodeBatch.step`) for GET /metrics."""
        gpu = 0
        if self._device.startswith("cuda"):
            import torch

            free, total = torch.cuda.mem_get_info(torch.device(self._device))
            gpu = total - free
        with self._lock:
            self._iter += 1
            entry = {
                "timestamp": datetime.datetime.now().strftime(TIMESTAMP_FORMAT),
                "iter": self._iter, "iterLatencyMS": step.seconds * 1000.0, "numActiveRequests": step.active_requests,
                "numQueuedRequests": self._waiting(), "numCompletedRequests": step.completed_requests,
                "maxNumActiveRequests": self._max_batch_size,
                "gpuMemUsage": gpu, "cpuMemUsage": _rss_bytes(), "pinnedMemUsage": 0,
                "inflightBatchingStats": {
                    "numScheduledRequests": step.scheduled_requests,
                    "numContextRequests": step.context_requests, "numCtxTokens": step.context_tokens,
                    "numGenRequests": step.requests, "numPausedRequests": 0, "microBatchId": 0,
                    "avgNumDecodedTokensPerIter": step.emitted_tokens / step.requests if step.requests else 0.0,
                },
                "specDecodingStats": {
                    "numDraftTokens": step.drafted_tokens, "numAcceptedTokens": step.accepted_tokens,
                    "numRequestsWithDraftTokens": step.requests_with_drafts,
                    "acceptanceLength": step.emitted_tokens / step.requests if step.requests else 1.0,
                },
            }
            self._iters.append(entry)
            self._export_iteration(entry)

    def _export_iteration(self, entry: dict) -> None:
        """Set the Prometheus metrics of one GET /metrics entry (module docstring): its gauges (the latest
        iteration's values), `trtllm_num_requests_completed_total` and `trtllm_prefill_batch_tokens`."""
        ifb, spec = entry["inflightBatchingStats"], entry["specDecodingStats"]
        values = {**entry, **ifb, **spec, "iterLatencyMS": entry["iterLatencyMS"] / 1000.0}  # the gauge's seconds
        if self._max_batch_size > 0:
            values["prefillBatchOccupancy"] = ifb["numContextRequests"] / self._max_batch_size
        for key, g in self._iter_gauges.items():
            if key in values and (key != "cpuMemUsage" or values[key] > 0):  # 0: /proc could not be read
                g.labels(**self._labels).set(values[key])
        self.completed.inc(entry["numCompletedRequests"])
        if ifb["numCtxTokens"] > 0:
            self.prefill_batch_tokens.observe(ifb["numCtxTokens"])

    def _record_perf(self, m, queue_time_s: float, arrival: float, iterations: tuple[int, int] | None) -> None:
        """Keep one finished sequence's GET /perf_metrics record (trtllm-serve's layout, module docstring)."""
        scheduled = arrival + queue_time_s
        perf = {} if iterations is None else {"first_iter": iterations[0], "last_iter": iterations[1]}
        perf["timing_metrics"] = {"arrival_time": arrival, "first_scheduled_time": scheduled,
                                  "first_token_time": scheduled + m.time_to_first_token_s,
                                  "last_token_time": scheduled + m.total_time_s}
        if self._prefix_cache is not None:
            perf["kv_cache_metrics"] = {"num_reused_tokens": m.cached_tokens,
                                        "num_missed_tokens": m.prompt_tokens - m.cached_tokens}
        if m.drafted_tokens:
            perf["speculative_decoding"] = {"acceptance_rate": m.acceptance_rate,
                                            "total_accepted_draft_tokens": m.accepted_tokens,
                                            "total_draft_tokens": m.drafted_tokens}
        with self._lock:
            self._perf_id += 1
            self._perf.append({"request_id": self._perf_id, "perf_metrics": perf})

    def perf_metrics(self) -> list[dict]:
        """The GET /perf_metrics records kept since the last call (and forgets them); [] when not kept."""
        if self._perf is None:
            return []
        with self._lock:
            out = list(self._perf)
            self._perf.clear()
        return out

    def iteration_stats(self) -> list[dict]:
        """The iterations recorded since the last call (and forgets them)."""
        with self._lock:
            out = list(self._iters)
            self._iters.clear()
        return out

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)


class _PrefixCacheCounters:
    """A Prometheus collector of the prefix cache's own counts (vLLM's prefix cache queries and hits, in prompt
    tokens): `PrefixCache.queried_tokens` / `hit_tokens`, counted when a prompt looks the cache up (as it is
    prefilled; a request asking for prompt_logprobs does not), read at each scrape."""

    def __init__(self, prefix_cache, labels: dict[str, str]):
        self._cache, self._labels = prefix_cache, labels

    def collect(self):
        cache = self._cache()
        for name, doc, value in (
                ("trtllm_prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.",
                 cache.queried_tokens if cache is not None else 0),
                ("trtllm_prefix_cache_hits", "Prefix cache hits, in prompt tokens whose K/V were reused, not prefilled.",
                 cache.hit_tokens if cache is not None else 0)):
            family = CounterMetricFamily(name, doc, labels=list(self._labels))
            family.add_metric(list(self._labels.values()), value)
            yield family
