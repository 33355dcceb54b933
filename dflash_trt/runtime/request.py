"""A request's state while it decodes: its output, metrics and stop checks, and its logits processing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from dflash_trt.errors import InvalidRequestError
from dflash_trt.runtime.logprobs import TokenLogprob
from dflash_trt.runtime.penalties import LogitsPenalties
from dflash_trt.runtime.prompt_lookup import NgramIndex
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.stats import RequestMetrics
from dflash_trt.runtime.stop_text import StopText
from dflash_trt.text import short_repr


@dataclass
class Request:
    """One request of a decode batch: its prompt, sampling params and output so far, its logits processing
    (`scores`, `draft_scores`) and its stop checks (`emit`). Made by `Engine._make_request`; the engine
    (`dflash_trt.runtime.engine`) and `DecodeBatch` (`dflash_trt.runtime.decode_batch`) update it."""

    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    context_len: int
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    start: int = 0  # absolute position of `out[-1]` = committed target KV length
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    index: int = 0  # request id in its DecodeBatch (= prompt index for Engine.generate)
    call_index: int = 0  # its prompt's index in the add() call that brought it (on_tokens' first argument)
    on_tokens: Callable[[int, list[int]], str | None] | None = None
    ngrams: NgramIndex | None = None  # prompt + out so far, for prompt-lookup drafts (dflash only)
    t0: float = 0.0  # time.perf_counter() when its prefill began
    first_logits: torch.Tensor | None = None  # [vocab] float32, between its prompt's last chunk and its first token
    # KV cache slots it can write at most: prompt + max_tokens (up to the context) + a block + 1; its rows get fewer
    # up front and grow as it decodes (DecodeBatch)
    max_slots: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token of `out` when params.logprobs is set
    # params.prompt_logprobs set: one per prompt token read so far (None for the first)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    penalties: LogitsPenalties | None = None  # params.processes_logits: its logit bias, penalties, min_tokens
    stop_text: StopText | None = None  # params.stop: its text so far, checked for the stop strings
    stop_reason: int | str | None = None  # the stop token of params.stop_token_ids or the stop string that ended it
    # the stop tokens a stop_reason names: params.stop_token_ids, less the target's EOS ids unless ignore_eos (an EOS
    # ends an output with stop_reason None however it was asked for, as in vLLM and serve)
    named_stops: frozenset[int] = frozenset()
    # params.return_context_logits: [t, V] float32 CPU tensors of the prompt positions read so far, in order
    context_logits: list[torch.Tensor] | None = None
    # params.return_generation_logits: [t, V] float32 CPU tensors, one row per token of `out`, in order
    generation_logits: list[torch.Tensor] | None = None

    def scores(self, logits: torch.Tensor, prefixes: list[list[int]]) -> torch.Tensor:
        """What the request decides from: `logits` [m, V] after its logits processing (`penalties`, with each
        row's `prefixes`: the drafts before it in the block), or `logits` as they are without any."""
        if self.penalties is None:
            return logits
        scores = self.penalties.apply(logits, self.out, prefixes)
        # bad words can ban every token left (with a grammar, min_tokens, a logit bias): the first row always
        # chooses a token, so nothing allowed there is the request's dead end (argmax would emit a banned token 0)
        if self.params.bad_words and bool(torch.isneginf(scores[0]).all()):
            raise InvalidRequestError(f"bad_words ban every token this request may choose after {len(self.out)} "
                                      "output tokens (with its grammar, min_tokens or logit bias); drop some bad words")
        return scores

    def draft_scores(self, logits: torch.Tensor, prefixes: list[list[int]]) -> torch.Tensor:
        """`scores` without the penalties: what its drafts follow (`LogitsPenalties.for_drafts`)."""
        return self.penalties.apply(logits, self.out, prefixes, penalize=False)

    def emit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None,
             logits: torch.Tensor | None = None) -> int:
        """Append tokens in order (with their `logprobs` when the request asked for them, and their raw logits
        [len(tokens), V], the rows they were chosen from, when it asked for generation logits), applying every
        stop check to each (stop tokens, stop token sequences, max_tokens, the context's end, then the stop
        strings); hand the tokens taken to `on_tokens` (with what the request asked for: `Engine.generate`);
        return how many were taken."""
        taken = len(tokens)
        for n, tok in enumerate(tokens, 1):
            self.out.append(tok)
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                if tok in self.named_stops:  # a token asked for; the target's EOS ids: None
                    self.stop_reason = tok
            elif self.params.stop_token_sequences and self._ends_stop_sequence():
                self.finish_reason = "stop"  # TensorRT-LLM's stop words: the sequence's tokens stay in the output
            elif len(self.out) >= self.params.max_tokens or len(self.prompt) + len(self.out) >= self.context_len:
                self.finish_reason = "length"  # max_tokens, or the target's context is full (OpenAI's one value)
            if self.finish_reason:
                taken = n
                break
        if self.stop_text is not None and self.stop_text.add(tokens[:taken]) == "stop":
            # a stop string: the output ends with the token that completed it (several may have come at once)
            extra = len(self.out) - self.stop_text.used
            if extra:
                del self.out[-extra:]
                taken -= extra
            self.finish_reason, self.stop_reason = "stop", self.stop_text.matched
        if self.logprobs is not None:
            self.logprobs.extend(logprobs[:taken])
        rows = None
        if self.generation_logits is not None:
            rows = logits[:taken].float().cpu()
            self.generation_logits.append(rows)
        if self.on_tokens is not None:
            first = len(self.out) == taken
            args: tuple = (self.call_index, tokens[:taken])
            if self.prompt_logprobs is not None and first:  # its first call: the prompt's too
                args += (None if self.logprobs is None else logprobs[:taken], self.prompt_logprobs)
            elif self.logprobs is not None:
                args += (logprobs[:taken],)
            extra = {}  # the logits asked for (`Engine.generate`'s on_tokens), as keywords
            if rows is not None:
                extra["logits"] = rows
            if self.context_logits is not None and first:  # the whole prompt is read by its first token
                if len(self.context_logits) > 1:  # joined once: the result takes this tensor as it is
                    self.context_logits[:] = [torch.cat(self.context_logits)]
                extra["context_logits"] = self.context_logits[0] if self.context_logits else torch.zeros(0, 0)
            reason = self.on_tokens(*args, **extra)
            if reason is not None and not isinstance(reason, str):  # True / 1 became the finish_reason
                raise InvalidRequestError(f"on_tokens returned {short_repr(reason)} ({type(reason).__name__}): return "
                                          "None to go on, or a finish reason string (e.g. 'stop') to end the request")
            if reason and not self.finish_reason:  # the caller ends the request (a stop string, a client gone)
                self.finish_reason = reason
        return taken

    def _ends_stop_sequence(self) -> bool:
        """Whether the prompt and the output so far end with one of `params.stop_token_sequences` (TensorRT-LLM's
        stop criterion reads the whole sequence: a stop sequence may begin in the prompt)."""
        k = len(self.out)
        for seq in self.params.stop_token_sequences:
            n = len(seq)
            if n <= k:
                if tuple(self.out[k - n:]) == seq:
                    return True
            elif n - k <= len(self.prompt) and tuple(self.prompt[len(self.prompt) - (n - k):]) + tuple(self.out) == seq:
                return True
        return False


#: on_tokens' positional arguments, in the order `Request.emit` passes them
ON_TOKENS_ARGS = ("prompt_index", "token_ids", "logprobs", "prompt_logprobs")


def on_tokens_arg_counts(params: SamplingParams) -> dict[int, str]:
    """How many positional arguments `Request.emit` calls a request's on_tokens with, each with the reason: 2
    (prompt_index, token_ids); 3 with `params.logprobs` (their `TokenLogprob`s); 4 on the first call with
    `params.prompt_logprobs` (the prompt's; the third None without logprobs)."""
    counts = {3: "for a request with SamplingParams.logprobs"} if params.logprobs is not None else {2: ""}
    if params.prompt_logprobs is not None:
        counts[4] = "on its first call, for a request with SamplingParams.prompt_logprobs"
    return counts


def check_callbacks(on_tokens, on_finished, params) -> None:
    """`check_arity` of `Engine.generate`'s callbacks (those that are callable; None and others are left to the
    caller), for requests of `params` (SamplingParams; other items are skipped: `Engine.generate` refuses them).

    Raises:
        InvalidRequestError: as `check_arity`.
    """
    if callable(on_tokens):
        counts: dict[int, str] = {}
        keywords: set[str] = set()  # the logits asked for come as keywords (`Request.emit`)
        for p in params:
            if isinstance(p, SamplingParams):
                counts.update(on_tokens_arg_counts(p))
                keywords.update(["logits"] if p.return_generation_logits else [])
                keywords.update(["context_logits"] if p.return_context_logits else [])
        check_arity("on_tokens", on_tokens, counts or {2: ""}, ON_TOKENS_ARGS, tuple(sorted(keywords)))
    if callable(on_finished):
        check_arity("on_finished", on_finished, {2: ""}, ("prompt_index", "result"))


def check_arity(name: str, fn, counts: dict[int, str], params: tuple[str, ...], keywords: tuple[str, ...] = ()) -> None:
    """Refuse a callback `fn` (named `name`) that cannot be called with each number of positional arguments in
    `counts` (count -> when it is called so, e.g. "for a request with ...", "" for always), each with the keyword
    arguments `keywords` too (on_tokens' `logits` / `context_logits`), before any work: a callback of the wrong
    arity otherwise fails mid-generation with a bare TypeError. `params` names the positional arguments in order.
    A callable whose signature Python cannot read (some builtins) is not checked.

    Raises:
        InvalidRequestError: naming the signature it has, the call it gets and a signature that takes them all.
    """
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return

    def fits(n: int) -> bool:
        try:
            sig.bind(*range(n), **dict.fromkeys(keywords))
            return True
        except TypeError:
            return False

    if all(fits(n) for n in counts):
        return
    given = "".join(f", {k}=..." for k in keywords)
    calls = " and ".join(f"{name}({', '.join(params[:n])}{given})" + (f" {when}" if when else "")
                         for n, when in sorted(counts.items()))
    fix = ", ".join(params[:2]) + (", *rest" if len(counts) > 1 or max(counts) > 2 else "") + (
        ", **logits" if keywords else "")
    raise InvalidRequestError(f"{name} takes {sig} but is called as {calls}; define it to take "
                              f"{' and '.join(map(str, sorted(counts)))} positional arguments, e.g. def {name}({fix})")
