"""Prompt lookup (`prompt_lookup` > 0): candidates copied from the request's own context join the
draft tree as one more branch; greedy output stays the target's own."""

from __future__ import annotations

import functools
import random

import pytest
import torch

import dflash_trt.runtime.decode_batch as decode_batch_mod
from dflash_trt.errors import ConfigError
from dflash_trt.runtime.draft_tree import add_path, build_tree
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.prompt_lookup import NgramIndex
from dflash_trt.runtime.proposer import CPU_PROMPT_LOOKUP, DFlashProposer, auto_prompt_lookup
from dflash_trt.runtime.sampling import SamplingParams
from tests.runtime.oracle import record_drafts
from tests.runtime.test_sampling_distribution import CASES, pvalue, tiny  # noqa: F401 (fixture)

#: a chat the target answers by copying its prompt: long n-gram matches
COPY_CHAT = ("Repeat the following list exactly as written, then stop: apples, pears, plums, cherries, "
             "grapes, lemons, limes, melons, peaches, apricots.")
CHATS = [COPY_CHAT, "Write a Python function that reverses a string."]
MAX_TOKENS = 32


def brute_force_lookup(tokens: list[int], num: int, max_n: int, min_n: int) -> list[int]:
    """The definition, by scanning: the longest suffix n-gram's latest earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + num]
    return []


def test_lookup_takes_the_longest_suffix_match_at_its_latest_occurrence():
    a, b = 100, 200
    # the 4-gram (1, 5, 6, 7) occurred at 0 (then a); the 3-gram (5, 6, 7) last at 6 (then b): 4 wins
    index = NgramIndex([1, 5, 6, 7, a, 2, 5, 6, 7, b, 1, 5, 6, 7], max_n=4, min_n=3)
    assert index.lookup(3) == [a, 2, 5]
    index = NgramIndex([1, 5, 6, 7, a, 2, 5, 6, 7, b, 9, 5, 6, 7], max_n=4, min_n=3)
    assert index.lookup(2) == [b, 9]  # only the 3-gram matches: its latest occurrence
    assert NgramIndex([1, 2, 3, 4], max_n=4, min_n=3).lookup(4) == []  # no earlier occurrence
    index = NgramIndex([7, 7, 7, 7], max_n=3, min_n=3)
    assert index.lookup(5) == [7]  # overlapping with the suffix itself; cut at the history's end
    index.extend([8])
    assert index.lookup(5) == []
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramIndex([], max_n=2, min_n=3)


def test_incremental_index_matches_the_definition():
    rng = random.Random(0)
    for trial in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        max_n, min_n = rng.choice([(4, 3), (3, 1), (2, 2), (5, 1)])
        index = NgramIndex(tokens[:5], max_n, min_n)
        for cut in range(5, len(tokens) + 1):
            index.extend(tokens[len(index.tokens) : cut])
            assert index.lookup(6) == brute_force_lookup(tokens[:cut], 6, max_n, min_n), (trial, cut)


def test_add_path_merges_a_candidate_into_a_tree_within_the_budget():
    tokens, parents = build_tree([[0.6, 0.3], [0.7, 0.2]], [[10, 11], [20, 21]], 6)
    assert (tokens, parents) == ([10, 20, 11, 20, 21, 21], [0, 1, 0, 3, 1, 3])
    # room: the shared prefix 10-20 reuses nodes 1-2, 30 goes under node 2
    assert add_path(tokens, parents, [10, 20, 30], 8) == (tokens + [30], parents + [2])
    # full: the tree's last chosen node (21 under 11) makes room for 30 under 11-20 (node 4)
    assert add_path(tokens, parents, [11, 20, 30], 6) == ([10, 20, 11, 20, 21, 30], [0, 1, 0, 3, 1, 4])
    # a new branch of two under the root: the last two tree nodes go
    assert add_path(tokens, parents, [12, 13], 6) == ([10, 20, 11, 20, 12, 13], [0, 1, 0, 3, 0, 5])
    assert add_path([], [], [1, 2, 3], 2) == ([1, 2], [0, 1])  # the path itself cut to the budget
    assert add_path(tokens, parents, [], 6) == (tokens, parents)


@pytest.mark.parametrize("value", [-1, 16, 2.0, True, "8"])
def test_prompt_lookup_must_be_an_integer_within_max_draft_len(smollm2_untrained, value):
    pipe = smollm2_untrained
    with pytest.raises(ConfigError, match=r'prompt_lookup must be "auto" or an integer in \[0, max_draft_len = 15\]'):
        DFlashProposer(pipe.engine.proposer.drafter, pipe.engine.target, prompt_lookup=value)


def test_auto_prompt_lookup_is_picked_by_the_targets_device(smollm2_untrained):
    pipe = smollm2_untrained
    drafter, target = pipe.engine.proposer.drafter, pipe.engine.target
    assert auto_prompt_lookup("cpu") == CPU_PROMPT_LOOKUP > 0 and auto_prompt_lookup(torch.device("cuda:0")) == 0
    assert DFlashProposer(drafter, target, prompt_lookup="auto").prompt_lookup == CPU_PROMPT_LOOKUP
    assert DFlashProposer(drafter, target, max_draft_len=3, prompt_lookup="auto").prompt_lookup == 3
    assert DFlashProposer(drafter, target).prompt_lookup == 0  # the low-level default: the paper's DFlash


@pytest.fixture(scope="module")
def refs(smollm2_pipeline):
    pipe = smollm2_pipeline
    prompts = [pipe.encode_chat(c) for c in CHATS]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ar = [pipe.engine.generate([p], params, "ar")[0].token_ids for p in prompts]
    return pipe, prompts, ar


def test_lookup_alone_is_lossless_and_accepts_copied_tokens(refs, smollm2_untrained):
    """With an untrained drafter (its drafts are ~never accepted) every accepted draft comes from the
    lookup: the copy prompt accepts many, and the output is the target's greedy output, batched and
    alone."""
    pipe, prompts, ar = refs
    untrained = smollm2_untrained.engine.proposer.drafter
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    target = pipe.engine.target
    off = Engine(target, DFlashProposer(untrained, target, prompt_lookup=0))
    on = Engine(target, DFlashProposer(untrained, target, prompt_lookup=8))
    alone = [on.generate([p], params)[0] for p in prompts]
    assert [r.token_ids for r in alone] == ar
    assert [r.token_ids for r in on.generate(prompts, params)] == ar
    baseline = [off.generate([p], params)[0] for p in prompts]
    assert [r.token_ids for r in baseline] == ar
    assert baseline[0].metrics.accepted_tokens <= 2
    assert alone[0].metrics.accepted_tokens >= 10  # copied from the prompt
    assert alone[0].metrics.verify_steps < baseline[0].metrics.verify_steps


def test_lookup_joins_the_drafters_tree(refs):
    """With the default drafter: the same tokens in fewer verify steps than without the lookup; the
    copied tokens sit in the tree (parents given) within max_draft_len nodes."""
    pipe, prompts, ar = refs
    target, drafter = pipe.engine.target, pipe.engine.proposer.drafter
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for topk, threshold in ((1, 0.0), (4, 0.2)):
        plain = Engine(target, DFlashProposer(drafter, target, draft_confidence=threshold, tree_topk=topk))
        proposer = DFlashProposer(drafter, target, draft_confidence=threshold, tree_topk=topk, prompt_lookup=15)
        seen = record_drafts(proposer)
        looked = Engine(target, proposer)
        with_lookup = looked.generate([prompts[0]], params)[0]
        without = plain.generate([prompts[0]], params)[0]
        assert with_lookup.token_ids == without.token_ids == ar[0]
        assert with_lookup.metrics.verify_steps < without.metrics.verify_steps
        assert seen and all(d.parents is not None for d in seen)
        assert all(max(d.lengths) <= 15 for d in seen)


def test_sampling_rows_draft_the_copied_chain(refs):
    """In a mixed batch the greedy row gets a tree, the sampling row a chain: the copied tokens (q
    one-hot, probs None) at steps where the lookup matched, else its drafts sampled from q."""
    pipe, prompts, ar = refs
    target, drafter = pipe.engine.target, pipe.engine.proposer.drafter
    proposer = DFlashProposer(drafter, target, prompt_lookup=8)
    seen = record_drafts(proposer)
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0.1, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3)]
    results = Engine(target, proposer).generate([prompts[0], prompts[0]], params)
    assert results[0].token_ids == ar[0] and len(results[1].token_ids) == MAX_TOKENS
    full = [d for d in seen if d.tokens.shape[0] == 2]
    assert full
    for d in full:
        assert d.parents[1].tolist() == list(range(d.parents.shape[1]))
        assert d.probs[1] is None or d.probs[1].shape[0] == d.lengths[1]
    assert any(d.probs[1] is None and d.lengths[1] > 0 for d in full)  # copied
    assert results[1].metrics.accepted_tokens > 0


def test_sampling_with_copied_drafts_keeps_the_targets_distribution(tiny, monkeypatch):  # noqa: F811
    """Copied drafts are argmax drafts to speculative sampling (q one-hot): each is accepted with the
    target's probability, so the output keeps the target's distribution (chi-square over all 6**3
    three-token sequences; 1-2-gram matches so that a 6-token vocabulary matches often)."""
    target, drafter = tiny
    monkeypatch.setattr(decode_batch_mod, "NgramIndex", functools.partial(NgramIndex, max_n=2, min_n=1))
    proposer = DFlashProposer(drafter, target, prompt_lookup=2)
    seen = record_drafts(proposer)
    p, rate = pvalue(Engine(target, proposer), CASES[0])
    assert 0.05 < rate < 0.95
    assert p > 0.001
    copied = sum(1 for d in seen for q, m in zip(d.probs, d.lengths) if q is None and m > 0)
    sampled = sum(1 for d in seen for q in d.probs if q is not None)
    assert copied > 100 and sampled > 100  # both kinds of drafts were verified
