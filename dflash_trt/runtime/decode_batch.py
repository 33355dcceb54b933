"""In-flight batching: a batch of requests decoding together, which new requests join between steps.

`DecodeBatch` holds a batch of requests between decode steps, so that requests can join it while it runs
(in-flight batching: the server's scheduler), with its iteration stats (`StepStats`) and the error of a failed
prefill chunk (`PrefillFailed`); `Engine.generate` is one batch run to its end (through `DecodeBatch._add`).
The batch drives its engine's prefill and decode step through the engine's private methods (`Engine._requests`,
`_prefill`, `_emit_first`, `_step`, `_phase`): the two modules are one runtime, split by concept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from dflash_trt.errors import DFlashError, InvalidRequestError
from dflash_trt.runtime.prompt_lookup import NgramIndex
from dflash_trt.runtime.request import Request
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.stats import GenerationResult

if TYPE_CHECKING:
    from dflash_trt.runtime.engine import Engine

MODES = ("dflash", "ar")
#: Output tokens a request's KV cache rows hold room for when it is added (past its prompt, a block and one): a
#: short answer never grows its caches, whatever its max_tokens; a longer one doubles them as it goes
#: (`DecodeBatch._reserve`), so memory and time follow the tokens produced (vLLM's and TensorRT-LLM's paged caches
#: also hand a request blocks as it decodes, not max_tokens' worth up front).
INITIAL_OUTPUT_SLOTS = 64


@dataclass
class StepStats:
    """One iteration of a `DecodeBatch` (the prefill work since the previous one, then one decode step:
    one target forward over its requests), for iteration stats.

    requests: requests in the decode step; requests_with_drafts: those that verified drafts in it;
    drafted_tokens / accepted_tokens: drafts verified / accepted, summed over them; emitted_tokens:
    tokens the step added to their outputs (accepted drafts + one target token each, fewer where a
    request stopped); context_requests / context_tokens: requests whose prompts were (partly)
    prefilled in this iteration and the prompt tokens read (a chunk of each with chunked prefill;
    TensorRT-LLM's numContextRequests / numCtxTokens); scheduled_requests: distinct requests in either
    (one whose last chunk and first decode step share the iteration counts once); active_requests:
    the requests in the batch in this iteration, decoded or still waiting for (the rest of) their prompt
    (TensorRT-LLM's numActiveRequests, context and generation phases both); seconds: its wall time (the
    decode step and the prefill work it reports: a chunk read within `step`, or the whole prefills `add`
    did since the previous iteration, as TensorRT-LLM's iteration latency covers its context phase);
    completed_requests: the requests that finished since the previous iteration's stats (in this decode step, at
    their first token, or aborted; TensorRT-LLM's numCompletedRequests)."""

    requests: int = 0
    requests_with_drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    seconds: float = 0.0
    context_requests: int = 0
    context_tokens: int = 0
    scheduled_requests: int = 0
    active_requests: int = 0
    completed_requests: int = 0


class PrefillFailed(DFlashError):
    """A chunk of a chunked prefill failed inside `DecodeBatch.step`: the requests `request_ids` (added
    together) were dropped from the batch, which goes on; `error` is what the prefill raised (for their
    callers; adding them again one at a time finds which one fails)."""

    def __init__(self, request_ids: list[int], error: BaseException):
        super().__init__(f"prefill of requests {request_ids} failed: {error}")
        self.request_ids, self.error = request_ids, error


@dataclass
class _Prefill:
    """Requests added together, prefilled into their own caches before their rows join the batch."""

    reqs: list[Request]
    cache: object  # KVCache of their target rows
    drafter_cache: object  # the drafter's context cache of their rows (mode "dflash"), or None
    next: int = 0  # where the next chunk starts: an offset into each prompt's part left to read (past its cached prefix)


class DecodeBatch:
    """Requests decoding together, to which new requests can be added between steps (in-flight
    batching, as TensorRT-LLM's batch manager does): `add` prefills the new requests on their own
    and appends their rows to the batch's target KV cache and drafter context cache; `step` runs one
    decode step (draft -> verify -> commit, `Engine.generate`'s step) of every unfinished request.
    A request's output does not depend on what else is in the batch or when it joined (each has its
    own RNG; greedy rows are computed independently), except that more requests than the proposer's
    `max_concurrency` make the step autoregressive (same greedy tokens, other samples).

    KV cache sizing: a request's rows get room for its prompt and INITIAL_OUTPUT_SLOTS output tokens (fewer
    where its max_tokens or the context leave fewer); before a step that could write past the caches' capacity,
    both caches double (`_reserve`, capped at the most any row can need), and when requests leave they shrink
    to twice what the others hold (`_room`). So memory and time follow the tokens produced, not max_tokens; the
    outputs are the same bits as with caches sized for max_tokens up front (attention reads the same slots).

    Chunked prefill (`prefill_chunk`, TensorRT-LLM's `enable_chunked_prefill`): `add` only queues the
    new requests; each `step` first prefills the next `prefill_chunk` prompt positions of the requests
    added earliest (one add call's requests at a time, in order), then decodes the running ones, so a
    long prompt joining the batch delays each running stream by one chunk's forward per step instead
    of its whole prefill. Once its prompt is read, a request emits its first token and joins the
    decode step of that same `step`, also while longer prompts added with it are still being read. The
    chunks go through the same causal attention over the KV cache as one prefill does; only the matrix
    shapes differ, so logits may differ from an unchunked prefill in their last bits (greedy tokens only
    where two are that close).

    Prefix caching (the engine's `prefix_cache`): each request is prefilled from the end of the longest prefix
    its prompt shares with a kept sequence (its rows get those positions' target K/V and drafter context from the
    cache; of the requests of one `add` call, those without a cached prefix share one forward per chunk as before,
    the others forwards of similar lengths, `Engine._forwards`); a request's prompt is kept once read, its prompt
    and output once it ends (`dflash_trt.runtime.prefix_cache`; same caveat on last bits as chunks).

    `Engine.generate` is `add` once, then `step` until nothing is live. One thread uses a batch at a
    time, and one batch an engine at a time (the drafter's context cache is swapped in per call).

    Args:
        engine: the Engine.
        mode: "dflash" or "ar".
        prefill_chunk: prompt positions prefilled per step (>= 1), or None: a whole prefill in `add`.
    Raises:
        InvalidRequestError: an unknown mode, a prefill_chunk < 1. DFlashError: mode "dflash" without a drafter.
    """

    def __init__(self, engine: Engine, mode: str = "dflash", prefill_chunk: int | None = None):
        if mode not in MODES:
            raise InvalidRequestError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "dflash" and engine.proposer is None:
            raise DFlashError("mode 'dflash' needs a drafter; load one or use mode 'ar'")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise InvalidRequestError(f"prefill_chunk must be a whole number of tokens >= 1 (or None: no chunking), "
                                      f"got {prefill_chunk!r}")
        self.engine, self.mode, self.prefill_chunk = engine, mode, prefill_chunk
        self.block = engine.proposer.block_size if mode == "dflash" else 1
        #: unfinished requests, and finished ones until the next step drops them: cache row j holds live[j]
        self.live: list[Request] = []
        self.cache = None
        self._drafter_cache = None
        self._prefilling: list[_Prefill] = []  # added, prompts not fully read yet (chunked prefill), in order
        self._added: list[Request] = []  # every request not yet returned by take_finished
        self._next_id = 0
        self._context = [0, 0, set(), 0.0]  # since the last step's stats: requests / prompt tokens prefilled, their ids,
        # and the seconds `add` spent prefilling (a whole prefill; chunks are read within `step`)
        # finished requests taken (`take_finished`) and not yet counted in a StepStats' completed_requests, less those
        # counted there and not taken yet (`_completed`)
        self._uncounted = 0

    @property
    def active(self) -> int:
        """Requests not finished yet (those still being prefilled too)."""
        return sum(1 for r in self.live if not r.finish_reason) + sum(len(g.reqs) for g in self._prefilling)

    def add(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
            on_tokens: Callable[[int, list[int]], str | None] | None = None) -> list[int]:
        """Add new requests to the batch: prefill them now (each has emitted its first token on return),
        or, with chunked prefill, queue them for the next steps to prefill.

        Args / errors as `Engine.generate` (prompts: n lists of token ids; params: one SamplingParams
        or one per prompt; on_tokens(k, new_ids) -> finish reason or None, where k is the prompt's
        index in THIS call, at every later step too). A request that fails to prefill (bad request,
        non-finite logits) raises here and leaves the batch as it was (with chunked prefill, a bad
        request raises here and a failing prefill in `step`, as `PrefillFailed`).
        Returns:
            the n request ids (unique in this batch, increasing: 0, 1, ... in the order added), as
            `take_finished` names them.
        """
        reqs = self.engine._requests(prompts, params)
        return self._add(reqs, on_tokens) if reqs else []

    def _add(self, reqs: list[Request], on_tokens) -> list[int]:
        eng, mode = self.engine, self.mode
        ids = list(range(self._next_id, self._next_id + len(reqs)))
        t0 = time.perf_counter()
        for k, (i, r) in enumerate(zip(ids, reqs)):
            r.index, r.call_index, r.on_tokens, r.t0 = i, k, on_tokens, t0
        for r in reqs:  # KV slots it can write: its prompt, its tokens (up to the context), one block past them
            r.max_slots = min(len(r.prompt) + r.params.max_tokens, eng.context_len) + self.block + 1
        hits = self._prefix_hits(reqs)
        capacity = max(self._initial_slots(r) for r in reqs)  # the caches grow as the outputs do (`_reserve`)
        cache = eng.target.new_cache(len(reqs), capacity)
        drafter_cache = None
        if mode == "dflash":
            eng.proposer.reset(len(reqs), capacity)  # a context cache for the new rows
            drafter_cache = eng.proposer.cache
            for r in reqs:  # one count per draft position, also for a request that ends before any verify step
                r.metrics.accepted_per_position = [0] * eng.proposer.max_draft_len
                r.metrics.drafted_per_position = [0] * eng.proposer.max_draft_len
            if eng.proposer.prompt_lookup:
                for r in reqs:
                    r.ngrams = NgramIndex(r.prompt)
        self._reuse_prefixes(reqs, hits, cache, drafter_cache)
        group = _Prefill(reqs, cache, drafter_cache)
        if self.prefill_chunk is None:
            self._advance(group)  # raises before anything changed here
            self._context[3] += time.perf_counter() - t0  # the next iteration's latency includes it
        else:
            self._prefilling.append(group)
        self._added.extend(reqs)
        self._next_id += len(reqs)
        return ids

    def _caches_prefixes(self, r: Request) -> bool:
        return (self.engine.prefix_cache is not None and r.params.prompt_logprobs is None
                and not r.params.return_context_logits and self.engine.feature_sink is None)

    def _prefix_hits(self, reqs: list[Request]) -> list[tuple[int, object]]:
        """Per request, (the length of the longest prefix of its prompt the prefix cache holds, that `PrefixEntry`),
        or (0, None): no prefix cache, no match, or a request that reuses none (`_caches_prefixes`); the length
        becomes its `metrics.cached_tokens`: where its prefill starts."""
        pc = self.engine.prefix_cache
        hits = [pc.match(r.prompt, self.mode == "dflash") if self._caches_prefixes(r) else (0, None) for r in reqs]
        for r, (n, _) in zip(reqs, hits):
            r.metrics.cached_tokens = n
        return hits

    def _reuse_prefixes(self, reqs: list[Request], hits: list[tuple[int, object]], cache, drafter_cache) -> None:
        """Write each request's cached prefix (`_prefix_hits`) to its new cache rows (the target's K/V and the
        drafter's context), and count the lookups."""
        pc = self.engine.prefix_cache
        for j, (r, (n, entry)) in enumerate(zip(reqs, hits)):
            if n:
                cache.import_row(j, entry.target_parts)
                if drafter_cache is not None:
                    drafter_cache.import_row(j, entry.drafter_parts)
            if self._caches_prefixes(r):
                pc.record(len(r.prompt), n)

    def _keep_prefix(self, r: Request, row: int, cache, drafter_cache) -> None:
        """With a prefix cache: store the K/V of what `r` (cache row `row`) has read, its prompt and output up to
        the position its target K/V and (DFlash) drafter context are written for."""
        eng = self.engine
        if not self._caches_prefixes(r):
            return
        tokens = (r.prompt + r.out)[: r.start]  # the target's K/V: positions [0, start)
        if drafter_cache is not None:  # the drafter's context is written up to where the row could draft
            tokens = tokens[: max(len(r.prompt), eng.proposer.max_position - self.block)]
        n = len(tokens)
        eng.prefix_cache.store(tokens, cache.read_row(row, n),  # views: the tree copies only what it lacks
                               None if drafter_cache is None else drafter_cache.read_row(row, n))

    def _advance(self, group: _Prefill) -> bool:
        """Prefill the next chunk of `group` (all of it without chunking); once its prompts are read,
        its rows join the batch. Returns whether they did."""
        eng = self.engine
        if self.mode == "dflash":
            eng.proposer.cache = group.drafter_cache
        begin = group.next
        with eng._phase("prefill"):
            group.next = eng._prefill(group.reqs, group.cache, self.mode, begin, self.prefill_chunk)
        lens = [len(r.prompt) - r.metrics.cached_tokens for r in group.reqs]  # what each had to read
        self._context[0] += sum(1 for n in lens if n > begin)
        self._context[1] += sum(min(n, group.next) - begin for n in lens if n > begin)
        self._context[2].update(r.index for r, n in zip(group.reqs, lens) if n > begin)
        if group.next >= max(lens):
            self._join(group.reqs, group.cache, group.drafter_cache)
            return True
        # chunked: requests whose prompts are read join now, without waiting for the longer ones of their group
        done = [j for j, n in enumerate(lens) if begin < n <= group.next]
        if done:
            eng._emit_first(group.reqs, done, group.cache)
            rest = [j for j in range(len(lens)) if j not in done]
            # each part keeps only the slots its own requests got up front (the batch's caches grow as they decode)
            cap_done = max(self._initial_slots(group.reqs[j]) for j in done)
            cap_rest = max(self._initial_slots(group.reqs[j]) for j in rest)
            part = group.cache.take_rows(done, cap_done)
            group.cache.keep_rows(rest, cap_rest)
            drafter_part = None
            if group.drafter_cache is not None:
                drafter_part = group.drafter_cache.take_rows(done, cap_done)
                group.drafter_cache.keep_rows(rest, cap_rest)
            self._join([group.reqs[j] for j in done], part, drafter_part)
            group.reqs = [group.reqs[j] for j in rest]
        return False

    def _join(self, reqs: list[Request], cache, drafter_cache) -> None:
        """Requests whose prompts are read (first token emitted) join the running batch with their cache rows."""
        for j, r in enumerate(reqs):  # its prompt, for requests arriving while it is decoded
            self._keep_prefix(r, j, cache, drafter_cache)
        ttft = time.perf_counter() - reqs[0].t0
        for r in reqs:
            r.metrics.time_to_first_token_s = ttft
            r.metrics.prompt_tokens = len(r.prompt)
            if r.finish_reason:
                r.metrics.total_time_s = ttft
        if self.cache is None:
            self.cache, self._drafter_cache = cache, drafter_cache
        else:
            self.cache.append_rows(cache)
            if drafter_cache is not None:
                self._drafter_cache.append_rows(drafter_cache)
        self.live.extend(reqs)

    def step(self) -> StepStats:
        """One iteration: with chunked prefill, the next chunk of the earliest requests still being
        prefilled (they join at once when their prompts are read), then one decode step of every
        unfinished request (none: no decode). Finished requests' cache rows are dropped first, and the
        slots only they needed (one copy of the buffers, not a gather per layer per step).

        Raises:
            PrefillFailed: the chunk failed; its requests were dropped, the batch is as before this call.
            DFlashError: non-finite target logits; whatever an `on_tokens` callback raises. The batch
            is then in an undefined state: drop it.
        """
        eng, mode = self.engine, self.mode
        t = time.perf_counter()
        if self._prefilling:
            group = self._prefilling[0]
            try:
                joined = self._advance(group)
            except Exception as exc:  # noqa: BLE001 - handed to the caller with the requests it concerns
                self._prefilling.pop(0)
                self._added = [r for r in self._added if all(r is not q for q in group.reqs)]
                raise PrefillFailed([r.index for r in group.reqs], exc) from exc
            if joined:
                self._prefilling.pop(0)
        if any(r.finish_reason for r in self.live):
            keep = [j for j, r in enumerate(self.live) if not r.finish_reason]
            # the slots only requests that left needed are freed: the others keep twice what they hold (`_room`)
            capacity = max((self._room(self.live[j]) for j in keep), default=0)
            self.cache.keep_rows(keep, capacity)
            if self._drafter_cache is not None:
                self._drafter_cache.keep_rows(keep, capacity)
            self.live = [self.live[j] for j in keep]
        context, self._context = self._context, [0, 0, set(), 0.0]
        # in this iteration: decoded, read (ending at their first token too), or waiting for their next chunk
        active = len({r.index for r in self.live} | context[2] | {r.index for g in self._prefilling for r in g.reqs})
        if not self.live:
            return StepStats(seconds=time.perf_counter() - t + context[3], context_requests=context[0],
                             context_tokens=context[1], scheduled_requests=context[0], active_requests=active,
                             completed_requests=self._completed())
        before = [(r.metrics.drafted_tokens, r.metrics.accepted_tokens, len(r.out)) for r in self.live]
        self._reserve()
        if mode == "dflash":
            eng.proposer.cache = self._drafter_cache
        eng._step(self.live, self.cache, mode, self.block)
        if eng.phase_timer is not None:
            eng.phase_timer.steps += 1
        if eng.prefix_cache is not None:
            for j, r in enumerate(self.live):  # what a request that ended read: for the next turn of its conversation
                if r.finish_reason:
                    self._keep_prefix(r, j, self.cache, self._drafter_cache)
        now = time.perf_counter()
        for r in self.live:
            if r.finish_reason:
                r.metrics.total_time_s = now - r.t0
        return StepStats(len(self.live),
                         sum(1 for r, b in zip(self.live, before) if r.metrics.drafted_tokens > b[0]),
                         sum(r.metrics.drafted_tokens - b[0] for r, b in zip(self.live, before)),
                         sum(r.metrics.accepted_tokens - b[1] for r, b in zip(self.live, before)),
                         sum(len(r.out) - b[2] for r, b in zip(self.live, before)), now - t + context[3], context[0],
                         context[1],
                         context[0] + sum(1 for r in self.live if r.index not in context[2]),
                         active, self._completed())

    def _initial_slots(self, r: Request) -> int:
        """The KV slots a request's cache rows get when it is added: its prompt, INITIAL_OUTPUT_SLOTS tokens (fewer
        when its max_tokens or the context leave fewer), a block and one; `_reserve` adds more as it decodes."""
        return min(r.max_slots, len(r.prompt) + INITIAL_OUTPUT_SLOTS + self.block + 1)

    def _room(self, r: Request) -> int:
        """The slots a running request keeps when the batch's caches shrink (requests left): twice what its next
        decode step can write up to (its committed length and a block), at least what it got up front, at most
        `max_slots` (so the row does not have to grow again at once)."""
        return min(r.max_slots, max(self._initial_slots(r), 2 * (r.start + self.block)))

    def _reserve(self) -> None:
        """Before a decode step: grow the target's and the drafter's caches when a row's step could write past
        their capacity (a verify pass writes slots start .. start + block - 1 of row r, a draft tree's nodes
        included; the drafter's KV injection the same), to twice the capacity (at least what the step needs, at
        most the largest `max_slots` of the rows: no row can use more). Amortized: each growth at least doubles
        the slots, so growing to L slots copies fewer than L slots in all. A function of the rows' lengths and max_tokens only, so every
        rank of a tensor-parallel target decides the same."""
        need = max(r.start + self.block for r in self.live)
        if need <= self.cache.capacity:
            return
        capacity = max(need, min(2 * self.cache.capacity, max(r.max_slots for r in self.live)))
        self.cache.reserve(capacity)
        if self._drafter_cache is not None:
            self._drafter_cache.reserve(capacity)

    def _completed(self) -> int:
        """The requests finished since the last StepStats (taken already or not); from now on they count as
        counted."""
        waiting = sum(1 for r in self._added if r.finish_reason)  # counted now, taken later
        done, self._uncounted = self._uncounted + waiting, -waiting
        return done

    def flush_stats(self) -> StepStats | None:
        """The prefill work done since the last `step` (requests and prompt tokens read by `add`) and the requests
        finished since (at their first token, or aborted while waiting for their prompts), as a StepStats without a
        decode step, or None when there was neither; it then counts as reported. For a batch
        dropped without another step (its requests all ended at their first token), so its prompts still
        appear in the iteration stats."""
        context, self._context = self._context, [0, 0, set(), 0.0]
        completed = self._completed()
        if not context[0] and not completed:
            return None
        return StepStats(seconds=context[3], context_requests=context[0], context_tokens=context[1],
                         scheduled_requests=context[0], active_requests=context[0], completed_requests=completed)

    def abort_prefill(self, request_ids) -> int:
        """End the requests among `request_ids` whose prompts are still waiting to be read (chunked prefill)
        now, with finish_reason "abort" and no tokens: their rows leave their add call's prefill (a call left
        with none leaves the queue unread). Their metrics count the prompt tokens read so far. Other ids are
        ignored. Returns how many requests ended; `take_finished` has them."""
        ids = set(request_ids)
        keep, ended = [], 0
        for group in self._prefilling:
            rows = [j for j, r in enumerate(group.reqs) if r.index not in ids]
            for r in group.reqs:
                if r.index in ids:
                    r.finish_reason = "abort"
                    r.metrics.prompt_tokens = min(len(r.prompt), r.metrics.cached_tokens + group.next)
                    ended += 1
            if rows:
                if len(rows) < len(group.reqs):
                    group.cache.keep_rows(rows)
                    if group.drafter_cache is not None:
                        group.drafter_cache.keep_rows(rows)
                    group.reqs = [group.reqs[j] for j in rows]
                keep.append(group)
        self._prefilling = keep
        return ended

    def take_finished(self) -> list[tuple[int, GenerationResult]]:
        """(request id, GenerationResult) of the requests finished since the last call, in the order added."""
        done, self._added = ([r for r in self._added if r.finish_reason],
                             [r for r in self._added if not r.finish_reason])
        self._uncounted += len(done)
        out = []
        for r in done:
            r.metrics.completion_tokens = len(r.out)
            # with stop strings, the text cut before the one that ended it (OpenAI's); else the caller decodes
            text = None if r.stop_text is None else r.stop_text.text
            out.append((r.index, GenerationResult(r.out, r.finish_reason, r.metrics, text=text, logprobs=r.logprobs,
                                                  prompt_logprobs=r.prompt_logprobs, stop_reason=r.stop_reason,
                                                  context_logits=_joined(r.context_logits),
                                                  generation_logits=_joined(r.generation_logits))))
        return out


def _joined(parts: list | None):
    """A request's logits pieces ([t, V] tensors, in order) as one [T, V] tensor; None where it asked for none."""
    if parts is None:
        return None
    import torch

    return (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else torch.zeros(0, 0)
