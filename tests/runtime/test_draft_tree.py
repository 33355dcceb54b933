"""Draft trees (`tree_topk` > 1): candidate paths from the drafter's per-position top-k, verified in
one target pass with a tree attention mask; greedy output stays the target's own."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import ConfigError
from dflash_trt.runtime.draft_tree import (
    ancestor_matrix,
    build_tree,
    greedy_tree_accept,
    node_depths,
    tree_attention_mask,
)
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.kv_cache import KVCache
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams
from tests.runtime.oracle import chat_references, record_drafts
from tests.runtime.test_sampling_distribution import CASES, pvalue, tiny  # noqa: F401 (fixture)

MAX_TOKENS = 24
CHATS = ["Write a Python function that reverses a string.", "Name three colours."]
PROBS = [[0.6, 0.3], [0.7, 0.2]]  # top-2 probabilities at draft positions 1 and 2
IDS = [[10, 11], [20, 21]]


def test_build_tree_takes_paths_best_first_by_product():
    # path products: 10: .6, 10-20: .42, 11: .3, 11-20: .21, 10-21: .12, 11-21: .06
    assert build_tree(PROBS, IDS, 6) == ([10, 20, 11, 20, 21, 21], [0, 1, 0, 3, 1, 3])
    assert build_tree(PROBS, IDS, 4) == ([10, 20, 11, 20], [0, 1, 0, 3])
    assert build_tree(PROBS, IDS, 6, threshold=0.25) == ([10, 20, 11], [0, 1, 0])
    assert build_tree(PROBS, IDS, 0) == ([], [])
    assert build_tree([[0.6], [0.7]], [[10], [20]], 6) == ([10, 20], [0, 1])  # top-1: the chain


def test_depths_ancestors_and_mask_of_a_tree():
    parents = torch.tensor([[0, 1, 0, 3]])  # nodes 1..4: 1 and 3 under the root, 2 under 1, 4 under 3
    assert node_depths(parents).tolist() == [[0, 1, 2, 1, 2]]
    anc = ancestor_matrix(parents)[0].int().tolist()
    assert anc == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]]
    mask = tree_attention_mask(parents, torch.tensor([3]), kv_len=9)  # root at slot 3, nodes at 3..7
    assert mask.shape == (1, 1, 5, 9)
    expect = [[1, 1, 1] + row + [0] for row in anc]  # context slots 0..2, tree slots 3..7, slot 8 unused
    assert mask[0, 0].int().tolist() == expect


def test_greedy_tree_accept_follows_the_targets_argmax():
    tokens, parents = [10, 20, 11, 20, 21], [0, 1, 0, 3, 1]
    # the target says 11 after the root, 20 after node 3 (11), then 5: path 3 -> 4, then 5
    assert greedy_tree_accept(tokens, parents, 5, [11, 0, 0, 20, 5, 0]) == ([3, 4], 5)
    assert greedy_tree_accept(tokens, parents, 5, [10, 21, 0, 0, 0, 7]) == ([1, 5], 7)
    assert greedy_tree_accept(tokens, parents, 5, [12, 0, 0, 0, 0, 0]) == ([], 12)
    assert greedy_tree_accept(tokens, parents, 2, [11, 0, 0, 0, 0, 0]) == ([], 11)  # node 3 not verified


def test_kv_cache_move_copies_a_path_in_every_layer():
    cache = KVCache(2, 2, 1, 8, 2)
    for layer in range(2):
        cache.k[layer][:] = torch.arange(16.0).view(1, 1, 8, 2) + 100 * layer
        cache.v[layer][:] = -cache.k[layer]
    before = [t.clone() for t in cache.k + cache.v]
    cache.move(1, [4, 6], [3, 4])  # overlapping: slot 4 is read before it is written
    for t, b in zip(cache.k + cache.v, before):
        assert torch.equal(t[0], b[0])  # the other row untouched
        assert torch.equal(t[1, :, [3, 4]], b[1, :, [4, 6]])
        assert torch.equal(t[1, :, [0, 1, 2, 5, 6, 7]], b[1, :, [0, 1, 2, 5, 6, 7]])


@pytest.mark.parametrize("value", [0, -1, 2.0, True, "4"])
def test_tree_topk_must_be_a_positive_integer(smollm2_untrained, value):
    pipe = smollm2_untrained
    with pytest.raises(ConfigError, match=r'tree_topk must be "auto" or an integer >= 1 .*got ' + repr(value)):
        DFlashProposer(pipe.engine.proposer.drafter, pipe.engine.target, tree_topk=value)


@pytest.fixture(scope="module")
def refs(smollm2_pipeline):
    return chat_references(smollm2_pipeline, CHATS, MAX_TOKENS)


@pytest.mark.parametrize("threshold", [0.0, 0.1])
def test_default_drafter_tree_is_lossless_and_accepts_more(refs, threshold):
    """Batched and alone, trees of top-4 candidates give the target's greedy output token for token,
    move accepted off-chain paths' K/V (the case the chain never meets), and accept more per step
    than the chain with the same draft budget (at least as much with a threshold)."""
    pipe, prompts, ar = refs
    target, drafter = pipe.engine.target, pipe.engine.proposer.drafter
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    tree = DFlashProposer(drafter, target, draft_confidence=threshold, tree_topk=4)
    chain = DFlashProposer(drafter, target, draft_confidence=threshold)
    moves = []
    engine = Engine(target, tree)
    new_cache = target.new_cache

    def recording_cache(*args):
        cache = new_cache(*args)
        move = cache.move

        def recording_move(row, src, dst):
            moves.append(src != dst)
            move(row, src, dst)

        cache.move = recording_move
        return cache

    target.new_cache = recording_cache
    try:
        batched = engine.generate(prompts, params)
        alone = [engine.generate([p], params)[0] for p in prompts]
    finally:
        del target.new_cache
    assert [r.token_ids for r in batched] == ar
    assert [r.token_ids for r in alone] == ar
    assert any(moves)  # some accepted path left the first-child chain
    chained = [Engine(target, chain).generate([p], params)[0] for p in prompts]
    assert [r.token_ids for r in chained] == ar
    tree_steps = sum(r.metrics.verify_steps for r in alone)
    chain_steps = sum(r.metrics.verify_steps for r in chained)
    # same tokens in fewer target passes (a longer tau) with the same 15-draft budget; with a
    # threshold both cut, and the tree keeps every chain node the budget leaves room for
    assert tree_steps < chain_steps if threshold == 0.0 else tree_steps <= chain_steps
    for r in alone:
        m = r.metrics
        assert m.drafted_tokens <= 15 * m.verify_steps
        # a tree's position is a node's depth: every node counts once, several per depth and step
        assert sum(m.drafted_per_position) == m.drafted_tokens and sum(m.accepted_per_position) == m.accepted_tokens
        assert all(a <= d for a, d in zip(m.accepted_per_position, m.drafted_per_position))
    if threshold == 0.0:  # top-4 candidates at depth 1: more nodes there than steps
        assert any(r.metrics.drafted_per_position[0] > r.metrics.verify_steps for r in alone)


def test_sampling_rows_keep_the_chain_and_the_targets_distribution(tiny):  # noqa: F811
    """tree_topk applies to greedy rows only: a sampling request drafts a chain (parents 0, 1, 2, ...)
    and its output keeps the target's distribution."""
    target, drafter = tiny
    proposer = DFlashProposer(drafter, target, tree_topk=4)
    seen = record_drafts(proposer)
    p, rate = pvalue(Engine(target, proposer), CASES[0])
    assert 0.05 < rate < 0.95
    assert p > 0.001
    assert seen and all(drafts.parents is None for drafts in seen)  # no greedy row: no tree at all


def test_mixed_batch_trees_for_greedy_rows_chains_for_sampling_rows(refs):
    pipe, prompts, ar = refs
    target, drafter = pipe.engine.target, pipe.engine.proposer.drafter
    proposer = DFlashProposer(drafter, target, tree_topk=4)
    seen = record_drafts(proposer)
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3)]
    results = Engine(target, proposer).generate(prompts, params)
    assert results[0].token_ids == ar[0]
    assert len(results[1].token_ids) == MAX_TOKENS
    full = [d for d in seen if d.tokens.shape[0] == 2]
    assert full and all(d.parents is not None for d in full)
    for d in full:  # the sampling row's drafts form a chain, with its q for each
        assert d.parents[1].tolist() == list(range(d.parents.shape[1]))
        assert d.probs[1] is not None and d.probs[1].shape[0] == d.lengths[1]


def test_tiny_trees_in_ragged_batches_keep_greedy_parity(tiny):  # noqa: F811
    """A 6-token vocabulary and top-3 trees: most accepted paths leave the chain. Prompts of
    different lengths decode together (ragged starts, ragged tree sizes) and give each prompt's own
    greedy output."""
    target, drafter = tiny
    prompts = [[3, 1, 4, 1, 5][: 2 + i % 4] + [i % 6] for i in range(8)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ar = [Engine(target, None).generate([p], params, "ar")[0].token_ids for p in prompts]
    for threshold in (0.0, 0.05):
        engine = Engine(target, DFlashProposer(drafter, target, draft_confidence=threshold, tree_topk=3))
        results = engine.generate(prompts, params)
        assert [r.token_ids for r in results] == ar
        assert sum(r.metrics.accepted_tokens for r in results) > 0
