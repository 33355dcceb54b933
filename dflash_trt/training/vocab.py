"""The reduced draft vocabulary: the drafter predicts over the `k` most frequent target tokens.

A drafter's cost on CPU is mostly the lm_head over its block positions (TRAINING_NOTES.md: ~75% of
a training step with a 49k vocabulary). Predicting over the tokens that actually occur in the
target-written data gives several times more training blocks per second and cheaper drafting.

The map follows the EAGLE-3 / vLLM `speculators` convention: `d2t` int64 [k] holds OFFSETS,
target_id = draft_id + d2t[draft_id]; draft ids are the chosen target ids in increasing order.
The drafter's config.json records `draft_vocab_size` = k. A full-vocabulary export simply omits
both (the drafter's weights do not depend on the vocabulary: the head is the target's).
"""

from __future__ import annotations

import torch


def top_tokens(samples: list[dict], k: int, vocab_size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `k` most frequent target ids in the samples' response tokens, plus `always` (e.g. stop
    tokens), as a sorted int64 tensor [min(k, vocab_size)]. Ties break by lower id.

    Raises:
        ValueError: k < len(always) + 1.
    """
    if k < len(always) + 1:
        raise ValueError(f"draft vocabulary size {k} is too small")
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in samples:
        counts += torch.bincount(s["tokens"][s["prompt_len"]:].long(), minlength=vocab_size).double()
    for t in always:
        counts[t] = float("inf")
    # stable ranking: by count descending, then id ascending
    ids = torch.arange(vocab_size, dtype=torch.float64)
    order = torch.argsort(counts * vocab_size * 2 - ids, descending=True)
    return torch.sort(order[: min(k, vocab_size)]).values


def d2t_offsets(draft_ids: torch.Tensor) -> torch.Tensor:
    """int64 [k] offsets with target_id = draft_id + d2t[draft_id] (speculators convention)."""
    return draft_ids.long() - torch.arange(draft_ids.numel(), dtype=torch.int64)


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids [k] int64 of draft ids 0..k-1 from `d2t` offsets."""
    return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t.long()


def target_to_draft(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size]: the draft id of each target id, -1 where the target id is not drafted."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.int64)
    t2d[draft_ids.long()] = torch.arange(draft_ids.numel(), dtype=torch.int64)
    return t2d


def coverage(samples: list[dict], draft_ids: torch.Tensor, vocab_size: int) -> float:
    """Fraction of response tokens of `samples` that are in the draft vocabulary."""
    t2d = target_to_draft(draft_ids, vocab_size)
    total = hit = 0
    for s in samples:
        resp = s["tokens"][s["prompt_len"]:].long()
        total += resp.numel()
        hit += int((t2d[resp] >= 0).sum())
    return hit / total if total else 1.0
