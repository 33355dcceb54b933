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

import torch


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Greedy verification for a batch.

    Args:
        draft_tokens: [n, k] int64 drafts (k may be 0).
        target_logits: [n, k + 1, V] target logits at [last token, draft_1 .. draft_k].
    Returns:
        (accepted, next_token): per row, the number of drafts equal to the target's argmax
        (longest matching prefix) and the target's argmax after them (bonus or correction).
    """
    posterior = target_logits.argmax(-1)  # [n, k + 1]
    k = draft_tokens.shape[1]
    accepted = (draft_tokens == posterior[:, :k]).to(torch.int64).cumprod(1).sum(1)  # [n]
    nxt = posterior.gather(1, accepted[:, None])[:, 0]
    return accepted.tolist(), nxt.tolist()


def speculative_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       target_probs: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """Lossless speculative sampling for one row.

    Args:
        draft_tokens: [k] int64 (k may be 0).
        draft_probs: [k, V] float32 q of each draft position, or None for argmax drafts (q one-hot).
        target_probs: [k + 1, V] float32 p at [last token, draft_1 .. draft_k].
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
