"""The DFlash training objective (DFlash paper, arXiv 2602.06036, sec. 4.2).

One training sequence = prompt + target-written response, T + 1 tokens, with the target's features
for positions 0..T-1. From it we draw A random ANCHORS a in the response (a >= prompt_len, the
position of the first generated token at inference, and a <= T - 1). Each anchor makes one block:
input [token[a], MASK x (B-1)] at positions a..a+B-1, labels token[a+1..a+B-1] (ignored past the
sequence end). A block sees the target features of positions 0..a-1 (strictly before its anchor,
as at inference where the context holds the committed tokens) and its own B positions
bidirectionally, never another block: the attention mask is block-diagonal over the A blocks.

Loss over block positions k = 1..B-1, weighted w_k = exp(-(k-1)/gamma) (early positions matter
more: a draft is only accepted up to its first miss). Per position it mixes the cross-entropy on
the target's token (hard label) with the cross-entropy against the target's own next-token
distribution (soft label, distillation; the teacher's logits come from its final-normed hidden
state at position a+k-1, which the data cache holds), both over the draft vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.layers import BlockLayout

#: gamma of the loss decay per block size (paper: 7 for B=16, 5 for B=10, 4 for B=8).
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """The paper's gamma for B in {8, 10, 16}; otherwise 0.45 * B (close to those three)."""
    return PAPER_GAMMA.get(block_size, max(1.0, 0.45 * block_size))


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    """float32 [B-1]: w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(prompt_len: int, num_tokens: int, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Sorted distinct anchors int64 [<= num_anchors] drawn uniformly from [prompt_len, num_tokens - 2]
    (every block has at least one label). Empty when the response has fewer than 2 tokens."""
    lo, hi = prompt_len, num_tokens - 2
    if hi < lo:
        return torch.zeros(0, dtype=torch.int64)
    span = hi - lo + 1
    pick = torch.randperm(span, generator=generator)[: min(num_anchors, span)]
    return torch.sort(pick + lo).values


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Block inputs for anchors [A] over a sequence tokens [T + 1] int.

    Returns:
        ids [A, B] int64 ([token[a], MASK, ...]), positions [A, B] int64 (a..a+B-1),
        labels [A, B-1] int64 (token[a+k], -1 past the end).
    """
    n = tokens.shape[0]
    offsets = torch.arange(block_size, dtype=torch.int64)
    positions = anchors[:, None] + offsets
    ids = torch.full_like(positions, mask_token_id)
    ids[:, 0] = tokens[anchors].long()
    lab_pos = positions[:, 1:]
    labels = torch.where(lab_pos < n, tokens.long()[lab_pos.clamp(max=n - 1)], torch.full_like(lab_pos, -1))
    return ids, positions, labels


def block_diagonal_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """bool [S, A*B, context_len + A*B] for anchors [S, A]: block i of sequence s sees context
    slots j < anchors[s, i] and the B keys of block i only."""
    a = anchors.shape[1]
    q_block = torch.arange(a, device=anchors.device).repeat_interleave(block_size)  # [A*B]
    ctx = torch.arange(context_len, device=anchors.device)[None, None, :] < anchors[:, q_block][:, :, None]
    own = (q_block[:, None] == q_block[None, :]).expand(anchors.shape[0], -1, -1)
    return torch.cat([ctx, own], dim=2)


def drafter_block_hidden(drafter: DFlashDrafter, embed_weight: torch.Tensor, features: torch.Tensor,
                         ids: torch.Tensor, positions: torch.Tensor, anchors: torch.Tensor,
                         blockwise: bool | None = None) -> torch.Tensor:
    """The drafter's final-normed hidden states for A blocks of each of S sequences (training form of
    `DFlashDrafter.forward`, the same layers with a block-diagonal mask), all in one pass.

    Args:
        features: [S, C, len(target_layer_ids) * target_hidden] target features, C >= every
            anchor (rows past a sequence's own length are padding: no block can see them).
        ids, positions: [S, A, B] from `block_inputs` (padding blocks: anchor 0, labels all -1).
        anchors: [S, A].
        blockwise: attention as `layers.block_attention` (each query scored against the context
            and its own block's keys only) instead of SDPA with the dense block-diagonal mask over
            all A*B block keys: the same values, less work. None = on a CPU, where the trainer ran
            1.07-1.22x the blocks/s with it (float32 and bfloat16 autocast, 4 sequences x 64
            anchors, 1 thread; docs/bench/session16/trainer_attention.json); other devices keep
            SDPA until a run there times both (`build_scripts/bench_trainer.py`).
    Returns:
        [S, A, B, hidden] in the drafter's dtype.
    """
    s, a, b = ids.shape
    ctx_len = features.shape[1]
    h = drafter.fuse(features)
    ctx_pos = torch.arange(ctx_len, device=ids.device)[None].expand(s, ctx_len)
    ctx_cos, ctx_sin = drafter.rotary(ctx_pos)
    x = F.embedding(ids.reshape(s, a * b), embed_weight).to(drafter.fc.weight.dtype)
    cos, sin = drafter.rotary(positions.reshape(s, a * b))
    if blockwise is None:
        blockwise = features.device.type == "cpu"
    if blockwise:
        mask = BlockLayout(torch.arange(ctx_len, device=ids.device) < anchors[:, :, None], b)
    else:
        mask = block_diagonal_mask(anchors, ctx_len, b)[:, None]
    for layer in drafter.layers:
        ctx_k, ctx_v = layer.self_attn.project_kv(h, ctx_cos, ctx_sin)
        x = layer(x, cos, sin, ctx_k, ctx_v, mask)
    return drafter.norm(x).view(s, a, b, -1)


@dataclass
class LossOutput:
    """loss: scalar tensor (with grad), the SUM over sequences of each one's weighted-mean loss;
    hard_ce / soft_ce: means over sequences (floats); accepted: mean over sequences of the mean
    number of leading block positions whose argmax equals the label (averaged over anchors: NOT
    tau - 1, see `decode_walk_steps`); positions: number of labelled block positions; sequences:
    sequences with labels; runs: int64 [S, A] each block's number of leading correct positions
    (0 for a padding block); per_seq_hard_ce: float32 [S] each sequence's hard cross-entropy."""

    loss: torch.Tensor
    hard_ce: float
    soft_ce: float
    accepted: float
    positions: int
    sequences: int
    runs: torch.Tensor
    per_seq_hard_ce: torch.Tensor


def block_loss(hidden: torch.Tensor, labels: torch.Tensor, head: torch.Tensor, weights: torch.Tensor,
               teacher_hidden: torch.Tensor | None = None, soft_weight: float = 0.0) -> LossOutput:
    """Decay-weighted cross-entropy over block positions 1..B-1, per sequence.

    Args:
        hidden: [S, A, B, H] drafter outputs; positions 1..B-1 are scored.
        labels: [S, A, B-1] int64 DRAFT-vocabulary ids, -1 = ignored (past the end, not drafted,
            or a padding block).
        head: [V', H] the target lm_head rows of the draft vocabulary (frozen).
        weights: [B-1] float32 decay weights.
        teacher_hidden: [S, A, B-1, H] target final-normed hidden states predicting those
            positions, or None (then soft_weight must be 0).
        soft_weight: alpha in loss = (1 - alpha) * hard CE + alpha * soft CE.
    """
    s, a, b1 = labels.shape
    # 2-D matmuls: a strided 3-D view @ head.t() becomes a slow bmm over an expanded weight
    logits = (hidden[:, :, 1:].reshape(s * a * b1, -1) @ head.t()).view(s, a, b1, -1)  # [S, A, B-1, V']
    logp = torch.log_softmax(logits.float(), dim=-1)
    valid = labels >= 0
    w = weights.view(1, 1, -1) * valid
    denom = w.sum(dim=(1, 2))  # [S]
    has = denom > 0
    per_seq = lambda x: (x * w).sum(dim=(1, 2)) / denom.clamp(min=1e-9)  # noqa: E731
    hard_ce = per_seq(-logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0])  # [S]
    soft_ce = torch.zeros_like(hard_ce)
    if soft_weight > 0:
        with torch.no_grad():
            t_logits = teacher_hidden.reshape(s * a * b1, -1) @ head.t()
            p_teacher = torch.softmax(t_logits.float(), dim=-1).view(s, a, b1, -1)
        soft_ce = per_seq(-(p_teacher * logp).sum(-1))
    loss = ((1 - soft_weight) * hard_ce + soft_weight * soft_ce)[has].sum()
    n = int(has.sum())
    with torch.no_grad():
        correct = (logp.argmax(-1) == labels) & valid
        runs = correct.long().cumprod(dim=2).sum(dim=2)  # [S, A]
        real = valid.any(dim=2)  # [S, A] real (non-padding) blocks
        acc = (runs.float() * real).sum(1) / real.sum(1).clamp(min=1)
        mean = lambda x: float(x[has].mean()) if n else 0.0  # noqa: E731
        out = LossOutput(loss, mean(hard_ce.detach()), mean(soft_ce.detach()), mean(acc), int(valid.sum()), n,
                         runs, hard_ce.detach().float())
    return out


def decode_walk_steps(runs: list[int]) -> int:
    """Verify steps greedy DFlash decoding takes over one target-written response, teacher-forced.

    `runs[o]` is the number of leading drafts the target accepts from the block anchored at
    response offset o (anchor = prompt_len + o, for every o = 0 .. T - 2 - prompt_len: all of the
    response's anchors). Decoding visits only some anchors: the first at offset 0 (the prefill's
    token), then each step commits runs[o] drafts + 1 bonus token and the next block starts at
    o + runs[o] + 1. So tau = (response tokens - 1) / steps, as `evaluate.set_tau` measures by
    decoding, given the same features. The mean of runs over ALL anchors is larger: a run of k
    easy tokens is one step in decoding but k anchors that each accept much (the inspection
    paradox; on the default drafter's own outputs 2.24 against a decoded tau of 1.67, session 14).
    """
    o = steps = 0
    while o < len(runs):
        o += int(runs[o]) + 1
        steps += 1
    return steps


def cosine_lr(step: int, total_steps: int, warmup_steps: int) -> float:
    """LR multiplier: linear warmup to 1 over `warmup_steps`, then cosine decay to 0 at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
