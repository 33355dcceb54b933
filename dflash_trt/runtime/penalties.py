"""History-dependent logits processing: logit bias, repetition / presence / frequency penalties, min_tokens,
and a grammar's mask (guided decoding).

These change the TARGET's logits by what the sequence holds so far, so under speculative decoding each
verify position needs its OWN history: the prompt, the tokens emitted before this step, and the drafts
before that position in the block (for a draft tree, the drafts on the path to that node). `apply` takes
one history per position, so the verifier's p at every position is exactly the distribution that
autoregressive decoding would have there, and DFlash keeps the output (greedy) or the distribution
(sampling) of autoregressive decoding with the same parameters.

Order (HF `generate`'s for the processors it has, vLLM's for the others), before temperature, top-k,
top-p and min-p (`sampling.probs_from_logits`):
1. logit_bias: bias[t] added to logit t.
2. repetition_penalty r (tokens in the prompt or the output so far): logit / r if > 0, logit * r if not
   (Keskar et al. 2019, "CTRL", sec. 4.1; HF's `RepetitionPenaltyLogitsProcessor`).
3. frequency_penalty f and presence_penalty a (tokens in the output so far, c[t] times):
   logit - f * c[t] - a * (c[t] > 0) (OpenAI's definition; vLLM's scope: the prompt does not count.
   With `prompt_ignore_length` L, TensorRT-LLM's: the prompt's tokens from position L on count too).
4. min_tokens: while fewer than min_tokens tokens are out, the request's stop tokens get -inf.
5. bad_words: the last token of each bad word (a token id sequence) gets -inf where the output so far ends with
   the rest of it (always, for a one-token word; vLLM's `NoBadWordsLogitsProcessor`, the prompt not read), or,
   with `bad_words_read_prompt`, the prompt and the output together (TensorRT-LLM's `banBadWords` kernel).
6. guided decoding: the tokens the request's grammar forbids get -inf (`dflash_trt.runtime.guided`).
The logprobs a request asks for stay the raw target's (`dflash_trt.runtime.logprobs`).
"""

from __future__ import annotations

import torch

from dflash_trt.runtime.guided import GuidedLogits
from dflash_trt.runtime.sampling import SamplingParams


class LogitsPenalties:
    """The logits processing of one request (`SamplingParams.processes_logits`).

    Args:
        params: its SamplingParams.
        prompt: its prompt token ids (read by the repetition penalty).
        stop_ids: the tokens that end it (what min_tokens holds back).
    The Engine checks the token ids (logit_bias, stop ids) against the vocabulary before it makes one.
    """

    def __init__(self, params: SamplingParams, prompt: list[int], stop_ids: frozenset[int],
                 guided: GuidedLogits | None = None):
        self.params, self.guided = params, guided
        self.prompt = torch.tensor(sorted(set(prompt)), dtype=torch.int64) if params.repetition_penalty != 1 else None
        # the prompt's tokens the presence / frequency penalties count (prompt_ignore_length; none: vLLM's scope)
        skip = params.prompt_ignore_length
        self.counted = list(prompt[skip:]) if skip is not None and (params.presence_penalty or
                                                                     params.frequency_penalty) else []
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.int64)
        bias = params.logit_bias or ()
        self.bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.int64)
        self.bias_values = torch.tensor([b for _, b in bias], dtype=torch.float32)
        words = params.bad_words or ()
        self.banned = torch.tensor(sorted({w[0] for w in words if len(w) == 1}), dtype=torch.int64)  # always
        self.bad_words = [w for w in words if len(w) > 1]  # banned after the rest of them
        self.bad_context = max((len(w) - 1 for w in self.bad_words), default=0)  # the history they read
        # bad_words_read_prompt: the prompt's end, where a bad word may begin (TensorRT-LLM's scope)
        self.bad_prompt = list(prompt[max(0, len(prompt) - self.bad_context):]) if params.bad_words_read_prompt else []

    @property
    def for_drafts(self) -> bool:
        """Whether drafts should follow this processing (`apply(..., penalize=False)`): a logit bias or
        min_tokens moves the target's choice the same way at any history, so a drafter that ignored them
        kept drafting what the target no longer picks (a +100 bias: 33 verify steps for 64 tokens instead
        of 13); a grammar too. The penalties are left to the verifier: applied to the drafter's logits they
        did not help (8 MT-Bench prompts: 393 -> 407 steps at repetition 1.1, 358 -> 366 at presence/frequency
        0.5)."""
        return bool(self.params.logit_bias or self.params.min_tokens or self.guided is not None or self.params.bad_words)

    def apply(self, logits: torch.Tensor, out: list[int], prefixes: list[list[int]],
              penalize: bool = True) -> torch.Tensor:
        """The processed logits of m positions of the request.

        Args:
            logits: [m, V] raw target logits (any float dtype), row i at position i.
            out: the tokens the request has emitted before this step (its output so far).
            prefixes: m lists: the tokens between `out` and row i's prediction (the drafts before it in the
                block, or on its tree path; [] for the position right after `out`).
            penalize: False skips steps 2 and 3 (the drafts' processing, `for_drafts`).
        Returns:
            [m, V] float32, a new tensor (`logits` is left as it is: logprobs read the raw ones).
        """
        p = self.params
        scores = logits.float().clone()
        dev = scores.device
        if len(self.bias_ids):
            scores[:, self.bias_ids.to(dev)] += self.bias_values.to(dev)
        if penalize and (p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty):
            self._penalize(scores, out, prefixes)
        if p.min_tokens and len(self.stop_ids):
            early = [i for i, pre in enumerate(prefixes) if len(out) + len(pre) < p.min_tokens]
            if early:
                rows = torch.tensor(early, device=dev)
                scores[rows[:, None], self.stop_ids.to(dev)[None, :]] = float("-inf")
        if len(self.banned):
            scores[:, self.banned.to(dev)] = float("-inf")
        for i, pre in enumerate(prefixes) if self.bad_words else ():
            history = (self.bad_prompt + out[-self.bad_context:] + pre)[-self.bad_context:]
            ends = [w[-1] for w in self.bad_words
                    if len(history) >= len(w) - 1 and tuple(history[len(history) - len(w) + 1:]) == w[:-1]]
            if ends:
                scores[i, torch.tensor(ends, device=dev)] = float("-inf")
        if self.guided is not None:
            self.guided.mask(scores, out, prefixes)
        return scores

    def _penalize(self, scores: torch.Tensor, out: list[int], prefixes: list[list[int]]) -> None:
        """Steps 2 and 3 in place, on the columns of the tokens any row's history holds (the others keep
        their logits): counts [m, |S|] of each row's output tokens over those columns S."""
        p, dev, m = self.params, scores.device, scores.shape[0]
        extra = [t for pre in prefixes for t in pre]
        base = self.counted + out  # what every row's presence / frequency counts hold before its drafts
        held = torch.tensor(base + extra, dtype=torch.int64)
        columns = torch.cat([held, self.prompt]) if self.prompt is not None else held
        if not len(columns):
            return
        columns = torch.unique(columns)  # sorted
        counts = torch.bincount(torch.searchsorted(columns, torch.tensor(base, dtype=torch.int64)),
                                minlength=len(columns)).float().expand(m, -1).clone()
        if extra:
            rows = torch.tensor([i for i, pre in enumerate(prefixes) for _ in pre])
            counts.index_put_((rows, torch.searchsorted(columns, torch.tensor(extra))), torch.ones(len(extra)),
                              accumulate=True)
        counts = counts.to(dev)
        sub = scores[:, columns.to(dev)]
        if p.repetition_penalty != 1:
            seen = counts > 0
            if self.prompt is not None:
                seen |= torch.isin(columns, self.prompt).to(dev)[None, :]
            r = p.repetition_penalty
            sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
        if p.frequency_penalty or p.presence_penalty:
            sub = sub - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        scores[:, columns.to(dev)] = sub


#: bad words a request may give at most (each is matched at every verify position: 20,000 cost ~150 ms per step)
MAX_BAD_WORDS = 1000


def bad_word_ids(words, encode) -> tuple[tuple[int, ...], ...]:
    """The token id sequences of `words` (strings) for `SamplingParams.bad_words`: each word as written and, unless
    it is only whitespace, with one leading space instead of its own (how it reads after another word: BPE
    tokenizers give it other ids), both banned (vLLM reads `bad_words` so, keeping the spaced form only where its
    length matches).

    Args:
        words: the bad words, e.g. a request's `bad_words` (a list of strings, MAX_BAD_WORDS at most).
        encode: text -> token ids, without special tokens (the target tokenizer's).
    Raises:
        InvalidRequestError: not a list of strings, more than MAX_BAD_WORDS, or a word that is empty or not valid
            Unicode (a lone surrogate).
    """
    from dflash_trt.errors import InvalidRequestError

    if isinstance(words, (str, bytes)) or not isinstance(words, (list, tuple)):
        raise InvalidRequestError(f"bad_words must be a list of strings, got {type(words).__name__}")
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequestError(f"bad_words holds {len(words)} words; give at most {MAX_BAD_WORDS}")
    out = []
    for i, word in enumerate(words):
        if not isinstance(word, str) or not word:
            raise InvalidRequestError(f"bad_words[{i}] must be a non-empty string, got {word!r}")
        try:
            word.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(f"bad_words[{i}] is not valid Unicode (a lone surrogate); give UTF-8 text") from None
        out.append(tuple(encode(word)))
        if word.strip():
            out.append(tuple(encode(" " + word.lstrip())))
    return tuple(sorted({w for w in out if w}))


def chain_prefixes(drafts: list[int], first: int, end: int) -> list[list[int]]:
    """The `prefixes` of block positions first .. end - 1 of a chain of drafts: position i follows drafts[:i]."""
    return [drafts[:i] for i in range(first, end)]


def tree_prefixes(tokens: list[int], parents: list[int], nodes: int) -> list[list[int]]:
    """The `prefixes` of tree nodes 0 .. nodes - 1: node i's drafts from the root's child down to itself.

    Args:
        tokens: the drafts' token ids, node i + 1's at tokens[i] (node 0 is the root: the last token).
        parents: node i + 1's parent node at parents[i] (< i + 1; 0 = the root).
        nodes: the nodes to give (root included).
    """
    out = [[]]
    for i in range(1, nodes):
        out.append(out[parents[i - 1]] + [tokens[i - 1]])
    return out
