"""The verifier: which drafted tokens the target keeps, and the token it adds.

Terms (DFlash paper sec. 3.3; Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", and Chen et al. 2023, Algorithm 2):
- p: the target's distribution at a position (after temperature / top-k / top-p).
- q: the drafter's distribution at that position (one-hot for argmax drafts).
- accepted tokens: the longest prefix of the draft the target keeps.
- recovered token: on the first rejection, a sample from norm(max(0, p - q)); output stops there.
- bonus token: when every draft token is accepted, one more sample from p at the next position.
The output has exactly the target's distribution (greedy: exactly the target's argmax sequence).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash_trt.runtime.sampling import greedy_tokens


def _accept_prefix(draft_tokens: torch.Tensor, posterior: torch.Tensor) -> torch.Tensor:
    """[n] int64 length of the longest prefix of draft_tokens [n, k] equal to posterior[:, :k]."""
    k = draft_tokens.shape[1]
    return (draft_tokens == posterior[:, :k]).to(torch.int64).cumprod(1).sum(1)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Greedy verification for a batch.

    Args:
        draft_tokens: [n, k] int64 drafts (k may be 0).
        target_logits: [n, k + 1, V] target logits at [last token, draft_1 .. draft_k].
    Returns:
        (accepted, next_token): per row, the number of drafts equal to the target's argmax
        (longest matching prefix) and the target's argmax after them (bonus or correction).
    """
    posterior = greedy_tokens(target_logits)  # [n, k + 1]
    accepted = _accept_prefix(draft_tokens, posterior)  # [n]
    nxt = posterior.gather(1, accepted[:, None])[:, 0]
    return accepted.tolist(), nxt.tolist()


def lazy_greedy_accept(draft_tokens: torch.Tensor, hidden: torch.Tensor,
                       logits_fn: Callable[[torch.Tensor], torch.Tensor],
                       first: torch.Tensor,
                       on_logits: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                       ) -> tuple[list[int], list[int]]:
    """Greedy verification that computes the target's logits only where they can be read.

    Greedy acceptance stops at the first draft that differs from the target's argmax, and only the
    argmax at that position (the correction) is read after it; the rest of the block's logits
    are thrown away. With a weak drafter that is most of them, and the lm_head is the biggest
    single product of a verify pass (a 49152-row head over 16 positions reads 113 MB and costs
    about a sixth of the step on a CPU). So:
    1. logits at positions [0, first[r]) of each row r: they decide drafts 1 .. first[r];
    2. only for the rows whose drafts 1 .. first[r] all matched, logits at the remaining positions.
    The decisions are those of `greedy_accept(draft_tokens, logits_fn(hidden))`: same rule, same
    logits (up to the BLAS's rounding for a different number of rows, the same kind of difference
    as between a 16-token verify and a 1-token decode).

    Args:
        draft_tokens: [n, k] int64 drafts (k may be 0). An id the target never outputs (e.g.
            vocab_size) is never accepted: the engine marks rows that may not draft this way.
        hidden: [n, k + 1, H] final-normed target hidden states at [last token, draft_1 .. draft_k].
        logits_fn: [m, H] -> [m, V] logits (the target's lm_head).
        first: [n] int64 in [1, k + 1], the positions computed in step 1 (k + 1: all of them).
        on_logits: if given, called with (where [n, k + 1] bool, logits [where.sum(), V]) after each
            lm_head product: the logits of the positions `where` marks, in row-major order (a caller
            that needs some of them, e.g. for logprobs, reuses them instead of computing them again).
            The positions 0 .. accepted of every row are always among them.
    Returns:
        (accepted, next_token) as `greedy_accept`.
    """
    n, k = draft_tokens.shape
    positions = torch.arange(k + 1, device=hidden.device)[None, :]  # [1, k + 1]
    posterior = torch.full((n, k + 1), -1, dtype=torch.int64, device=hidden.device)  # -1: not computed
    step1 = positions < first[:, None]  # [n, k + 1]
    logits = logits_fn(hidden[step1])
    if on_logits is not None:
        on_logits(step1, logits)
    posterior[step1] = greedy_tokens(logits)
    accepted = _accept_prefix(draft_tokens, posterior)  # a draft never matches an uncomputed -1
    rest = accepted == first  # every draft decided in step 1 matched: the next argmax is unknown
    if bool(rest.any()):
        step2 = rest[:, None] & ~step1
        logits = logits_fn(hidden[step2])
        if on_logits is not None:
            on_logits(step2, logits)
        posterior[step2] = greedy_tokens(logits)
        accepted = _accept_prefix(draft_tokens, posterior)
    nxt = posterior.gather(1, accepted[:, None])[:, 0]
    return accepted.tolist(), nxt.tolist()


class ChunkedProbs:
    """A row's target probabilities p [k + 1, V] at [last token, draft_1 .. draft_k], computed in two
    chunks: positions [0, f) up front, the rest (`rest()` -> [k + 1 - f, V]) only when indexed.

    Speculative sampling reads p at position j only if drafts 1 .. j were all accepted, so with a
    weak drafter the rest is rarely needed (the same reasoning as `lazy_greedy_accept`). Indexing
    (`p[j]`, `p[j, d]`) gives exactly what the full tensor would, and `speculative_sample` draws the
    same random numbers in the same order, so its decisions are those on the full tensor.
    """

    def __init__(self, first: torch.Tensor, rest: Callable[[], torch.Tensor]):
        self._probs = first
        self._rest: Callable[[], torch.Tensor] | None = rest
        self.device = first.device

    def __getitem__(self, index):
        j = index[0] if isinstance(index, tuple) else index
        if self._rest is not None and j >= self._probs.shape[0]:
            self._probs = torch.cat([self._probs, self._rest()])
            self._rest = None
        return self._probs[index]


def speculative_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       target_probs: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """Lossless speculative sampling for one row.

    Args:
        draft_tokens: [k] int64 (k may be 0).
        draft_probs: [k, V] float32 q of each draft position, or None for argmax drafts (q one-hot).
        target_probs: [k + 1, V] float32 p at [last token, draft_1 .. draft_k] (a tensor, or a
            `ChunkedProbs` that computes the later positions only if they are read).
        generator: the request's RNG.
    Returns:
        (accepted, next_token): drafts kept, then the recovered token (on rejection) or the
        bonus token (all kept).
    """
    k = draft_tokens.shape[0]
    for j in range(k):
        d = int(draft_tokens[j])
        p_d = float(target_probs[j, d])
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        u = float(torch.rand((), generator=generator, device=target_probs.device))
        if u * q_d < p_d:  # accept with probability min(1, p/q)
            continue
        if draft_probs is None:
            residual = target_probs[j].clone()
            residual[d] = 0.0
        else:
            residual = (target_probs[j] - draft_probs[j]).clamp_min(0.0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else target_probs[j]
        return j, int(torch.multinomial(residual, 1, generator=generator))
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))
