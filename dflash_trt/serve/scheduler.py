"""The server's one generation thread, with in-flight batching: queued requests join the running batch
between two decode steps (up to `max_batch_size` sequences), as TensorRT-LLM's batch manager schedules.

The engine is synchronous; this thread alternates between admitting what is queued (a prefill of the
new sequences, `DecodeBatch.add`, whose rows join the batch's KV caches) and one decode step of every
sequence in the batch (`DecodeBatch.step`), so a request arriving mid-generation waits at most one
step, not for the whole batch (its queue time is measured). With chunked prefill (`DecodeBatch`'s
`prefill_chunk`) the add only queues them and each step reads the next chunk of their prompts before
decoding; sequences cancelled while they wait for it end without being read (`abort_prefill`), and a
chunk that fails (`PrefillFailed`) takes out only the sequences added with it. Each sequence streams its tokens through
its own `Sequence.on_tokens`, which runs on this thread: it detokenizes, checks stop strings, and hands
text to the HTTP side (`dflash_trt.serve.app`) with a thread-safe callback. One bad request does not
fail the others: sequences whose prefill raises are added again one at a time, and when a decode step
raises, the batch is dropped and each of its sequences is rerun alone from its prompt (except streams
that already sent text, which get the error), so only the failing one gets the error.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from dflash_trt.runtime.decode_batch import PrefillFailed, StepStats
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.stats import GenerationResult, RequestMetrics
from dflash_trt.runtime.stop_text import StopText
from dflash_trt.text import final_text

logger = logging.getLogger(__name__)


@dataclass
class Sequence:
    """One choice to generate: a tokenized prompt and its params, with callbacks run on the generation
    thread. `on_text(delta)` (streaming; None otherwise) gets text as it is decoded, and, when the params ask
    for logprobs, `on_text(delta, logprobs)`: the `TokenLogprob`s of the tokens whose text the sent deltas
    now hold whole and an earlier call did not carry (`StopText.sent_tokens`), so a chunk's tokens spell its
    text; `rest_logprobs` has the ones left at the end (a stop string's last token among them). When the params
    ask for generation logits, `on_text` gets the keyword `logits` too: those tokens' rows ([tokens, V] float32,
    `SamplingParams.return_generation_logits`), the rest at the end from `rest_logits`; `context_logits` (params
    ask for them): the prompt's [prompt tokens, V], set with its first tokens as `prompt_logprobs`. `on_done(result,
    error)` once, with the GenerationResult (its `text` the final text, stop strings applied, its
    `logprobs` cut there too) or the exception.
    `cancelled` (set from any thread) ends it at its next tokens with finish_reason "abort" (a sequence
    still queued ends with it and no tokens). `score_only` (max_tokens 0 with echo): the token generated to read the prompt is
    dropped from the result and its metrics (no text, no tokens, finish_reason "length"). `prompt_logprobs`
    (params.prompt_logprobs set): the prompt's `TokenLogprob`s, set with its first tokens (before the
    `on_text` call that carries them, so a stream can send the prompt's logprobs ahead of its tokens).
    """

    prompt: list[int]
    params: SamplingParams
    text: StopText
    on_text: Callable[[str], None] | None
    on_done: Callable[[GenerationResult | None, BaseException | None], None]
    arrival: float = field(default_factory=time.perf_counter)
    queue_time_s: float = 0.0
    sent_text: bool = False  # text went to the client: the sequence cannot be rerun from the start
    cancelled: bool = False
    score_only: bool = False  # max_tokens 0 with echo: the one token generated is dropped from the result
    logprobs: list = field(default_factory=list)  # TokenLogprobs received (params.logprobs set)
    logprobs_sent: int = 0  # how many of them went out with a delta
    # params.prompt_logprobs set: the prompt's (one per prompt token, None first), from its first tokens on
    prompt_logprobs: list | None = None
    # params.return_generation_logits, streaming: the rows ([t, V] tensors) of the tokens received whose text has not
    # gone out yet, and how many tokens' rows went out with a delta
    logits_waiting: list = field(default_factory=list)
    logits_sent: int = 0
    # params.return_context_logits: the prompt's [prompt tokens, V], from its first tokens on
    context_logits: object | None = None
    # the iterations (decode steps, numbered from 1 as GET /metrics numbers them) in which it was first scheduled
    # (the one that reports its prefill) and in which its last token came: TensorRT-LLM's first_iter / last_iter
    first_iter: int | None = None
    last_iter: int | None = None
    # the request's own stop_token_ids (the result's stop_reason names them; the target's EOS ids the server adds
    # to params.stop_token_ids stop with stop_reason None, as vLLM's)
    stop_token_ids: tuple[int, ...] = ()

    def on_tokens(self, ids: list[int], logprobs: list | None = None, prompt_logprobs: list | None = None, *,
                  logits=None, context_logits=None) -> str | None:
        """The runtime's `on_tokens` (`Engine.generate`) for this sequence: its new token ids, with the logprobs,
        prompt logprobs and logits its params ask for; returns a finish reason ("abort" when cancelled, "stop" at
        a stop string) or None."""
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        if context_logits is not None:
            self.context_logits = context_logits
        if self.cancelled:
            return "abort"
        if logprobs is not None:
            self.logprobs.extend(logprobs)
        if logits is not None and self.on_text is not None:
            self.logits_waiting.append(logits)
        if self.on_text is None and not self.text.stops:
            return None  # nothing to stream or to watch for: the text is decoded once, at the end
        reason = self.text.add(ids)
        if self.on_text is not None:
            delta = self.text.delta()
            if delta:
                self.sent_text = True
                # the logits of the tokens whose text this delta completes (the rest wait for theirs)
                extra = {"logits": self._take_logits()} if self.params.return_generation_logits else {}
                if self.params.logprobs is None:
                    self.on_text(delta, **extra)
                else:
                    # the logprobs of the tokens whose text this delta completes (the rest wait for theirs)
                    end = min(self.text.sent_tokens(self.logprobs_sent), len(self.logprobs))
                    self.on_text(delta, self.logprobs[self.logprobs_sent : end], **extra)
                    self.logprobs_sent = max(self.logprobs_sent, end)
        return reason

    def _take_logits(self):
        """The generation logits rows [t, V] of the tokens whose text the sent deltas now hold whole and no earlier
        delta carried (`StopText.sent_tokens`); afterwards sent."""
        import torch

        waiting = torch.cat(self.logits_waiting) if self.logits_waiting else torch.zeros(0, 0)
        end = min(self.text.sent_tokens(self.logits_sent), self.logits_sent + len(waiting))
        taken, rest = waiting[: end - self.logits_sent], waiting[end - self.logits_sent :]
        self.logits_waiting = [rest] if len(rest) else []
        self.logits_sent = max(self.logits_sent, end)
        return taken

    def rest_logits(self, result: GenerationResult):
        """The finished result's generation logits rows [t, V] not sent with a delta yet (the last chunk's);
        afterwards sent. None where the params asked for none."""
        if result.generation_logits is None:
            return None
        rest = result.generation_logits[self.logits_sent :]
        self.logits_sent += len(rest)
        self.logits_waiting = []
        return rest

    def rest_logprobs(self, result: GenerationResult) -> list:
        """The finished result's TokenLogprobs not sent with a delta yet (the last chunk's); afterwards sent."""
        rest = (result.logprobs or [])[self.logprobs_sent :]
        self.logprobs_sent += len(rest)
        return rest

    def restart(self) -> None:
        """Forget the text decoded so far (before running the sequence again from its prompt)."""
        self.text = StopText(self.text.decode, self.text.stops, self.text.token_aligned, self.text.min_tokens)
        self.logprobs, self.logprobs_sent, self.prompt_logprobs = [], 0, None
        self.logits_waiting, self.logits_sent, self.context_logits = [], 0, None


def _done(seq: Sequence, result: GenerationResult | None, error: BaseException | None) -> None:
    """seq.on_done, its failure logged (a client gone) so that the other sequences still get theirs."""
    try:
        seq.on_done(result, error)
    except Exception:  # noqa: BLE001
        logger.exception("dflash-trt: handing a finished request to its client failed")


class GenerationStopped(RuntimeError):
    """A request's error once the scheduler's generation thread has stopped (`Scheduler.failure`): the server
    cannot generate until it is restarted (a 500 naming the cause)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"the generation thread stopped ({cause!r}); restart the server")


class Scheduler:
    """In-flight batching of queued sequences on one thread.

    Args:
        open_batch: callable() -> a new, empty `dflash_trt.runtime.decode_batch.DecodeBatch` (or an object with
            its `add`, `step`, `take_finished` and `active`: `dflash_trt.serve.lockstep.leader`).
        max_batch_size: sequences in the batch at most (>= 1).
        in_flight: True: waiting sequences join the running batch between decode steps; False: static
            batching (they wait until the batch has ended, then start the next one together), the
            baseline `build_scripts/bench_inflight.py` measures against.
        on_step: called after each decode step with its `StepStats` (the iteration stats).
        on_finished: called with (sequence, result) as each sequence finishes (the request metrics).
        on_cancelled: called with each sequence cancelled while it waited in the queue (its client left
            before it joined a batch: it ends with no result and no tokens), for the metrics.
    """

    def __init__(self, open_batch: Callable, max_batch_size: int = 8,
                 on_step: Callable[[StepStats], None] | None = None,
                 on_finished: Callable[[Sequence, GenerationResult], None] | None = None,
                 on_cancelled: Callable[[Sequence], None] | None = None, in_flight: bool = True):
        self._open_batch, self.max_batch_size, self.in_flight = open_batch, max_batch_size, in_flight
        self._on_step, self._on_finished, self._on_cancelled = on_step, on_finished, on_cancelled
        self._queue: queue.Queue[Sequence | None] = queue.Queue()
        self._batch = None
        self._seqs: dict[int, Sequence] = {}  # request id in self._batch -> its sequence
        self._pending: list[Sequence] = []  # taken from the queue, not yet in self._seqs (being prefilled)
        self.iterations = 0  # decode steps reported (`on_step`): the number of the last one
        #: what ended the generation thread, if anything did but `close` (an exception that is not an Exception:
        #: those fail their requests only); sequences submitted after it end with `GenerationStopped`
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="dflash-generate", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        """Sequences in the batch being decoded."""
        return len(self._seqs)

    @property
    def idle(self) -> bool:
        """Nothing running, being admitted or queued, and no batch open: every iteration so far is recorded
        (`on_step`) and every result handed out. (Read from another thread while sequences are submitted,
        one being taken off the queue at that instant may not show yet.)"""
        return not self._seqs and not self._pending and self._queue.empty() and self._batch is None

    @property
    def waiting(self) -> int:
        """Sequences queued and not yet in a batch."""
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        """The generation thread runs (False once `close` ended it, or after `failure`)."""
        return self._thread.is_alive() and self.failure is None

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences (the choices of one request are queued together, so they join a batch
        together when they fit). After a `failure` they end at once with `GenerationStopped`."""
        for s in seqs:
            self._queue.put(s)
        if self.failure is not None:  # (also one queued while the thread was ending: each is failed once)
            self._fail_queued()

    def _fail_queued(self) -> None:
        """Hand every sequence still queued `GenerationStopped` (after a `failure`)."""
        error = GenerationStopped(self.failure)
        while True:
            try:
                s = self._queue.get_nowait()
            except queue.Empty:
                return
            if s is not None:
                _done(s, None, error)

    def abort_all(self) -> None:
        """Abort the sequences being decoded and the queued ones (finish_reason "abort" at their next tokens;
        queued ones end before they start); returns at once (safe in a signal handler). New ones still run."""
        for s in list(self._seqs.values()) + list(self._pending):
            s.cancelled = True
        with self._queue.mutex:
            for s in self._queue.queue:
                if s is not None:
                    s.cancelled = True

    def close(self) -> None:
        """Stop the thread: the sequences in progress and the queued ones are aborted (`abort_all`), then
        the thread ends (a server shutting down waits for no generation)."""
        self.abort_all()
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - not an Exception (those are handled per request below)
            self.failure = exc
            logger.critical("dflash-trt: the generation thread stopped (%r); every request now fails: restart the "
                            "server", exc, exc_info=exc)
            error = GenerationStopped(exc)
            for s in {id(s): s for s in [*self._seqs.values(), *self._pending]}.values():  # (one in both: once)
                _done(s, None, error)
            self._seqs, self._pending, self._batch = {}, [], None
            self._fail_queued()

    def _serve(self) -> None:
        stopping = False
        while True:
            new = self._pending = []  # what abort_all must also reach while it is prefilled
            if not self._seqs:
                if stopping:
                    return
                first = self._queue.get()  # idle: wait for work
                if first is None:
                    return
                new.append(first)
            while (not stopping and (self.in_flight or not self._seqs)
                   and len(self._seqs) + len(new) < self.max_batch_size):
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stopping = True  # finish (abort) what runs, admit nothing more
                else:
                    new.append(nxt)
            try:
                if new:
                    self._admit(new)
                self._pending = []
                if self._seqs:
                    self._step()
            except Exception:  # noqa: BLE001 - a metrics callback failed: log it, keep serving
                logger.exception("dflash-trt: recording a step failed; the generation thread goes on")

    def _admit(self, new: list[Sequence]) -> None:
        now = time.perf_counter()
        live = []
        for s in new:
            s.queue_time_s = now - s.arrival
            if s.cancelled:  # ends as an abort with no tokens (its client left, or the server is stopping)
                _done(s, GenerationResult([], "abort", RequestMetrics(), text=""), None)
                if self._on_cancelled is not None:
                    self._on_cancelled(s)
            else:
                live.append(s)
        if live:
            self._join(live)

    def _join(self, live: list[Sequence]) -> None:
        """Prefill `live` into the running batch (a new one if none runs)."""
        if self._batch is None:
            try:
                self._batch = self._open_batch()
            except Exception as exc:  # noqa: BLE001 - e.g. a mode the engine refuses: each request gets the error
                for s in live:
                    _done(s, None, exc)
                return
        for s in live:  # their prefill is reported with the next iteration
            s.first_iter = self.iterations + 1
        try:
            ids = self._batch.add([s.prompt for s in live], [s.params for s in live],
                                  lambda k, ids, *more, **logits: live[k].on_tokens(ids, *more, **logits))
        except Exception as exc:  # noqa: BLE001 - handed to each request, the thread keeps serving
            self._retry(live, exc)  # the batch is as it was
            return
        self._seqs.update(zip(ids, live))
        self._finish()

    def _retry(self, failed: list[Sequence], error: BaseException) -> None:
        """Sequences whose prefill failed together are added again one at a time, so that only a failing
        one gets the error (a lone one, or a stream already under way, which cannot start over, gets it)."""
        for s in failed:
            if len(failed) == 1 or s.sent_text:
                _done(s, None, error)
            else:
                s.restart()
                self._join([s])
        self._drop_if_empty()

    def _step(self) -> None:
        try:
            cancelled = [i for i, s in self._seqs.items() if s.cancelled]
            if cancelled and self._batch.abort_prefill(cancelled):  # left while their prompts wait to be read
                self._finish()
                if not self._seqs:
                    return
            stats = self._batch.step()
        except PrefillFailed as exc:  # a chunk of chunked prefill: its sequences left the batch, which goes on
            self._retry([self._seqs.pop(i) for i in exc.request_ids], exc.error)
            return
        except Exception as exc:  # noqa: BLE001 - the batch's state is undefined: rerun its sequences alone
            seqs = list(self._seqs.values())
            self._batch, self._seqs = None, {}
            for s in seqs:
                if len(seqs) == 1 or s.sent_text:
                    _done(s, None, exc)
                else:
                    s.restart()
                    self._run_alone(s)
            return
        self._record_then_finish(stats)

    def _record_then_finish(self, stats: StepStats) -> None:
        """The step's iteration stats first, then its finished sequences' results: a client that has its
        answer finds the steps that made it in GET /metrics). A failing `on_step` is logged: the results
        still go out."""
        self.iterations += 1
        try:
            if self._on_step is not None:
                self._on_step(stats)
        except Exception:  # noqa: BLE001 - the metrics, not the requests, failed
            logger.exception("dflash-trt: recording a step failed; the generation thread goes on")
        self._finish()

    def _run_alone(self, s: Sequence) -> None:
        """Decode `s` in a batch of its own to the end (after its batch failed), admitting nothing else."""
        self._pending = [s]
        s.first_iter = self.iterations + 1
        try:
            self._batch = self._open_batch()
            (rid,) = self._batch.add([s.prompt], [s.params], lambda k, ids, *more, **logits: s.on_tokens(
                ids, *more, **logits))
            self._seqs[rid] = s
            self._finish()
            while self._seqs:
                self._record_then_finish(self._batch.step())
        except Exception as exc:  # noqa: BLE001 - this one is the failing request
            _done(s, None, exc.error if isinstance(exc, PrefillFailed) else exc)
            self._batch, self._seqs = None, {}

    def _finish(self) -> None:
        """Hand out the results of the sequences finished in the batch, each recorded (`on_finished`) first."""
        for rid, r in self._batch.take_finished():
            s = self._seqs.pop(rid)
            # one that ended at its prefill ends in the iteration that reports it (the next one, or the flush)
            s.last_iter = max(self.iterations, s.first_iter or 0)
            if s.score_only:  # scoring the prompt: no completion (the first token was generated and is dropped)
                r.text, r.finish_reason, r.token_ids = "", "length", []
                r.logprobs = None if r.logprobs is None else []
                r.metrics.completion_tokens = 0
            elif s.text.stopped:  # a stop string: its text and tokens end there
                r.text, r.finish_reason, r.stop_reason = s.text.text, "stop", s.text.matched
                r.token_ids = r.token_ids[: s.text.used]
                if r.logprobs is not None:
                    r.logprobs = r.logprobs[: s.text.used]
                if r.generation_logits is not None:
                    r.generation_logits = r.generation_logits[: s.text.used]
                r.metrics.completion_tokens = len(r.token_ids)  # as `usage` counts them, and the metrics
            else:
                r.text = final_text(s.text.decode(r.token_ids), r.finish_reason)
                if r.stop_reason not in s.stop_token_ids:  # the target's EOS ids, which the request did not give
                    r.stop_reason = None
            try:  # recorded before the client has its result: it then finds it in the metrics
                if self._on_finished is not None:
                    self._on_finished(s, r)
            except Exception:  # noqa: BLE001 - the metrics, not the request, failed: it still gets its result
                logger.exception("dflash-trt: recording a finished request failed; the generation thread goes on")
            _done(s, r, None)
        self._drop_if_empty()

    def _drop_if_empty(self) -> None:
        if not self._seqs and self._batch is not None:
            flush = getattr(self._batch, "flush_stats", None)  # prompts read since its last step (none followed)
            stats = flush() if flush is not None else None
            try:
                if stats is not None:
                    self.iterations += 1
                if stats is not None and self._on_step is not None:
                    self._on_step(stats)
            finally:
                self._batch = None  # its caches are freed; the next sequences open a new batch
