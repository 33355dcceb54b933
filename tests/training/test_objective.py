"""The batched training objective: padding blocks and padded context never change a sequence's loss."""

import pytest
import torch

from tests.training.conftest import TINY
from dflash_trt.config import TargetConfig
from dflash_trt.models.checkpoints import new_drafter_config
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.training import objective as O


def _batch(seqs, block, mask):
    a_max = max(s[1].numel() for s in seqs)
    ctx = max(int(s[1].max()) for s in seqs)
    n = len(seqs)
    anchors = torch.zeros(n, a_max, dtype=torch.int64)
    ids = torch.full((n, a_max, block), mask, dtype=torch.int64)
    positions = torch.arange(block).repeat(n, a_max, 1)
    labels = torch.full((n, a_max, block - 1), -1, dtype=torch.int64)
    feats = torch.zeros(n, ctx, seqs[0][2].shape[1])
    teach = torch.zeros(n, a_max, block - 1, seqs[0][3].shape[1])
    for r, (tok, anc, f, t) in enumerate(seqs):
        i_, p_, l_ = O.block_inputs(tok, anc, block, mask)
        k = anc.numel()
        anchors[r, :k], ids[r, :k], positions[r, :k], labels[r, :k] = anc, i_, p_, l_
        feats[r, : int(anc.max())] = f[: int(anc.max())]
        teach[r, :k] = t[(p_[:, 1:] - 1).clamp(max=t.shape[0] - 1)]
    return feats, ids, positions, anchors, labels, teach


def _random_seqs(shapes, gen):
    """(tokens [T + 1], anchors, features [T, 128], teacher states [T, 64]) per (T, prompt_len, anchors)."""
    seqs = []
    for length, prompt, a in shapes:
        tok = torch.randint(0, 64, (length + 1,), generator=gen)
        seqs.append((tok, O.sample_anchors(prompt, length + 1, a, gen), torch.randn(length, 128, generator=gen),
                     torch.randn(length, 64, generator=gen)))
    return seqs


def test_batched_loss_is_the_sum_of_per_sequence_losses():
    torch.manual_seed(0)
    drafter = DFlashDrafter(new_drafter_config(TargetConfig.from_hf_config(TINY), 2, 4, 3, [0, 1]))
    embed, head = torch.randn(64, 64), torch.randn(64, 64) * 0.1
    weights = O.decay_weights(4, 2.0)
    gen = torch.Generator().manual_seed(1)
    seqs = _random_seqs([(30, 5, 6), (20, 3, 4), (12, 9, 8)], gen)  # the last: 3 anchors only
    singles = []
    for s in seqs:
        feats, ids, pos, anc, lab, teach = _batch([s], 4, 3)
        out = O.block_loss(O.drafter_block_hidden(drafter, embed, feats, ids, pos, anc), lab, head, weights, teach, 0.5)
        singles.append(out)
    feats, ids, pos, anc, lab, teach = _batch(seqs, 4, 3)
    k = seqs[2][1].numel()
    assert anc.shape == (3, 6) and k < 6 and (lab[2, k:] == -1).all()  # padding blocks present
    batched = O.block_loss(O.drafter_block_hidden(drafter, embed, feats, ids, pos, anc), lab, head, weights, teach, 0.5)
    assert batched.sequences == 3 and batched.positions == sum(s.positions for s in singles)
    torch.testing.assert_close(batched.loss, sum(s.loss for s in singles), rtol=1e-5, atol=1e-6)
    assert abs(batched.accepted - sum(s.accepted for s in singles) / 3) < 1e-6
    assert abs(batched.hard_ce - sum(s.hard_ce for s in singles) / 3) < 1e-5


def test_decode_walk_visits_only_the_blocks_decoding_starts():
    # offsets 0..6 of an 8-token response; decoding anchors at 0 (accepts 2: commits 3 tokens), then
    # 3 (accepts 0), 4 (accepts 2, up to the end): 3 steps for 7 tokens after the first, tau 7 / 3
    runs = [2, 5, 5, 0, 2, 1, 0]
    assert O.decode_walk_steps(runs) == 3
    assert O.decode_walk_steps([0] * 5) == 5 and O.decode_walk_steps([4, 3, 2, 1, 0]) == 1
    assert O.decode_walk_steps([]) == 0
    # the mean over every anchor counts the skipped easy anchors too: 1 + 15 / 7 = 3.1 > 7 / 3
    assert 1 + sum(runs) / len(runs) > len(runs) / O.decode_walk_steps(runs)


@pytest.mark.parametrize("blockwise", [True, False])
def test_training_blocks_equal_the_runtime_drafter_pass(blockwise):
    """drafter_block_hidden (all blocks of all sequences in one pass; blockwise attention or SDPA
    with the block-diagonal mask) gives every block the hidden states the runtime's drafter pass
    gives it (DFlashDrafter.forward over a KV cache holding the context K/V of the slots before its
    anchor, injected by inject_context)."""
    torch.manual_seed(0)
    block, mask = 4, 3
    drafter = DFlashDrafter(new_drafter_config(TargetConfig.from_hf_config(TINY), 2, block, mask, [0, 1])).eval()
    embed = torch.randn(64, 64)
    gen = torch.Generator().manual_seed(2)
    seqs = _random_seqs([(30, 5, 6), (20, 3, 4)], gen)
    feats, ids, pos, anc, _, _ = _batch(seqs, block, mask)
    with torch.no_grad():
        hidden = O.drafter_block_hidden(drafter, embed, feats, ids, pos, anc, blockwise)
        compared = 0
        for r, (_, anchors, f, _) in enumerate(seqs):
            for i, a in enumerate(anchors.tolist()):
                cache = drafter.new_cache(1, a + block)
                drafter.inject_context(f[None, :a], torch.arange(a)[None], cache)
                ref = drafter(torch.nn.functional.embedding(ids[r, i][None], embed), pos[r, i][None], cache,
                              torch.tensor([a]), a)
                torch.testing.assert_close(hidden[r, i], ref[0], rtol=1e-5, atol=1e-5)
                compared += 1
    assert compared == 10


def test_blockwise_attention_gives_the_dense_gradients():
    """Training with blockwise attention moves the drafter exactly as SDPA with the dense block-diagonal
    mask does: the same loss and the same gradient for every parameter (float32)."""
    torch.manual_seed(0)
    drafter = DFlashDrafter(new_drafter_config(TargetConfig.from_hf_config(TINY), 2, 4, 3, [0, 1]))
    embed, head = torch.randn(64, 64), torch.randn(64, 64) * 0.1
    gen = torch.Generator().manual_seed(3)
    seqs = _random_seqs([(30, 5, 6), (12, 9, 8)], gen)
    feats, ids, pos, anc, lab, teach = _batch(seqs, 4, 3)
    grads, losses = [], []
    for blockwise in (True, False):
        drafter.zero_grad()
        hidden = O.drafter_block_hidden(drafter, embed, feats, ids, pos, anc, blockwise)
        out = O.block_loss(hidden, lab, head, O.decay_weights(4, 2.0), teach, 0.5)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({k: p.grad.clone() for k, p in drafter.named_parameters()})
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-6, msg=k)
