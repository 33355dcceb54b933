"""The server's one generation thread: requests queue, and whatever is waiting when the engine is free
decodes together as one batch (static batching, up to `max_batch_size` sequences).

The engine is synchronous and runs one batch at a time; a request that arrives while a batch runs
waits for the next one (its queue time is measured). Each sequence streams its tokens through its
own `Sequence.on_tokens`, which runs on this thread: it detokenizes, checks stop strings, and hands
text to the HTTP side (`dflash_trt.serve.app`) with a thread-safe callback. One bad request does not
fail the others of its batch: a batch that raises is rerun one sequence at a time (except streams
that already sent text, which get the error), so only the failing one gets the error.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.stats import GenerationResult
from dflash_trt.text import final_text, text_to_stream

logger = logging.getLogger(__name__)


class StopText:
    """Incremental detokenization of one completion with OpenAI stop strings.

    `add(ids)` appends token ids and returns "stop" once a stop string appears in the text (the text is
    then cut before it, as OpenAI returns it); `delta()` gives the text not sent yet that is safe to send:
    complete characters (`text_to_stream`) and no tail that could still become a stop string.

    Args:
        decode: token ids -> text (the tokenizer's decode, special tokens skipped).
        stops: stop strings (non-empty).
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = ()):
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.text = ""
        self.sent = ""
        self.stopped = False
        self.used: int | None = None  # tokens up to the one that completed the stop string

    def add(self, ids: list[int]) -> str | None:
        if self.stopped or not ids:
            return None
        before = len(self.ids)
        self.ids.extend(ids)
        text = self.decode(self.ids)
        cut = self._find(text)
        if cut < 0:
            self.text = text
            return None
        self.text, self.stopped = text[:cut], True
        # several tokens may come at once (accepted drafts): count those up to the stop string's end only
        self.used = next((k for k in range(before + 1, len(self.ids)) if self._find(self.decode(self.ids[:k])) >= 0),
                         len(self.ids))
        return "stop"

    def _find(self, text: str) -> int:
        """Where the first stop string starts in `text`, or -1."""
        return min((k for k in (text.find(s, max(0, len(self.sent) - len(s))) for s in self.stops) if k >= 0),
                   default=-1)

    def _held(self) -> int:
        """Characters at the end of the text that are a proper prefix of a stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:k])), default=0)

    def delta(self) -> str:
        """New text to send; afterwards it counts as sent."""
        new = text_to_stream(self.text, self.sent)
        if not self.stopped:
            new = new[: max(0, len(new) - self._held())]
        self.sent += new
        return new

    def rest(self, finish_reason: str | None) -> str:
        """The final text's part not sent yet (at the end of generation; `final_text` drops a trailing
        half character of a length-cut completion)."""
        final = final_text(self.text, finish_reason)
        new = final[len(self.sent):] if final.startswith(self.sent) else ""
        self.sent += new
        return new


@dataclass
class Sequence:
    """One choice to generate: a tokenized prompt and its params, with callbacks run on the generation
    thread. `on_text(delta)` (streaming; None otherwise) gets text as it is decoded; `on_done(result, error)` once, with
    the GenerationResult (its `text` the final text, stop strings applied) or the exception.
    `cancelled` (set from any thread) ends it at its next tokens with finish_reason "abort"."""

    prompt: list[int]
    params: SamplingParams
    text: StopText
    on_text: Callable[[str], None] | None
    on_done: Callable[[GenerationResult | None, BaseException | None], None]
    arrival: float = field(default_factory=time.perf_counter)
    queue_time_s: float = 0.0
    sent_text: bool = False  # text went to the client: the sequence cannot be rerun from the start
    cancelled: bool = False

    def on_tokens(self, ids: list[int]) -> str | None:
        if self.cancelled:
            return "abort"
        if self.on_text is None and not self.text.stops:
            return None  # nothing to stream or to watch for: the text is decoded once, at the end
        reason = self.text.add(ids)
        if self.on_text is not None:
            delta = self.text.delta()
            if delta:
                self.sent_text = True
                self.on_text(delta)
        return reason

    def restart(self) -> None:
        """Forget the text decoded so far (before running the sequence again from its prompt)."""
        self.text = StopText(self.text.decode, self.text.stops)


def _done(seq: Sequence, result: GenerationResult | None, error: BaseException | None) -> None:
    """seq.on_done, its failure logged (a client gone) so that the other sequences still get theirs."""
    try:
        seq.on_done(result, error)
    except Exception:  # noqa: BLE001
        logger.exception("dflash-trt: handing a finished request to its client failed")


class Scheduler:
    """Runs `generate(prompts, params, on_tokens)` (a `Pipeline.generate` with its mode bound) on one
    thread over batches of queued sequences.

    Args:
        generate: callable(prompts, params_list, on_tokens) -> list[GenerationResult].
        max_batch_size: sequences per batch at most (>= 1).
        on_batch: called after each batch with (sequences, results, seconds) for the metrics.
        on_cancelled: called with each sequence cancelled while it waited in the queue (its client left
            before its batch began: it ends with no result and no tokens), for the metrics.
    """

    def __init__(self, generate, max_batch_size: int = 8,
                 on_batch: Callable[[list[Sequence], list[GenerationResult], float], None] | None = None,
                 on_cancelled: Callable[[Sequence], None] | None = None):
        self._generate, self.max_batch_size, self._on_batch = generate, max_batch_size, on_batch
        self._on_cancelled = on_cancelled
        self._queue: queue.Queue[Sequence | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="dflash-generate", daemon=True)
        self.running = 0
        self._live: list[Sequence] = []  # the batch being decoded
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Sequences queued and not yet in a batch."""
        return self._queue.qsize()

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences (the choices of one request are queued together, so they share a batch when
        they fit)."""
        for s in seqs:
            self._queue.put(s)

    def abort_all(self) -> None:
        """Abort the batch in progress and the queued sequences (finish_reason "abort" at their next tokens;
        queued ones end before they start); returns at once (safe in a signal handler). New ones still run."""
        for s in self._live:
            s.cancelled = True
        with self._queue.mutex:
            for s in self._queue.queue:
                if s is not None:
                    s.cancelled = True

    def close(self) -> None:
        """Stop the thread: the batch in progress and the queued sequences are aborted (`abort_all`), then
        the thread ends (a server shutting down waits for no generation)."""
        self.abort_all()
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_batch_size:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(nxt)
            try:
                self._run(batch)
            except Exception:  # noqa: BLE001 - a metrics callback failed: log it, keep serving
                logger.exception("dflash-trt: recording a batch failed; the generation thread goes on")

    def _run(self, batch: list[Sequence]) -> None:
        start = time.perf_counter()
        live = []
        for s in batch:
            s.queue_time_s = start - s.arrival
            if s.cancelled:
                _done(s, None, None)
                if self._on_cancelled is not None:
                    self._on_cancelled(s)
            else:
                live.append(s)
        if not live:
            return
        self.running, self._live = len(live), live
        try:
            results = self._generate([s.prompt for s in live], [s.params for s in live],
                                     lambda i, ids: live[i].on_tokens(ids))
        except Exception as exc:  # noqa: BLE001 - handed to each request, the thread keeps serving
            if len(live) == 1:
                _done(live[0], None, exc)
                return
            for s in live:  # find the request that fails; the others still get their answer
                if s.sent_text:  # a stream already under way cannot start over
                    _done(s, None, exc)
                else:
                    s.restart()
                    self._run([s])
            return
        finally:
            self.running, self._live = 0, []
        for s, r in zip(live, results):
            if s.text.stopped:  # a stop string: its text and tokens end there
                r.text, r.finish_reason = s.text.text, "stop"
                r.token_ids = r.token_ids[: s.text.used]
            else:
                r.text = final_text(s.text.decode(r.token_ids), r.finish_reason)
            _done(s, r, None)
        if self._on_batch is not None:
            self._on_batch(live, results, time.perf_counter() - start)
