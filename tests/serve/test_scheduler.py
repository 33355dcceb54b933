"""The server's generation thread and streaming text, without HTTP: stop strings across tokens, held-back
half characters, and a failing request that must not fail the others of its batch."""

from __future__ import annotations

import threading

from dflash_trt.errors import InvalidRequestError
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.stats import GenerationResult, RequestMetrics
from dflash_trt.serve.scheduler import Scheduler, Sequence, StopText


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


def stream(ids, stops=(), chunks=1):
    """Feed ids `chunks` at a time: (deltas sent, reason, final rest)."""
    st = StopText(decode, tuple(stops))
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


def test_a_failing_request_does_not_fail_its_batch():
    calls = []

    def generate(prompts, params, on_tokens):
        calls.append(len(prompts))
        if any(p == [-1] for p in prompts):
            raise InvalidRequestError("token id -1")
        out = []
        for i, p in enumerate(prompts):
            on_tokens(i, [0, 4])
            out.append(GenerationResult([0, 4], "length", RequestMetrics(completion_tokens=2)))
        return out

    gate, started, blocker_done = threading.Event(), threading.Event(), threading.Event()

    def blocked_generate(prompts, params, on_tokens):
        if prompts == [[99]]:
            started.set()
            gate.wait(10)  # hold the thread so the next three queue up as one batch
            blocker_done.set()
            return [GenerationResult([], "length", RequestMetrics())]
        return generate(prompts, params, on_tokens)

    done = {}

    def seq(prompt, name):
        return Sequence(prompt, SamplingParams(max_tokens=2), StopText(decode), None,
                        lambda r, e, name=name: done.__setitem__(name, (r, e)))

    sched = Scheduler(blocked_generate, max_batch_size=8)
    sched.submit([seq([99], "blocker")])
    assert started.wait(10)
    sched.submit([seq([1], "a"), seq([-1], "bad"), seq([2], "b")])
    gate.set()
    wait_for(lambda: len(done) == 4)
    sched.close()
    assert blocker_done.is_set()
    assert calls == [3, 1, 1, 1]  # the batch of three, then each alone
    assert done["a"][0].text == "Hello." and done["b"][0].text == "Hello."
    assert done["bad"][0] is None and "token id -1" in str(done["bad"][1])


def test_a_callback_that_raises_does_not_stop_the_thread():
    def generate(prompts, params, on_tokens):
        for i in range(len(prompts)):
            on_tokens(i, [0])
        return [GenerationResult([0], "length", RequestMetrics(completion_tokens=1)) for _ in prompts]

    def broken(result, error):
        raise ConnectionResetError("client gone")

    got = []
    sched = Scheduler(generate, max_batch_size=1)
    sched.submit([Sequence([1], SamplingParams(max_tokens=1), StopText(decode), lambda d: None, broken)])
    sched.submit([Sequence([2], SamplingParams(max_tokens=1), StopText(decode), lambda d: None,
                           lambda r, e: got.append((r.text, e)))])
    wait_for(lambda: got)
    sched.close()
    assert got == [("Hello", None)]


def test_a_failure_after_tokens_reruns_the_others_but_not_a_started_stream():
    calls = []

    def generate(prompts, params, on_tokens):
        calls.append(len(prompts))
        for i in range(len(prompts)):
            on_tokens(i, [0])  # every row emits its first token (the prefill), then the batch fails
        if any(p == [-1] for p in prompts):
            raise RuntimeError("NaN in the bad row's probabilities")
        for i in range(len(prompts)):
            on_tokens(i, [4])
        return [GenerationResult([0, 4], "length", RequestMetrics(completion_tokens=2)) for _ in prompts]

    gate, started = threading.Event(), threading.Event()

    def blocked(prompts, params, on_tokens):
        if prompts == [[99]]:
            started.set()
            gate.wait(10)
            return [GenerationResult([], "length", RequestMetrics())]
        return generate(prompts, params, on_tokens)

    done, streamed = {}, []

    def seq(prompt, name, on_text=None):
        return Sequence(prompt, SamplingParams(max_tokens=2), StopText(decode), on_text,
                        lambda r, e, name=name: done.__setitem__(name, (r, e)))

    sched = Scheduler(blocked, max_batch_size=8)
    sched.submit([seq([99], "blocker")])
    assert started.wait(10)
    sched.submit([seq([1], "quiet"), seq([-1], "bad"), seq([2], "stream", streamed.append)])
    gate.set()
    wait_for(lambda: len(done) == 4)
    sched.close()
    assert calls == [3, 1, 1]  # the batch, then the quiet one and the bad one alone; the stream is not rerun
    assert done["quiet"][0].text == "Hello." and done["quiet"][1] is None
    assert "NaN" in str(done["bad"][1])
    assert streamed == ["Hello"] and "NaN" in str(done["stream"][1])


def test_close_aborts_the_batch_in_progress():
    started = threading.Event()

    def endless(prompts, params, on_tokens):
        started.set()
        n = 0
        while on_tokens(0, [0]) is None:  # a generation that only the scheduler can end
            n += 1
        return [GenerationResult([0] * (n + 1), "abort", RequestMetrics(completion_tokens=n + 1))]

    got = []
    sched = Scheduler(endless)
    sched.submit([Sequence([1], SamplingParams(max_tokens=10**6), StopText(decode), None,
                           lambda r, e: got.append((r.finish_reason, e)))])
    assert started.wait(10)
    sched.close()
    assert got == [("abort", None)] and not sched._thread.is_alive()
