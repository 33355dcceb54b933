"""The server's generation thread and streaming text, without HTTP: stop strings across tokens, held-back
half characters, and a failing request that must not fail the others of its batch."""

from __future__ import annotations

import threading

import pytest

from dflash_trt.errors import InvalidRequestError
from dflash_trt.runtime.decode_batch import PrefillFailed
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.stats import GenerationResult, RequestMetrics
from dflash_trt.runtime.stop_text import StopText
from dflash_trt.serve.scheduler import Scheduler, Sequence


def wait_for(cond, timeout=10.0):
    """Poll `cond` until it is true (close() aborts what is still queued, so tests wait for their results)."""
    import time

    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)

# a toy "tokenizer": token i is PIECES[i]; 7 and 8 are the two halves of one UTF-8 character
PIECES = ["Hello", ",", " wor", "ld", ".", " The", " end", b"\xc3", b"\xa9"]


def decode(ids):
    raw = b"".join(p if isinstance(p, bytes) else p.encode() for p in (PIECES[i] for i in ids))
    return raw.decode("utf-8", errors="replace")


def stream(ids, stops=(), chunks=1, min_tokens=0):
    """Feed ids `chunks` at a time: (deltas sent, reason, final rest)."""
    st = StopText(decode, tuple(stops), min_tokens=min_tokens)
    deltas, reason = [], None
    for k in range(0, len(ids), chunks):
        reason = st.add(ids[k : k + chunks])
        deltas.append(st.delta())
        if reason:
            break
    return deltas, reason, st.rest(reason or "length"), st


def test_stop_string_across_tokens_is_held_back_then_cut():
    deltas, reason, rest, st = stream([0, 1, 2, 3, 4, 5], stops=[", world"])
    assert reason == "stop" and st.text == "Hello"
    assert "".join(deltas) + rest == "Hello"
    assert deltas[:3] == ["Hello", "", ""]  # ", wor" could still become the stop string: nothing of it is sent


def test_a_near_miss_is_sent_once_it_cannot_match():
    deltas, reason, rest, _ = stream([0, 1, 2, 3, 4], stops=[", word"])
    assert reason is None and "".join(deltas) + rest == "Hello, world."
    assert deltas[:4] == ["Hello", "", "", ", world"]


def test_half_a_character_waits_for_its_other_half():
    deltas, _, rest, _ = stream([0, 7, 8, 4])
    assert deltas == ["Hello", "", "\u00e9", "."] and rest == ""
    # a completion cut by length inside the character drops the half (final_text)
    deltas, _, rest, st = stream([0, 7])
    assert "".join(deltas) + rest == "Hello" and st.text == "Hello\ufffd"


def test_a_stop_string_is_not_matched_against_half_a_character():
    """The half of "\u00e9" decodes as U+FFFD until its other half comes: a stop string "\ufffd" must not match it."""
    deltas, reason, rest, st = stream([0, 7, 8, 4], stops=["\ufffd"])
    assert reason is None and st.text == "Hello\u00e9." and "".join(deltas) + rest == "Hello\u00e9."
    deltas, reason, rest, st = stream([0, 7, 8, 4], stops=["\ufffd"], chunks=4)  # all at once: the same
    assert reason is None and "".join(deltas) + rest == "Hello\u00e9."


@pytest.mark.parametrize("chunks", [1, 2, 6])
def test_min_tokens_holds_back_stop_strings_that_end_within_its_tokens(chunks):
    """vLLM's rule: no stop check before min_tokens tokens are out. "." ends token 5; with min_tokens 5 it is
    text, with 4 the stop (its token the 5th); a stop string that ends after the first min_tokens tokens' text
    still stops, also when it began within them, and one token at a time or several at once alike."""
    ids = [0, 1, 2, 3, 4, 5, 6, 4]  # "Hello, world. The end."
    for min_tokens, text in ((0, "Hello, world"), (4, "Hello, world"), (5, "Hello, world. The end"),
                             (7, "Hello, world. The end")):
        deltas, reason, rest, st = stream(ids, stops=["."], chunks=chunks, min_tokens=min_tokens)
        assert (reason, st.text, "".join(deltas) + rest) == ("stop", text, text), min_tokens
        assert st.generated == (5 if text == "Hello, world" else 8)
    _, reason, rest, st = stream(ids, stops=["."], chunks=chunks, min_tokens=8)
    assert reason is None and st.text == "Hello, world. The end."
    _, reason, _, st = stream(ids, stops=["world."], chunks=chunks, min_tokens=4)  # begins in token 3, ends in 5
    assert reason == "stop" and st.text == "Hello, " and st.generated == 5


class ScriptedBatch:
    """A stand-in for `DecodeBatch` whose prompts say what happens (the scheduler's failure paths, which a
    real model cannot be made to take on cue): [-1] is refused at add (as the engine refuses a bad token
    id), [-2] raises at its first decode step (as non-finite logits do), [99] blocks its first step until
    `gate` is set, [55] blocks its add (after its first token) until `gate` is set, [77] never ends by
    itself, [-3] makes its add call's requests wait for the next step, which fails their prefill (as a
    chunk of chunked prefill does: `PrefillFailed`); any other prompt emits token 0 at its prefill and
    token 4 at its step ("Hello" + "."). Every add and step is logged in `log`."""

    def __init__(self, log, gate=None, started=None):
        self.log, self.gate, self.started = log, gate, started
        self.reqs = {}  # id -> [prompt, on_tokens, k, out, finish_reason]
        self.next_id = 0
        self.failing_prefill = []  # ids whose prefill fails at the next step

    @property
    def active(self):
        return sum(1 for r in self.reqs.values() if r[4] is None)

    def add(self, prompts, params, on_tokens):
        self.log.append(("add", len(prompts)))
        if any(p == [-1] for p in prompts):
            raise InvalidRequestError("token id -1")
        ids = []
        for k, p in enumerate(prompts):
            self.reqs[self.next_id] = [p, on_tokens, k, [], None]
            ids.append(self.next_id)
            self.next_id += 1
            if [-3] in prompts:
                self.failing_prefill.append(ids[-1])
                if self.started is not None:  # queued for its prefill: hold the thread until `gate` is set
                    self.started.set()
                    self.gate.wait(10)
                continue
            self._emit(self.reqs[ids[-1]], 0)
            if p == [55]:  # a long prefill: its first token is out, the add has not returned yet
                self.started.set()
                self.gate.wait(10)
        return ids

    def abort_prefill(self, request_ids):
        ended = [i for i in self.failing_prefill if i in request_ids]
        if len(ended) < len(self.failing_prefill):
            return 0  # as DecodeBatch: only a whole add call's requests leave the prefill queue
        for i in ended:
            self.reqs[i][4] = "abort"
        self.failing_prefill = []
        self.log.append(("abort_prefill", len(ended)))
        return len(ended)

    def _emit(self, r, token):
        r[3].append(token)
        reason = r[1](r[2], [token])
        if reason or (r[0] != [77] and len(r[3]) == 2):
            r[4] = reason or "length"

    def step(self):
        self.log.append(("step", self.active))
        if self.failing_prefill:
            failed, self.failing_prefill = self.failing_prefill, []
            for i in failed:
                del self.reqs[i]
            raise PrefillFailed(failed, RuntimeError("NaN in a prefill chunk"))
        for r in self.reqs.values():
            if r[4] is None and r[0] == [99]:
                self.started.set()
                self.gate.wait(10)  # hold the thread so that the next sequences queue up together
        for r in self.reqs.values():
            if r[4] is None and r[0] == [-2]:
                raise RuntimeError("NaN in the bad row's probabilities")
        for r in self.reqs.values():
            if r[4] is None:
                self._emit(r, 4 if r[0] != [77] else 0)

    def take_finished(self):
        done = [(i, r) for i, r in self.reqs.items() if r[4] is not None]
        for i, _ in done:
            del self.reqs[i]
        return [(i, GenerationResult(list(r[3]), r[4], RequestMetrics(completion_tokens=len(r[3])))) for i, r in done]


def scheduler(log, gate=None, started=None, max_batch_size=8):
    return Scheduler(lambda: ScriptedBatch(log, gate, started), max_batch_size)


@pytest.mark.parametrize("bad, log", [
    ([-1], [("add", 1), ("step", 1), ("add", 3), ("add", 1), ("add", 1), ("add", 1), ("step", 2)]),
    # chunked prefill: the chunk fails in a step (PrefillFailed), the three leave, then are added one at a
    # time; bad's chunk fails alone while the batch runs on
    ([-3], [("add", 1), ("step", 1), ("add", 3), ("step", 3), ("add", 1), ("add", 1), ("add", 1), ("step", 3),
            ("step", 2)]),
], ids=["refused-at-add", "failed-chunk"])
def test_a_failing_request_does_not_fail_its_batch(bad, log):
    """Sequences that join together and whose prefill fails (refused at add, or a chunk failing in a step) are
    added again one at a time: only the failing one gets the error."""
    got, gate, started, done = [], threading.Event(), threading.Event(), {}

    def seq(prompt, name):
        return Sequence(prompt, SamplingParams(max_tokens=2), StopText(decode), None,
                        lambda r, e, name=name: done.__setitem__(name, (r, e)))

    sched = scheduler(got, gate, started)
    sched.submit([seq([99], "blocker")])
    assert started.wait(10)
    sched.submit([seq([1], "a"), seq(bad, "bad"), seq([2], "b")])
    gate.set()
    wait_for(lambda: len(done) == 4)
    sched.close()
    assert got == log
    assert done["blocker"][0].text == "Hello." and done["a"][0].text == "Hello." and done["b"][0].text == "Hello."
    assert done["bad"][0] is None and ("token id -1" if bad == [-1] else "NaN in a prefill chunk") in str(done["bad"][1])
    assert sched.running == 0


def test_a_batch_that_cannot_open_fails_its_requests_and_the_thread_goes_on():
    """When the decode batch cannot be made (e.g. a Triton model whose `mode` the engine refuses), every request
    admitted gets that error; they used to wait forever, the error logged as a failed step. A later batch that
    opens serves normally."""
    log, done, opens = [], {}, []

    def open_batch():
        opens.append(1)
        if len(opens) == 1:
            raise InvalidRequestError("mode must be one of ('dflash', 'ar'), got 'beam'")
        return ScriptedBatch(log)

    def seq(prompt, name):
        return Sequence(prompt, SamplingParams(max_tokens=2), StopText(decode), None,
                        lambda r, e, name=name: done.__setitem__(name, (r, e)))

    sched = Scheduler(open_batch, 8)
    sched.submit([seq([1], "a"), seq([2], "b")])
    wait_for(lambda: len(done) == 2)
    assert all(r is None and "got 'beam'" in str(e) for r, e in done.values())
    sched.submit([seq([3], "c")])
    wait_for(lambda: "c" in done)
    sched.close()
    assert done["c"][0].text == "Hello." and done["c"][1] is None and sched.running == 0


def test_a_stopped_generation_thread_fails_every_request_instead_of_hanging_them():
    """An exception that is not an Exception (SystemExit, GeneratorExit, one of a C extension's own) ends the
    generation thread: the running sequence and every one submitted later get `GenerationStopped` at once (they
    used to wait forever on a thread that was gone) and `alive` is False (serve's /health answers 503)."""
    from dflash_trt.serve.scheduler import GenerationStopped

    class Fatal(BaseException):
        pass

    class Dies(ScriptedBatch):
        def step(self):
            raise Fatal("the interpreter is going away")

    done = {}

    def seq(prompt, name):
        return Sequence(prompt, SamplingParams(max_tokens=2), StopText(decode), None,
                        lambda r, e, name=name: done.__setitem__(name, (r, e)))

    sched = Scheduler(lambda: Dies([]), 8)
    assert sched.alive
    sched.submit([seq([1], "running")])
    wait_for(lambda: "running" in done)
    assert not sched.alive and isinstance(sched.failure, Fatal)
    sched.submit([seq([2], "later"), seq([3], "later too")])
    assert set(done) == {"running", "later", "later too"}  # at once: no thread will take them
    for result, error in done.values():
        assert result is None and isinstance(error, GenerationStopped)
        assert str(error) == "the generation thread stopped (Fatal('the interpreter is going away')); restart the server"
    sched.close()


def test_a_failing_abort_is_a_failed_step_not_a_spinning_thread():
    """Under `serve --tp-size` an abort is broadcast to the other ranks; when they are gone (SIGTERM reached them
    first) the broadcast raises: the batch is dropped and its sequence gets the error, the thread goes idle
    (it used to retry the broadcast forever, logging each failure)."""
    class PeersGone(ScriptedBatch):
        def step(self):  # decodes nothing (its sequence can only end through the abort)
            self.log.append(("step", self.active))

        def abort_prefill(self, request_ids):
            self.log.append(("abort_prefill", len(request_ids)))
            raise RuntimeError("Connection closed by peer")

    log, got = [], []
    sched = Scheduler(lambda: PeersGone(log), 8)
    sched.submit([Sequence([77], SamplingParams(max_tokens=10**6), StopText(decode), None,
                           lambda r, e: got.append((r, e)))])
    wait_for(lambda: ("step", 1) in log)
    sched.abort_all()
    wait_for(lambda: got)
    sched.close()
    assert got[0][0] is None and "Connection closed by peer" in str(got[0][1])
    assert log.count(("abort_prefill", 1)) == 1 and sched.running == 0


def test_a_sequence_aborted_before_its_first_token_records_no_latency():
    """The Prometheus side of a request aborted while its prompt was read in chunks: counted as an abort with the
    prompt tokens read, its queue time, and no time to first token or end-to-end latency (it had no token)."""
    from dflash_trt.serve.metrics import ServerMetrics

    m = ServerMetrics("m", lambda: 0, lambda: 0)
    m.finished(GenerationResult([], "abort", RequestMetrics(prompt_tokens=448)), 0.25)
    m.finished(GenerationResult([4, 4], "length", RequestMetrics(prompt_tokens=5, completion_tokens=2,
                                                                 time_to_first_token_s=0.5, total_time_s=1.0)), 0.25)
    text = m.exposition().decode()

    def value(name):
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))

    assert value("trtllm_time_to_first_token_seconds_count") == 1.0
    assert value("trtllm_e2e_request_latency_seconds_count") == 1.0
    assert value("trtllm_request_queue_time_seconds_count") == 2.0
    assert value("trtllm_prompt_tokens_total") == 453.0
    # TensorRT-LLM's phases of the one that had tokens only: prefill 0.5 s, decode 0.5 s, inference 1.0 s
    assert value("trtllm_request_prefill_time_seconds_sum") == 0.5
    assert value("trtllm_request_decode_time_seconds_sum") == 0.5
    assert value("trtllm_request_inference_time_seconds_count") == 1.0
    assert value("trtllm_request_inference_time_seconds_sum") == 1.0


def test_the_iteration_gauges_appear_once_measured_and_acceptance_length_only_when_speculative():
    """Before any iteration no iteration gauge is exported (no value is measured yet); an autoregressive server
    (speculative False) exports no acceptance length; a speculative one exports the iteration's."""
    from dflash_trt.runtime.decode_batch import StepStats
    from dflash_trt.serve.metrics import ServerMetrics

    def names(m):
        return {line.split("{")[0] for line in m.exposition().decode().splitlines() if not line.startswith("#")}

    step = StepStats(requests=2, emitted_tokens=6, seconds=0.04, context_requests=1, context_tokens=30,
                     scheduled_requests=2, active_requests=2, completed_requests=1)
    ar = ServerMetrics("m", lambda: 0, lambda: 0, max_batch_size=4, speculative=False)
    assert "trtllm_iteration_latency_seconds" not in names(ar)
    ar.iteration(step)
    assert "trtllm_iteration_latency_seconds" in names(ar) and "trtllm_spec_decode_acceptance_length" not in names(ar)
    spec = ServerMetrics("m", lambda: 0, lambda: 0, max_batch_size=4)
    spec.iteration(step)
    text = spec.exposition().decode()
    for name, want in (("trtllm_spec_decode_acceptance_length", 3.0), ("trtllm_prefill_batch_occupancy", 0.25),
                       ("trtllm_num_requests_completed_total", 1.0), ("trtllm_total_context_tokens", 30.0)):
        assert float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + "{"))) == want


def test_a_callback_that_raises_does_not_stop_the_thread():
    def broken(result, error):
        raise ConnectionResetError("client gone")

    got = []
    sched = scheduler([], max_batch_size=1)
    sched.submit([Sequence([1], SamplingParams(max_tokens=1), StopText(decode), lambda d: None, broken)])
    sched.submit([Sequence([2], SamplingParams(max_tokens=1), StopText(decode), lambda d: None,
                           lambda r, e: got.append((r.text, e)))])
    wait_for(lambda: got)
    sched.close()
    assert got == [("Hello.", None)]


def test_failing_iteration_stats_lose_no_result():
    """An on_step (metrics) that raises at every step is logged; each sequence still gets its result or its
    error, once: in a batch, and rerun alone after its batch failed (the [-2] row fails its first step)."""
    def broken(stats):
        raise ValueError("metrics backend down")

    got = []
    sched = Scheduler(lambda: ScriptedBatch([]), 8, on_step=broken)
    sched.submit([Sequence([k], SamplingParams(max_tokens=2), StopText(decode), None,
                           lambda r, e, k=k: got.append((k, r and r.text, type(e).__name__))) for k in (1, -2)])
    wait_for(lambda: len(got) == 2 and sched.idle)
    sched.submit([Sequence([3], SamplingParams(max_tokens=2), StopText(decode), None,
                           lambda r, e: got.append((3, r and r.text, type(e).__name__)))])
    wait_for(lambda: len(got) == 3 and sched.idle)
    sched.close()
    assert sorted(got) == [(-2, None, "RuntimeError"), (1, "Hello.", "NoneType"), (3, "Hello.", "NoneType")]


def test_a_finished_request_is_recorded_before_its_result_goes_out_and_a_failing_record_loses_nothing():
    """on_finished (the request metrics, GET /perf_metrics) runs before the sequence's on_done: a client that has
    its answer finds its record (it could be missing, found by a race over real HTTP); an on_finished that raises
    for one sequence of a step is logged, and that one and the others finishing with it still get their results."""
    order = []

    def record(seq, result):
        order.append(("recorded", seq.prompt[0]))
        if seq.prompt[0] == 1:
            raise ValueError("metrics backend down")

    sched = Scheduler(lambda: ScriptedBatch([]), 8, on_finished=record)
    sched.submit([Sequence([k], SamplingParams(max_tokens=1), StopText(decode), None,
                           lambda r, e, k=k: order.append(("done", k, r and r.text))) for k in (1, 2)])
    wait_for(lambda: len(order) == 4 and sched.idle)
    sched.close()
    assert order == [("recorded", 1), ("done", 1, "Hello."), ("recorded", 2), ("done", 2, "Hello.")]


def test_a_failure_after_tokens_reruns_the_others_but_not_a_started_stream():
    log, gate, started = [], threading.Event(), threading.Event()
    done, streamed = {}, []

    def seq(prompt, name, on_text=None):
        return Sequence(prompt, SamplingParams(max_tokens=2), StopText(decode), on_text,
                        lambda r, e, name=name: done.__setitem__(name, (r, e)))

    sched = scheduler(log, gate, started)
    sched.submit([seq([99], "blocker")])
    assert started.wait(10)
    sched.submit([seq([1], "quiet"), seq([-2], "bad"), seq([2], "stream", streamed.append)])
    gate.set()
    wait_for(lambda: len(done) == 4)
    sched.close()
    # the batch of three fails at its step: the quiet one and the bad one rerun alone; the stream is not rerun
    assert log == [("add", 1), ("step", 1), ("add", 3), ("step", 3), ("add", 1), ("step", 1), ("add", 1), ("step", 1)]
    assert done["blocker"][0].text == "Hello." and done["quiet"][0].text == "Hello." and done["quiet"][1] is None
    assert "NaN" in str(done["bad"][1])
    assert streamed == ["Hello"] and "NaN" in str(done["stream"][1])


def test_close_aborts_the_batch_in_progress_and_the_queue():
    got, log = [], []
    sched = scheduler(log, max_batch_size=1)
    for prompt in ([77], [1]):  # the second waits: the batch is full
        sched.submit([Sequence(prompt, SamplingParams(max_tokens=10**6), StopText(decode), None,
                               lambda r, e, p=prompt: got.append((p, r.finish_reason, r.token_ids, r.text, e)))])
    wait_for(lambda: len(log) > 3)
    sched.close()
    assert not sched._thread.is_alive()
    assert got[0][:2] == ([77], "abort") and got[0][4] is None
    assert got[1] == ([1], "abort", [], "", None)  # never started: an abort with no tokens, not a missing result


def test_abort_all_reaches_a_sequence_being_prefilled():
    """Ctrl-C while a request is being added to the batch (taken from the queue, not yet among the running):
    it still ends with finish_reason "abort" at its next tokens, not after all of them."""
    gate, started, got = threading.Event(), threading.Event(), []
    sched = scheduler([], gate, started)
    sched.submit([Sequence([55], SamplingParams(max_tokens=2), StopText(decode), None,
                           lambda r, e: got.append((r.finish_reason, r.token_ids, e)))])
    assert started.wait(10)
    sched.abort_all()
    gate.set()
    wait_for(lambda: got)
    sched.close()
    assert got == [("abort", [0, 4], None)]


def test_abort_ends_sequences_waiting_for_their_prefill_without_reading_them():
    """Chunked prefill: Ctrl-C ends the sequences whose prompts wait to be read at once (abort, no tokens),
    before the step that would read (here: fail) them; the running one ends at its next tokens."""
    log, gate, started, got = [], threading.Event(), threading.Event(), {}

    def seq(prompt, name):
        return Sequence(prompt, SamplingParams(max_tokens=2), StopText(decode), None,
                        lambda r, e, name=name: got.__setitem__(name, (r.finish_reason, r.token_ids, e)))

    sched = scheduler(log, gate, started)
    sched.submit([seq([77], "running")])
    wait_for(lambda: ("step", 1) in log)
    sched.submit([seq([-3], "waiting"), seq([3], "its pair")])
    assert started.wait(10)  # they are added, waiting for their prefill
    sched.abort_all()
    gate.set()
    wait_for(lambda: len(got) == 3)
    sched.close()
    assert got["waiting"] == ("abort", [], None) and got["its pair"] == ("abort", [], None)
    assert got["running"][0] == "abort" and got["running"][2] is None
    assert log[-3:] == [("add", 2), ("abort_prefill", 2), ("step", 1)]


def tiny_engine(tmp_path):
    """An Engine over a tiny random Llama target (vocab 96) with an untrained 1-layer drafter."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter, load_drafter, load_target, new_drafter_config
    from dflash_trt.runtime.engine import Engine
    from dflash_trt.runtime.proposer import DFlashProposer
    from tests.conftest import make_hf_model

    _, folder = make_hf_model(tmp_path, "llama", vocab=96, seed=3)
    target = load_target(folder)
    drafter = load_drafter(init_drafter(new_drafter_config(TargetConfig.from_pretrained(folder), 1, 4, 95, [1, 3]),
                                        tmp_path / "d", seed=1))
    return Engine(target, DFlashProposer(drafter, target))


def test_a_batch_that_ends_at_its_first_tokens_still_reports_its_prompts(tmp_path):
    """Requests that all end at their first token (max_tokens 1) leave the batch before any decode step: the
    prompts read still make one iteration entry (no decode requests), so the stats count every prompt."""
    from dflash_trt.runtime.decode_batch import DecodeBatch

    engine = tiny_engine(tmp_path)
    steps, done = [], []
    sched = Scheduler(lambda: DecodeBatch(engine), 8, on_step=steps.append)
    sched.submit([Sequence(p, SamplingParams(max_tokens=1), StopText(str), None, lambda r, e: done.append(r))
                  for p in ([5, 6, 7], [8, 9])])
    wait_for(lambda: len(done) == 2 and sum(s.context_requests for s in steps) == 2)
    sched.close()
    # one batch of both, or two if the thread took the first before the second was queued
    assert sum(s.context_tokens for s in steps) == 5 and all(s.requests == 0 for s in steps) and len(steps) <= 2


def test_a_result_goes_out_after_the_iterations_that_made_it(tmp_path):
    """A step's iteration stats are recorded before the results it finished are handed out (a client that has
    its answer finds the steps that made it in GET /metrics), and `idle` holds once all of it is done."""
    from dflash_trt.runtime.decode_batch import DecodeBatch

    engine = tiny_engine(tmp_path)
    steps, seen = [], []
    sched = Scheduler(lambda: DecodeBatch(engine), 8, on_step=steps.append)
    sched.submit([Sequence([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True), StopText(str), None,
                           lambda r, e: seen.append((r, sum(s.emitted_tokens for s in steps))))])
    wait_for(lambda: seen and sched.idle)
    sched.close()
    [(result, emitted)] = seen
    assert len(result.token_ids) == 6 and emitted == 5  # every token but the prefill's, in steps recorded before


@pytest.mark.parametrize("in_flight, chunk", [(True, None), (False, None), (True, 1)])
def test_a_request_joins_a_running_one_and_finishes_first(tmp_path, in_flight, chunk):
    """In-flight batching with a real engine: a short request submitted while a long one decodes joins
    its batch at the next step (with chunked prefill, its prompt read over the next steps) and finishes
    while the long one still runs (static batching: it waits for the long one); both outputs equal their
    requests decoded alone either way."""
    from dflash_trt.runtime.decode_batch import DecodeBatch

    engine = tiny_engine(tmp_path)
    long_p, short_p = [5, 9, 13, 17], [40, 41]
    long_sp = SamplingParams(max_tokens=120, ignore_eos=True)
    short_sp = SamplingParams(temperature=1.0, seed=4, max_tokens=6, ignore_eos=True)
    alone = [engine.generate([p], sp)[0].token_ids for p, sp in ((long_p, long_sp), (short_p, short_sp))]

    def text(ids):
        return " ".join(map(str, ids))

    done, steps, order = {}, [], []
    sched = Scheduler(lambda: DecodeBatch(engine, prefill_chunk=chunk), 8, on_step=steps.append, in_flight=in_flight)
    short = Sequence(short_p, short_sp, StopText(text), None,
                     lambda r, e: (done.__setitem__("short", (r, e)), order.append("short")))
    submitted = []

    def on_text(delta):
        if not submitted and len(delta.split()) and len(sched._seqs) == 1:
            submitted.append(True)
            sched.submit([short])  # from the generation thread: it joins before the next step

    sched.submit([Sequence(long_p, long_sp, StopText(text), on_text,
                           lambda r, e: (done.__setitem__("long", (r, e)), order.append("long")))])
    wait_for(lambda: len(done) == 2, timeout=60)
    sched.close()
    assert order == (["short", "long"] if in_flight else ["long", "short"])
    assert done["long"][0].token_ids == alone[0] and done["short"][0].token_ids == alone[1]
    assert done["long"][0].text == text(alone[0])
    assert max(s.requests for s in steps) == (2 if in_flight else 1)
    # chunked: the long prompt is read in 4 steps, its first decode step is the 4th
    assert [s.requests for s in steps[:4]][: 4 if chunk else 1] == ([0, 0, 0, 1] if chunk else [1])
    assert sum(s.emitted_tokens for s in steps) == 120 + 6 - 2  # all but the two prefill tokens
    assert sum(s.context_tokens for s in steps) == len(long_p) + len(short_p)  # each prompt token once


def test_streamed_generation_logits_go_with_the_text_of_their_tokens():
    """A stream's generation logits go out with the delta that holds their token's text whole (a half character's
    token waits for its other half, as its logprob does), the rest with `rest_logits`; the prompt's logits are set
    with the first tokens (TensorRT-LLM's streamed results carry both)."""
    import torch

    rows, prompt_rows = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3), torch.ones(2, 3)
    sent = []
    seq = Sequence([0, 1], SamplingParams(max_tokens=8, return_context_logits=True, return_generation_logits=True),
                   StopText(decode), lambda delta, logits=None: sent.append((delta, logits)), lambda r, e: None)
    assert seq.on_tokens([0], logits=rows[:1], context_logits=prompt_rows) is None
    assert seq.context_logits is prompt_rows and sent[-1][0] == "Hello" and torch.equal(sent[-1][1], rows[:1])
    seq.on_tokens([7], logits=rows[1:2])  # the first half of "é": no delta, its logits wait
    assert len(sent) == 1
    seq.on_tokens([8, 4], logits=rows[2:4])
    assert sent[-1][0] == "é." and torch.equal(sent[-1][1], rows[1:4])
    result = GenerationResult([0, 7, 8, 4], "length", RequestMetrics(), generation_logits=rows)
    assert seq.rest_logits(result).shape == (0, 3)  # all sent
    seq.restart()
    assert seq.rest_logits(result).shape == (4, 3) and seq.context_logits is None
    plain = Sequence([0], SamplingParams(max_tokens=8), StopText(decode), lambda delta: sent.append((delta, None)),
                     lambda r, e: None)
    plain.on_tokens([0, 4])  # a request asking for no logits: on_text(delta) as before
    assert sent[-1] == ("Hello.", None) and plain.rest_logits(GenerationResult([0, 4], "length", RequestMetrics())) is None


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_a_streams_logits_add_up_to_the_whole_answers(tmp_path, mode):
    """With a real engine through the generation thread: the logits slices of a stream's deltas, then its rest, are
    the generation logits of the same request answered whole; the prompt's logits are the whole answer's."""
    import torch

    from dflash_trt.runtime.decode_batch import DecodeBatch

    engine = tiny_engine(tmp_path)
    prompt = [5, 9, 13, 17]
    params = SamplingParams(max_tokens=12, ignore_eos=True, return_context_logits=True, return_generation_logits=True)
    [whole] = engine.generate([prompt], params, mode=mode)
    slices, done = [], []
    sched = Scheduler(lambda: DecodeBatch(engine, mode), 8)
    seq = Sequence(prompt, params, StopText(lambda ids: " ".join(map(str, ids))),
                   lambda delta, logits=None: slices.append(logits), lambda r, e: done.append((r, e)))
    sched.submit([seq])
    wait_for(lambda: done)
    sched.close()
    [(result, error)] = done
    assert error is None and result.token_ids == whole.token_ids and len(slices) > 1
    slices.append(seq.rest_logits(result))
    assert sum(len(s) for s in slices) == len(whole.token_ids) == 12
    torch.testing.assert_close(torch.cat(slices), whole.generation_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(seq.context_logits, whole.context_logits, atol=1e-5, rtol=0)
    assert seq.context_logits.shape == (len(prompt), 96)
