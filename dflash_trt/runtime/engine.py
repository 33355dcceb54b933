"""The decode loop: prefill, then draft -> verify -> commit until every request stops.

DFlash (DFlash paper, arXiv 2602.06036, sec. 3): per step, the proposer drafts max_draft_len
(default block_size - 1) tokens for every active request in ONE drafter pass, the target verifies
them with the last verified token in ONE forward pass, the verifier keeps the longest accepted prefix plus one target token, the target KV
cache rolls back to the accepted length (a pointer move) and the target features of the kept
tokens become new drafter context. With a dynamic draft length (`DFlashProposer.draft_confidence`)
each row verifies only its confident leading drafts and the pass is as long as the longest of
them. Autoregressive mode ("ar") is the same loop with no drafter
and blocks of one token: the baseline every speedup is measured against.

Requests of different lengths decode together with ragged acceptance; each request has its own
RNG, so its output does not depend on what else is in the batch. `Engine.generate` is one batch
(`DecodeBatch`, `dflash_trt.runtime.decode_batch`) run to its end.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Callable

import torch

from dflash_trt.errors import ConfigError, DFlashError, InvalidRequestError, PromptTooLongError
from dflash_trt.models.target import TargetModel
from dflash_trt.runtime.decode_batch import DecodeBatch
from dflash_trt.runtime.draft_tree import chain_parents, greedy_tree_accept, node_depths, tree_attention_mask
from dflash_trt.runtime.logprobs import StepLogits, token_logprobs
from dflash_trt.runtime.guided import Grammars, GuidedLogits
from dflash_trt.runtime.penalties import LogitsPenalties, chain_prefixes, tree_prefixes
from dflash_trt.runtime.prefix_cache import PrefixCache, common_prefix_length
from dflash_trt.runtime.profile import PhaseTimer
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.request import Request, check_callbacks
from dflash_trt.runtime.sampling import SamplingParams, generator_seed, greedy_tokens, probs_from_logits, sample
from dflash_trt.runtime.stats import GenerationResult
from dflash_trt.runtime.stop_text import StopText
from dflash_trt.runtime.verifier import ChunkedProbs, lazy_greedy_accept, speculative_sample
from dflash_trt.text import short_repr

#: Lazy greedy verification (`lazy_greedy_accept`): a request whose draft position `lazy_logits`
#: was accepted in more than this fraction of its verify steps so far computes all of its block's
#: logits in one product instead. Cost model on the dev CPU (49152-row head): 3 positions cost
#: ~14 ms, the other 13 ~23 ms, all 16 at once ~24 ms, so the split only pays while the rest is
#: needed in under ~40% of the steps (a weak drafter; a strong one goes straight to all 16).
LAZY_MAX_ACCEPT_RATE = 0.4

#: prompt positions whose logits one lm_head product computes for prompt logprobs (256 x 49152 float32
#: logits: 50 MB)
PROMPT_LOGITS_ROWS = 256


def _token_id_lists(prompts) -> list[list[int]]:
    """`prompts` as lists of Python ints, or InvalidRequestError saying what a prompt is: text (a string, or
    a list of strings) and a single flat list of ids are the usual mistakes. A prompt may be any sequence
    of ints (numpy's too) or a 1-D numpy array / torch tensor of them."""
    how = ("prompts are lists of token ids (ints), one list per prompt; tokenize text first with "
           "Pipeline.encode(text) or Pipeline.encode_chat(message) (Pipeline.generate also takes text)")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        ndim = getattr(prompts, "ndim", None)  # numpy array, torch tensor: one prompt, or a batch of equal lengths
        hint = {1: " (a single prompt? wrap it: [ids])", 2: " (one prompt per row? give list(prompts))"}.get(ndim, "")
        raise InvalidRequestError(f"{how}; got {type(prompts).__name__} {short_repr(prompts)}{hint}")
    out = []
    for i, prompt in enumerate(prompts):
        if getattr(prompt, "ndim", None) == 1 and hasattr(prompt, "tolist"):  # numpy array, torch tensor
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            one = " (a single prompt? wrap its ids: [ids])" if isinstance(prompt, numbers.Integral) else ""
            raise InvalidRequestError(f"{how}; prompt {i} is {type(prompt).__name__} {short_repr(prompt)}{one}")
        bad = next((t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
        if bad is not None:
            raise InvalidRequestError(f"{how}; prompt {i} holds {type(bad).__name__} {short_repr(bad)}")
        out.append([int(t) for t in prompt])
    return out


#: padding tokens a prefill row with a cached prefix may get to share a forward with longer ones (`Engine._forwards`):
#: a few tokens cost less than another forward's fixed cost (its weights read again)
PAD_TOKENS = 16


def _grouped(pairs) -> list[tuple]:
    """[(key, [values...])] of (key, value) pairs, keys in the order first seen."""
    out: dict = {}
    for key, value in pairs:
        out.setdefault(key, []).append(value)
    return list(out.items())


class Engine:
    """Batched speculative (DFlash) and autoregressive generation over one target.

    Args:
        target: the target model (eval mode).
        proposer: a DFlashProposer, or None (then only mode "ar" works).
        eos_token_ids: default stop tokens for requests whose params give none.
        lazy_logits: greedy verification computes the target's logits at the first `lazy_logits`
            block positions, and the others only for requests whose drafts all matched so far
            (`lazy_greedy_accept`; same tokens, less lm_head work). 0 computes every position.
    """

    def __init__(self, target: TargetModel, proposer: DFlashProposer | None = None,
                 eos_token_ids: tuple[int, ...] = (), lazy_logits: int = 3):
        self.target = target
        self.proposer = proposer
        self.eos_token_ids = tuple(eos_token_ids) or target.config.eos_token_id
        self.lazy_logits = lazy_logits
        #: Optional cap on a request's prompt + output tokens below the target's max_position_embeddings
        #: (TensorRT-LLM's max_seq_len; `context_len`). None: the target's whole context.
        self.max_seq_len: int | None = None
        #: Optional recorder of target features in mode "ar" (drafter training data, see
        #: `dflash_trt.training.datagen`): an object with `layer_ids` (tuple of target layer ids)
        #: and `record(request_indices: list[int], features [n, t, len(ids) * hidden], positions
        #: [n, t] int64, lengths: list[int])`, called after every target forward with the features
        #: of the tokens that forward consumed (row j's first lengths[j] entries are real tokens).
        self.feature_sink = None
        #: Optional `PhaseTimer`: when set, every generate() adds its time per phase (draft, target
        #: forward, acceptance, KV injection, ...) to it (`dflash-trt bench --profile`). None measures nothing.
        self.phase_timer: PhaseTimer | None = None
        #: `dflash_trt.runtime.guided.Grammars` of the target's tokenizer (set by `dflash_trt.api`): what
        #: compiles a request's guided decoding. None refuses such requests.
        self.grammars: Grammars | None = None
        #: token ids -> text (the target tokenizer's decode, special tokens skipped; set by `dflash_trt.api`):
        #: what checks a request's stop strings (`SamplingParams.stop`). None refuses such requests.
        self.detokenize: Callable[[list[int]], str] | None = None
        #: Optional `dflash_trt.runtime.prefix_cache.PrefixCache`: when set, the K/V of every sequence a
        #: `DecodeBatch` reads is kept (its prompt once read, prompt and output once it ends) and a new prompt
        #: starting with a kept sequence is prefilled from there (automatic prefix caching; not for requests
        #: asking for prompt_logprobs, nor while `feature_sink` records). None keeps nothing.
        self.prefix_cache: PrefixCache | None = None
        #: `generate` runs one call at a time (the drafter's context cache and the proposer's state are shared);
        #: the thread running one, so that a call from its own on_tokens is refused instead of waiting forever
        self._generate_lock = threading.Lock()
        self._generating: int | None = None

    def _phase(self, name: str):
        return self.phase_timer.phase(name) if self.phase_timer is not None else nullcontext()

    @property
    def device(self) -> torch.device:
        """Where the target's weights live; every tensor of the loop is made there."""
        return self.target.embed_weight.device

    @property
    def context_len(self) -> int:
        """A request's prompt + output tokens at most: the target's max_position_embeddings, or `max_seq_len` when
        that is set and smaller."""
        own = self.target.config.max_position_embeddings
        return own if self.max_seq_len is None else min(own, self.max_seq_len)

    def _make_request(self, prompt: list[int], params: SamplingParams, index: int = 0) -> Request:
        vocab = self.target.config.vocab_size
        if not prompt:
            raise InvalidRequestError(f"empty prompt (prompt {index}): give at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab:
            pos, bad = next((j, t) for j, t in enumerate(prompt) if not 0 <= t < vocab)
            raise InvalidRequestError(f"prompt {index} holds token id {bad} (at position {pos}), outside the target's "
                                      f"vocabulary [0, {vocab}); give token ids of the target's tokenizer "
                                      "(Pipeline.encode / encode_chat make them)")
        if len(prompt) + 1 > self.context_len:
            raise PromptTooLongError(
                f"prompt of {len(prompt)} tokens leaves no room in the target's context of {self.context_len} "
                f"tokens; shorten it to at most {self.context_len - 1} tokens"
            )
        stop = params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids
        beyond = [t for t in params.stop_token_ids or () if t >= vocab]
        if beyond:  # the target never emits them: such a stop could never fire
            raise InvalidRequestError(f"stop_token_ids holds {beyond[0]}, outside the vocabulary [0, {vocab})")
        beyond = [t for t, _ in params.logit_bias or () if t >= vocab]
        if beyond:
            raise InvalidRequestError(f"logit_bias names token {beyond[0]}, outside the vocabulary [0, {vocab})")
        for name in ("bad_words", "stop_token_sequences"):
            beyond = [t for word in getattr(params, name) or () for t in word if t >= vocab]
            if beyond:
                raise InvalidRequestError(f"{name} holds token {beyond[0]}, outside the vocabulary [0, {vocab})")
        gen = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
            gen = torch.Generator(device=self.device).manual_seed(generator_seed(seed, self.device))
        ignored = params.ignore_eos and params.stop_token_ids is None  # ignore_eos drops the EOS ids, not given ones
        stop_ids = frozenset() if ignored else frozenset(stop)
        if params.min_tokens and len(stop_ids) >= vocab:  # every token held back: nothing left to choose
            raise InvalidRequestError(f"min_tokens {params.min_tokens} holds back the stop tokens, and every token of the "
                                      f"vocabulary [0, {vocab}) is one; stop on fewer tokens or drop min_tokens")
        guided = None
        if params.guided is not None:
            if self.grammars is None:
                raise ConfigError("guided decoding needs the target's tokenizer: this Engine has no `grammars` "
                                  "(load it with dflash_trt.api.load_pipeline / load_bundle, which set it)")
            if not stop_ids:
                raise InvalidRequestError("guided decoding needs a stop token to end the output once the grammar is "
                                          "complete; give stop_token_ids")
            guided = GuidedLogits(self.grammars.compile(params.guided), stop_ids, vocab)
        stop_text = None
        if params.stop:
            if self.detokenize is None:
                raise ConfigError("stop strings need the target's tokenizer: this Engine has no `detokenize` (load "
                                  "it with dflash_trt.api.load_pipeline / load_bundle, which set it), or give "
                                  "stop_token_ids")
            stop_text = StopText(self.detokenize, params.stop, min_tokens=params.min_tokens)
        penalties = LogitsPenalties(params, prompt, stop_ids, guided) if params.processes_logits else None
        return Request(list(prompt), params, stop_ids, self.context_len, gen,
                        logprobs=None if params.logprobs is None else [],
                        prompt_logprobs=None if params.prompt_logprobs is None else [None], penalties=penalties,
                        stop_text=stop_text, named_stops=frozenset(params.stop_token_ids or ()).difference(
                            () if params.ignore_eos else self.eos_token_ids),
                        context_logits=[] if params.return_context_logits else None,
                        generation_logits=[] if params.return_generation_logits else None)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 mode: str = "dflash", on_tokens: Callable[[int, list[int]], str | None] | None = None,
                 on_finished: Callable[[int, GenerationResult], None] | None = None) -> list[GenerationResult]:
        """Generate completions for a batch of tokenized prompts.

        Args:
            prompts: n lists of token ids (any lengths; ints, numpy's too), e.g. from `Pipeline.encode` /
                `Pipeline.encode_chat`; text is refused (InvalidRequestError naming those).
            params: one SamplingParams for all, or one per prompt.
            mode: "dflash" (speculative) or "ar" (autoregressive baseline).
            on_tokens: called as on_tokens(prompt_index, new_token_ids) whenever tokens are emitted
                (for streaming); stop checks have already been applied to them. For a request whose
                params ask for logprobs it gets a third argument, their `TokenLogprob`s; for one whose params
                ask for prompt_logprobs, its first call gets a fourth, the prompt's (one per prompt token,
                None first), and the third is None if it asks for no logprobs. For one whose params ask for
                generation logits it gets the keyword `logits`, the tokens' rows ([len(new_token_ids), V] float32,
                CPU; as the result's `generation_logits`), and for one asking for context logits, its first call
                gets the keyword `context_logits`, the prompt's ([prompt tokens, V], the result's tensor), so a
                stream can send them with its tokens (TensorRT-LLM's streamed results carry them). A non-empty string
                returned ends that request after these tokens with it as finish_reason (e.g. "stop"
                for a stop string the caller found in the text, "abort" for a client gone); the
                other requests of the batch go on.
            on_finished: called as on_finished(prompt_index, result) as each request ends (after the decode
                step that ended it, in the order the requests end; those ending together in prompt order), with
                the GenerationResult this call returns for it: a caller can use an answer (write it out) while
                the rest of the batch decodes.
        Returns:
            n GenerationResults in prompt order (completion token ids, finish_reason, stop_reason, metrics, the
            tokens' `logprobs` / the prompt's `prompt_logprobs` for requests whose params ask for them, and the
            text, cut before the stop string, for requests with `SamplingParams.stop`: `detokenize` needed). A
            request may get fewer than max_tokens tokens: at most context_len - len(prompt) fit in
            the target's context, and a request cut there has finish_reason "length" with fewer tokens.

        Calls from several threads on one engine (or Pipeline) run one at a time: a call waits for the one
        running (they share the drafter's context cache), and each returns what it would alone.

        Raises:
            InvalidRequestError, PromptTooLongError: bad request (an empty prompt, a token id outside the
                vocabulary: names the prompt), or an on_tokens / on_finished that is not callable or cannot take
                the arguments it would be called with (its `inspect.signature`: e.g. on_tokens(i, ids) for a
                request with logprobs, which gets three; named, with a signature that fits) (nothing is generated);
                an on_tokens that returns neither None nor a str (raised at that call).
            ConfigError: stop strings without `detokenize`, guided decoding without `grammars` (an Engine built
                by hand: `dflash_trt.api.load_pipeline` sets both).
            DFlashError: mode "dflash" without a drafter; non-finite target logits; a call from the on_tokens
                or on_finished of a call running on this engine.
            Whatever on_tokens or on_finished raise (the call then ends there).
        """
        for name, fn, args in (("on_tokens", on_tokens, "prompt_index, token_ids, ..."),
                               ("on_finished", on_finished, "prompt_index, result")):
            if fn is not None and not callable(fn):  # before any work, not a TypeError after the prefill
                raise InvalidRequestError(f"{name} must be a function ({args}) or None, got {short_repr(fn)} "
                                          f"({type(fn).__name__})")
        batch = DecodeBatch(self, mode)
        reqs = self._requests(prompts, params)
        if not reqs:
            return []
        check_callbacks(on_tokens, on_finished, (r.params for r in reqs))  # not a TypeError mid-generation
        if self._generating == threading.get_ident():
            raise DFlashError("generate was called from its own callback (on_tokens or on_finished), on the engine "
                              "it is running; collect what that call needs and call generate after it returns")
        with self._generate_lock:
            self._generating = threading.get_ident()
            try:
                with self.phase_timer.call() if self.phase_timer is not None else nullcontext():
                    ids = batch._add(reqs, on_tokens)
                    done: dict[int, GenerationResult] = {}
                    while True:  # requests may end at their first token (in the prefill), then at any step
                        for i, res in batch.take_finished():
                            done[i] = res
                            if on_finished is not None:
                                on_finished(i, res)
                        if not batch.active:
                            break
                        batch.step()
            finally:
                self._generating = None
        return [done[i] for i in ids]

    def _requests(self, prompts, params) -> list[Request]:
        """Validated `Request`s of `generate`'s prompts and params (nothing is run)."""
        prompts = _token_id_lists(prompts)
        params = SamplingParams() if params is None else params  # [] is 0 params, not the default
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        for sp in plist:
            if not isinstance(sp, SamplingParams):
                raise InvalidRequestError(f"params must be a SamplingParams or a list of them (one per prompt), got "
                                          f"{type(sp).__name__}; e.g. SamplingParams(max_tokens=64)")
        return [self._make_request(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, plist))]

    def _feature_ids(self, mode: str) -> tuple[int, ...]:
        if mode == "dflash":
            return self.proposer.feature_layer_ids
        return tuple(self.feature_sink.layer_ids) if self.feature_sink is not None else ()

    def _prefill(self, reqs: list[Request], cache, mode: str, begin: int = 0, chunk: int | None = None) -> int:
        """Prefill the next prompt positions of `reqs` (cache row j holds reqs[j]) over the rows that have some
        left (one row per distinct prompt: rows repeating one get copies). Row j reads its prompt from position
        c_j + begin on, `chunk` positions (None: all it has left), where c_j is its `metrics.cached_tokens`: the
        prefix whose K/V its row already holds (prefix caching; 0 without). `begin` is thus an offset into the
        part of each prompt left to read. The rows without a cached prefix are read in one target forward (as
        without prefix caching: padded to the longest); the others in forwards of rows reading similar lengths
        (`_forwards`). Chunked prefill calls it once per chunk, in order; the whole prefill is one call.

        Returns:
            the offset the next chunk starts at. Once it reaches the longest part left to read, every request
            has chosen and emitted its first token (all chosen before any is emitted).
        Raises:
            DFlashError: non-finite target logits; whatever sampling or an `on_tokens` callback raises.
        """
        skip = [r.metrics.cached_tokens for r in reqs]
        lens = [len(r.prompt) - c for r, c in zip(reqs, skip)]  # what is left to read of each prompt
        longest = max(lens)
        end = longest if chunk is None else min(longest, begin + chunk)
        act = [j for j, n in enumerate(lens) if n > begin]  # rows with prompt tokens in this chunk
        # identical prompts (a request's n choices) are read once: the first row holding each one runs the
        # forward, the others get copies of its K/V, drafter context and logits (and prompt logprobs: rows
        # that ask for a different number of them are read apart). They reuse the same cached prefix.
        first: dict[tuple, int] = {}
        source = {j: first.setdefault((tuple(reqs[j].prompt), reqs[j].params.prompt_logprobs,
                                       reqs[j].params.return_context_logits), j) for j in act}
        copies = [j for j in act if source[j] != j]
        act = [j for j in act if source[j] == j]
        reads = {j: min(lens[j], end) - begin for j in act}  # prompt tokens each row reads in this chunk
        shares = self._shared_in_call(reqs, act, skip) if chunk is None else {}
        for part in self._forwards([j for j in act if j not in shares], skip, reads):
            self._prefill_forward(reqs, part, cache, mode, skip, begin, reads,
                                  {j: source[j] for j in copies if source[j] in part})
        if shares:  # rows sharing a prefix with one read above: its K/V and drafter context copied, the rest read
            for (c, s), pairs in _grouped(((skip[j], s), (lead, j)) for j, (lead, s) in shares.items()):
                src, dst = [a for a, _ in pairs], [b for _, b in pairs]
                cache.copy_slots(src, dst, c, s)
                if mode == "dflash":
                    self.proposer.cache.copy_slots(src, dst, c, s)
            for j, (_, s) in shares.items():
                for k in [j] + [k for k in copies if source[k] == j]:  # its repeats (copies of its row) reuse it too
                    self.prefix_cache.record(0, s - skip[k])  # reused, not read (its lookup was counted)
                    reqs[k].metrics.cached_tokens = s  # (a repeat's skip stays: its copy starts where its hit ends)
                skip[j] = s
                reads[j] = len(reqs[j].prompt) - s
            for part in self._forwards(list(shares), skip, reads):
                self._prefill_forward(reqs, part, cache, mode, skip, begin, reads,
                                      {j: source[j] for j in copies if source[j] in part})
        for (c, n), pairs in _grouped(((skip[j], len(reqs[j].prompt)), (source[j], j)) for j in copies):
            src, dst = [a for a, _ in pairs], [b for _, b in pairs]  # the slots their source read: from c + begin
            cache.copy_slots(src, dst, c + begin, min(c + end, n))
            if mode == "dflash":
                self.proposer.cache.copy_slots(src, dst, c + begin, min(c + end, n))
        for j in copies:
            reqs[j].first_logits = reqs[source[j]].first_logits
            if reqs[j].prompt_logprobs is not None:
                reqs[j].prompt_logprobs = list(reqs[source[j]].prompt_logprobs)
            if reqs[j].context_logits is not None:
                reqs[j].context_logits = list(reqs[source[j]].context_logits)
        if end < longest:
            return end
        self._emit_first(reqs, list(range(len(reqs))), cache)
        return end

    def _shared_in_call(self, reqs: list[Request], act: list[int], skip: list[int]) -> dict[int, tuple[int, int]]:
        """With a prefix cache (the user's consent to reused K/V): rows of one whole prefill (`act`, in order) whose
        prompts share at least PAD_TOKENS more tokens with an earlier row's than their cached prefix holds (a
        system prompt, few-shot examples, read by several requests at once): {row: (that earlier row, the tokens
        shared, at most all but the row's last)}. Those rows are read after the others, from the end of the shared
        part, which is copied from that row (so requests arriving together reuse each other's prefix as later
        ones reuse the cache's); their `metrics.cached_tokens` counts it. Not for rows asking for prompt logprobs or
        context logits, nor under a feature sink (every position is read then)."""
        if self.prefix_cache is None or self.feature_sink is not None:
            return {}
        leaders: list[int] = []
        shares: dict[int, tuple[int, int]] = {}
        for j in act:
            prompt = reqs[j].prompt
            best, lead = 0, None
            if reqs[j].params.prompt_logprobs is None and not reqs[j].params.return_context_logits:
                for i in leaders:
                    if reqs[i].prompt[0] == prompt[0]:
                        n = min(common_prefix_length(reqs[i].prompt, prompt), len(prompt) - 1)
                        best, lead = (n, i) if n > best else (best, lead)
            if lead is not None and best - skip[j] >= PAD_TOKENS:
                shares[j] = (lead, best)
            else:
                leaders.append(j)
        return shares

    @staticmethod
    def _forwards(act: list[int], skip: list[int], reads: dict[int, int]) -> list[list[int]]:
        """The target forwards of a prefill chunk, as lists of rows: those without a cached prefix in one (they
        read the same positions: with the rest of their prompts from position 0, the causal prefill's fast path);
        each row with one, longest first, joins the current forward when its padding to that forward's length is
        at most PAD_TOKENS or a quarter of that length, else starts the next (a row reading 1 token past a long
        cached prefix is not padded to a long prompt's prefill, nor does it slow that one's attention)."""
        out = [[j for j in act if not skip[j]]]
        for j in sorted((j for j in act if skip[j]), key=lambda j: -reads[j]):
            longest = reads[out[-1][0]] if out[-1] and skip[out[-1][0]] else None
            if longest is not None and longest - reads[j] <= max(PAD_TOKENS, longest // 4):
                out[-1].append(j)
            else:
                out.append([j])
        return [part for part in out if part]

    def _prefill_forward(self, reqs: list[Request], part: list[int], cache, mode: str, skip: list[int], begin: int,
                         reads: dict[int, int], copies: dict[int, int]) -> None:
        """One target forward of `_prefill`: rows `part` read reads[j] prompt tokens from position skip[j] + begin
        (padded to the longest), their K/V and drafter context written, their first token's logits kept when
        their prompt ends here, their prompt logprobs added; `copies` ({row repeating a prompt: its source row in
        `part`}) are recorded for a feature sink with them."""
        dev = self.device
        t = max(reads[j] for j in part)
        ids = torch.zeros(len(part), t, dtype=torch.int64)
        for i, j in enumerate(part):
            ids[i, : reads[j]] = torch.tensor(reqs[j].prompt[skip[j] + begin : skip[j] + begin + reads[j]])
        ids = ids.to(dev)
        starts = [skip[j] + begin for j in part]
        positions = torch.tensor(starts, device=dev)[:, None] + torch.arange(t, device=dev)
        last_slot = [c + t - 1 for c in starts]  # per row, the last slot this forward writes
        if any(skip[j] for j in part):
            # a row's padding (past its prompt) goes to its first slot after the prompt, not past its capacity: that
            # slot is overwritten by its first decode step before anything reads it, and no prompt token sees it
            # (causal by position). Rows read from the same position keep theirs (the causal fast path from 0).
            ends = torch.tensor([len(reqs[j].prompt) for j in part], device=dev)[:, None]
            positions = torch.minimum(positions, ends)
            last_slot = [min(x, len(reqs[j].prompt)) for x, j in zip(last_slot, part)]
        last = torch.tensor([reads[j] - 1 for j in part], device=dev)[:, None]
        rows = None if part == list(range(cache.batch)) else torch.tensor(part, device=dev)  # (input i: cache row part[i])
        out = self.target(ids, positions, cache, max(last_slot) + 1, rows, self._feature_ids(mode), last)
        if not torch.isfinite(out.logits).all():
            raise DFlashError("the target produced non-finite logits at prefill (NaN/inf weights or overflow in "
                              "this dtype?); try --dtype float32")
        if mode == "dflash":
            self.proposer.add_context(out.features, positions, rows)
        elif self.feature_sink is not None:
            at = [part.index(j) for j in part] + [part.index(src) for src in copies.values()]
            self.feature_sink.record([reqs[j].index for j in part + list(copies)], out.features[at], positions[at],
                                     [reads[part[i]] for i in at])
        for i, j in enumerate(part):
            if skip[j] + begin + reads[j] == len(reqs[j].prompt):  # its last prompt token: its first token's logits
                reqs[j].first_logits = out.logits[i, 0]
            if reqs[j].prompt_logprobs is not None:  # (such rows reuse no prefix: skip[j] == 0)
                self._prompt_logprobs(reqs[j], out.hidden[i], begin, min(begin + reads[j], len(reqs[j].prompt) - 1))
            if reqs[j].context_logits is not None:  # (nor do these)
                for lo in range(0, reads[j], PROMPT_LOGITS_ROWS):
                    rows_ = out.hidden[i, lo : min(reads[j], lo + PROMPT_LOGITS_ROWS)]
                    reqs[j].context_logits.append(self.target.compute_logits(rows_).float().cpu())

    def _emit_first(self, reqs: list[Request], rows: list[int], cache) -> None:
        """Choose and emit the first token of each request reqs[j], j in `rows`, whose prompt is read (from
        its `first_logits`), and commit its prompt in cache row j. Every row's token is chosen before any is
        emitted: a row whose sampling fails fails the call before any other row's caller has been sent a
        token (so the others can be rerun)."""
        sel = [reqs[j] for j in rows]
        logits = torch.stack([r.first_logits for r in sel])  # raw: what logprobs report
        scores = logits  # what the tokens are chosen from (each request's logits processing, `Request.scores`)
        if any(r.penalties is not None for r in sel):
            scores = torch.cat([r.scores(logits[i : i + 1], [[]]) for i, r in enumerate(sel)])
        argmax = greedy_tokens(scores).tolist()  # one device sync for all of them
        toks = [argmax[i] if r.params.greedy else sample(probs_from_logits(scores[i], r.params), r.generator)
                for i, r in enumerate(sel)]
        lps = [None if r.logprobs is None else token_logprobs(logits[i : i + 1], [toks[i]], r.params.logprobs)
               for i, r in enumerate(sel)]
        for i, (j, r) in enumerate(zip(rows, sel)):
            r.first_logits = None
            r.start = len(r.prompt)
            cache.set_length(j, len(r.prompt))
            r.emit([toks[i]], lps[i], logits[i : i + 1])

    def _prompt_logprobs(self, r: Request, hidden: torch.Tensor, begin: int, stop: int) -> None:
        """Append to r.prompt_logprobs those of prompt tokens begin + 1 .. stop, from the final-normed hidden
        states [t, H] of a prefill chunk starting at position `begin` (position p predicts token p + 1), the
        lm_head computed PROMPT_LOGITS_ROWS positions at a time (a whole long prompt's logits would not fit)."""
        for lo in range(begin, stop, PROMPT_LOGITS_ROWS):
            hi = min(stop, lo + PROMPT_LOGITS_ROWS)
            logits = self.target.compute_logits(hidden[lo - begin : hi - begin])
            r.prompt_logprobs.extend(token_logprobs(logits, r.prompt[lo + 1 : hi + 1], r.params.prompt_logprobs))

    def _step(self, batch: list[Request], cache, mode: str, block: int) -> None:
        """One decode step of every request of `batch` (cache row j holds batch[j]): draft, one target
        forward, accept, KV injection."""
        rows = None  # the caches hold exactly the active requests, in order
        dev = self.device
        last = torch.tensor([r.out[-1] for r in batch], device=dev)
        starts = torch.tensor([r.start for r in batch], device=dev)
        max_start = max(r.start for r in batch)
        k = self.proposer.max_draft_len if mode == "dflash" else 0
        # a block reaching past the drafter's context is verified as a plain one-token step; once no
        # row can draft (positions only grow), the step is autoregressive and skips the drafter
        in_reach = [mode == "dflash" and k > 0 and r.start + block <= self.proposer.max_position for r in batch]
        # more active requests than the proposer's max_concurrency: a plain one-token step too, whose
        # target features still go to the drafter (its context stays whole for when drafting resumes)
        speculate = mode == "dflash" and self.proposer.speculates(len(batch))
        can_draft = [x and speculate for x in in_reach]
        drafting = any(can_draft)
        inject = any(in_reach)
        drafts = None
        tokens = last[:, None]
        # per row: drafts verified this step (max_draft_len, or fewer with a dynamic draft length)
        lens = [0] * len(batch)
        if drafting:
            with self._phase("draft"):
                processing = [r.draft_scores if r.penalties is not None and r.penalties.for_drafts else None
                              for r in batch]
                drafts = self.proposer.propose(last, starts, max_start, rows, [r.params for r in batch],
                                               [r.generator for r in batch], self._lookups(batch),
                                               processing if any(processing) else None)
            lens = [(k if drafts.lengths is None else min(drafts.lengths[j], k)) if can_draft[j] else 0
                    for j in range(len(batch))]
            k = max(lens)  # the verify pass is as long as the longest draft kept
            tokens = torch.cat([tokens, drafts.tokens[:, :k]], dim=1)
        step = k + 1 if drafting else 1
        positions = starts[:, None] + torch.arange(step, device=dev)  # also the cache slots written
        tree = None if not drafting or drafts.parents is None else drafts.parents[:, :k]
        feature_ids = self._feature_ids(mode) if inject or mode == "ar" else ()
        # logits are computed below, only where the verifier reads them
        with self._phase("target_forward"):
            if tree is None:
                out = self.target(tokens, positions, cache, max_start + step, rows, feature_ids, with_logits=False)
            else:  # node i at slot start + i, at position start + its depth, seeing its ancestors
                mask = tree_attention_mask(tree, starts, max_start + step)
                out = self.target(tokens, starts[:, None] + node_depths(tree), cache, max_start + step, rows,
                                  feature_ids, with_logits=False, slots=positions, attn_mask=mask)
        if mode == "ar" and self.feature_sink is not None:
            self.feature_sink.record([r.index for r in batch], out.features, positions, [1] * len(batch))
        with self._phase("logits_and_accept"):
            kept_nodes = self._accept(batch, lens, tokens, drafts, out.hidden, cache, mode, tree)
        if inject:
            # KV injection of the block's target features (a tree's: its accepted path first); slots
            # past each row's accepted length hold rejected drafts' features and stay masked until
            # overwritten.
            with self._phase("inject"):
                features = out.features
                if kept_nodes is not None:
                    features = features.gather(1, kept_nodes[..., None].expand(-1, -1, features.shape[-1]))
                self.proposer.add_context(features, positions, rows)

    def _lookups(self, batch: list[Request]) -> list[list[int]] | None:
        """Per row, the prompt-lookup candidates after its last token (at most
        `DFlashProposer.prompt_lookup`; [] where none matched), or None when prompt lookup is off."""
        num = self.proposer.prompt_lookup
        if not num:
            return None
        out = []
        for r in batch:
            r.ngrams.extend(r.out[len(r.ngrams.tokens) - len(r.prompt):])  # the tokens emitted since
            out.append(r.ngrams.lookup(num))
        return out

    def _accept(self, batch: list[Request], lens: list[int], tokens: torch.Tensor, drafts, hidden: torch.Tensor,
                cache, mode: str, tree: torch.Tensor | None = None) -> torch.Tensor | None:
        """Verify one step's drafts (greedy or speculative sampling) from the target's final-normed
        hidden states [n, step, H], emit each row's accepted drafts + one target token, update its
        metrics and roll its target KV cache length back to what it kept.

        With draft trees (`tree`: parents [n, step - 1]) the accepted path's K/V move to consecutive
        cache slots, and the return value is [n, step] int64: per row the node at each block offset
        after the move (root, accepted path, then the rest unchanged), for the KV injection.
        Chains return None."""
        dev = hidden.device
        greedy = [j for j, r in enumerate(batch) if r.params.greedy]
        sampled = [j for j, r in enumerate(batch) if not r.params.greedy]
        paths: dict[int, list[int]] = {}
        # the verifier's logits of the rows asking for logprobs, which those reuse
        memo = StepLogits({j for j, r in enumerate(batch) if r.logprobs is not None or r.generation_logits is not None})
        if tree is None:
            # a chain of a request with logits processing is verified as a tree whose nodes are its positions
            plain = [j for j in greedy if batch[j].penalties is None]
            g_acc, g_next = self._verify_greedy(plain, batch, lens, tokens, hidden, memo)
            processed = [j for j in greedy if batch[j].penalties is not None]
            if processed:
                chains = chain_parents(len(batch), tokens.shape[1] - 1, tokens.device)
                acc, nxt, _ = self._verify_greedy_trees(processed, batch, lens, tokens, chains, hidden, memo)
                greedy, g_acc, g_next = plain + processed, g_acc + acc, g_next + nxt
        else:
            g_acc, g_next, paths = self._verify_greedy_trees(greedy, batch, lens, tokens, tree, hidden, memo)
        verdict = {j: (a, t) for j, a, t in zip(greedy, g_acc, g_next)}
        s_probs = self._sampling_probs(sampled, batch, lens, tokens, hidden, memo) if sampled else {}
        token_rows = tokens.tolist()  # one device sync, not one per row
        for j, r in enumerate(batch):  # every verdict before any row emits (a failing row emits nothing anywhere)
            if not r.params.greedy:
                kj = lens[j]
                q = drafts.probs[j][:kj] if drafts is not None and drafts.probs[j] is not None else None
                verdict[j] = speculative_sample(tokens[j, 1 : kj + 1], q, s_probs[j], r.generator)
        emitted = {}
        for j in range(len(batch)):
            acc, nxt = verdict[j]
            path = paths.get(j)
            emitted[j] = (token_rows[j][1 : acc + 1] if path is None else [token_rows[j][i] for i in path]) + [nxt]
        emitted_logits = self._emitted_logits(batch, verdict, paths, hidden, memo)
        lps = {j: token_logprobs(emitted_logits[j], emitted[j], batch[j].params.logprobs)
               for j in emitted_logits if batch[j].logprobs is not None}
        # a tree's drafted position is its node's depth (the chain's: its index); host lists, as `node_depths`
        depths = node_depths(tree).tolist() if tree is not None and mode == "dflash" else None
        for j, r in enumerate(batch):
            kj = lens[j]
            acc, nxt = verdict[j]
            path = paths.get(j)
            taken = r.emit(emitted[j], lps.get(j), emitted_logits.get(j))
            m = r.metrics
            m.verify_steps += 1
            m.drafted_tokens += kj
            kept = min(acc, taken)
            m.accepted_tokens += kept
            if mode == "dflash":  # (its lists have max_draft_len zeros from `DecodeBatch._add` on)
                for pos in range(kept):
                    m.accepted_per_position[pos] += 1
                for pos in (range(kj) if depths is None else (d - 1 for d in depths[j][1 : kj + 1])):
                    m.drafted_per_position[pos] += 1
            if path:  # the accepted nodes' K/V to slots start + 1 .. start + acc
                cache.move(j, [r.start + i for i in path], list(range(r.start + 1, r.start + acc + 1)))
            r.start += acc + 1
            cache.set_length(j, r.start)
        if tree is None:
            return None
        kept_nodes = torch.arange(tokens.shape[1], device=dev).repeat(len(batch), 1)
        for j, path in paths.items():
            if path:
                kept_nodes[j, 1 : len(path) + 1] = torch.tensor(path, device=dev)
        return kept_nodes

    def _emitted_logits(self, batch: list[Request], verdict: dict, paths: dict[int, list[int]], hidden: torch.Tensor,
                        memo: StepLogits) -> dict[int, torch.Tensor]:
        """The raw target logits [emitted, V] of the tokens each row asking for logprobs or generation logits emits
        this step (its accepted drafts and the target's token), at the nodes they were predicted at: block
        positions 0 .. accepted for a chain, the root and the accepted path for a tree. Those logits are the
        verifier's own (`memo`); a row whose nodes the verifier did not all compute gets them from one lm_head
        product over such rows."""
        rows = [j for j, r in enumerate(batch) if r.logprobs is not None or r.generation_logits is not None]
        if not rows:
            return {}
        nodes = {j: [0] + paths[j] if j in paths else list(range(verdict[j][0] + 1)) for j in rows}
        logits = {j: memo.get(j, nodes[j]) for j in rows}
        missing = [j for j in rows if logits[j] is None]
        if missing:
            fresh = self.target.compute_logits(torch.cat([hidden[j, nodes[j]] for j in missing]))
            for j, part in zip(missing, fresh.split([len(nodes[j]) for j in missing])):
                logits[j] = part
        return logits

    def _sampling_probs(self, rows: list[int], batch: list[Request], lens: list[int], tokens: torch.Tensor,
                        hidden: torch.Tensor, memo: StepLogits) -> dict[int, ChunkedProbs]:
        """The target's p [lens[j] + 1, V] of each sampling row j in `rows` from the step's tokens [n, step]
        and final-normed hidden states [n, step, H], as `ChunkedProbs`: the first `_first_logits` positions
        of every row in one lm_head product, a row's later positions only if speculative sampling reads
        them; each position's logits processed with its own history (`Request.scores`). The raw logits
        computed go to `memo`."""
        first = [self._first_logits(batch[j], lens[j], hidden.shape[1]) for j in rows]
        logits = self.target.compute_logits(torch.cat([hidden[j, :f] for j, f in zip(rows, first)]))
        memo.add([(j, node) for j, f in zip(rows, first) for node in range(f)], logits)
        out, at = {}, 0
        for j, f in zip(rows, first):
            r, end = batch[j], lens[j] + 1
            drafts = tokens[j, 1:end].tolist() if r.penalties is not None else []

            def rest(j=j, f=f, r=r, end=end, drafts=drafts) -> torch.Tensor:
                later = self.target.compute_logits(hidden[j, f:end])
                memo.add([(j, node) for node in range(f, end)], later)
                return probs_from_logits(r.scores(later, chain_prefixes(drafts, f, end)), r.params)

            out[j] = ChunkedProbs(probs_from_logits(r.scores(logits[at : at + f], chain_prefixes(drafts, 0, f)),
                                                    r.params), rest)
            at += f
        return out

    def _verify_greedy(self, rows: list[int], batch: list[Request], lens: list[int], tokens: torch.Tensor,
                       hidden: torch.Tensor, memo: StepLogits) -> tuple[list[int], list[int]]:
        """Greedy verdicts (accepted, next_token) of batch rows `rows`, given the step's tokens
        [n, step], final-normed target hidden states [n, step, H] and each row's number of drafts
        `lens` (<= step - 1; a row without drafts this step takes the target's own token). The logits
        computed go to `memo`."""
        if not rows:
            return [], []
        dev, step = hidden.device, hidden.shape[1]
        idx = torch.tensor(rows, device=dev)
        drafts = tokens[idx, 1:]  # [g, step - 1], a copy
        num = torch.tensor([lens[j] for j in rows], device=dev)
        unverified = torch.arange(step - 1, device=dev)[None, :] >= num[:, None]
        drafts[unverified] = self.target.config.vocab_size  # an id the target never outputs: never accepted
        first = torch.tensor([self._first_logits(batch[j], lens[j], step) for j in rows], device=dev)
        def keep(where: torch.Tensor, logits: torch.Tensor) -> None:
            memo.add_where(rows, where, logits)

        return lazy_greedy_accept(drafts, hidden[idx], self.target.compute_logits, first, keep)

    def _verify_greedy_trees(self, rows: list[int], batch: list[Request], lens: list[int], tokens: torch.Tensor,
                             tree: torch.Tensor, hidden: torch.Tensor,
                             memo: StepLogits) -> tuple[list[int], list[int], dict[int, list[int]]]:
        """Greedy verdicts of draft trees (`greedy_tree_accept`) of batch rows `rows`: accepted
        counts, next tokens and the accepted paths (node indices). Logits are computed for every
        verified node of those rows in one lm_head product (and go to `memo`); a request with logits
        processing reads each node's after its own (the drafts on the node's path, `tree_prefixes`)."""
        if not rows:
            return [], [], {}
        dev, step = hidden.device, hidden.shape[1]
        idx = torch.tensor(rows, device=dev)
        num = torch.tensor([lens[j] for j in rows], device=dev)
        verified = torch.arange(step, device=dev)[None, :] <= num[:, None]  # [g, step]: root + drafts
        logits = self.target.compute_logits(hidden[idx][verified])
        memo.add_where(rows, verified, logits)
        token_rows, parent_rows = tokens[idx, 1:].tolist(), tree[idx].tolist()
        if any(batch[j].penalties is not None for j in rows):
            parts = list(logits.split([lens[j] + 1 for j in rows]))
            for g, j in enumerate(rows):
                parts[g] = batch[j].scores(parts[g], tree_prefixes(token_rows[g], parent_rows[g], lens[j] + 1))
            logits = torch.cat(parts)
        flat = greedy_tokens(logits).tolist()
        accepted, nxt, paths, at = [], [], {}, 0
        for g, j in enumerate(rows):
            m = lens[j]
            path, token = greedy_tree_accept(token_rows[g], parent_rows[g], m, flat[at : at + m + 1])
            at += m + 1
            accepted.append(len(path))
            nxt.append(token)
            paths[j] = path
        return accepted, nxt, paths

    def _first_logits(self, r: Request, num_drafts: int, step: int) -> int:
        """How many block positions request r's greedy verification computes logits for up front
        (the others only if its drafts all match there): 1 without drafts; `lazy_logits` while
        its drafts rarely get that far (LAZY_MAX_ACCEPT_RATE); else all it verifies in one product."""
        c, m = self.lazy_logits, r.metrics
        if not num_drafts:
            return 1
        step = min(step, num_drafts + 1)  # positions past its own drafts are never read
        if not 0 < c < step:
            return step
        rate = m.accepted_per_position[c - 1] / m.verify_steps if m.verify_steps and m.accepted_per_position else 0.0
        return c if rate <= LAZY_MAX_ACCEPT_RATE else step
