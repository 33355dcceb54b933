"""`max_concurrency`: while more requests than this are active the engine decodes them one token per
step, keeps feeding the drafter's context, and drafts again once enough have finished."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import ConfigError
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.proposer import CPU_MAX_CONCURRENCY, DFlashProposer, auto_max_concurrency
from dflash_trt.runtime.sampling import SamplingParams

CHAT = "Write a Python function that reverses a string."
SHORT, LONG = 6, 40


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_max_concurrency_must_be_a_positive_integer_or_none(smollm2_untrained, value):
    pipe = smollm2_untrained
    with pytest.raises(ConfigError, match=r'max_concurrency must be "auto", None \(always speculate\) or an integer >= 1'):
        DFlashProposer(pipe.engine.proposer.drafter, pipe.engine.target, max_concurrency=value)


def test_auto_max_concurrency_is_picked_by_the_targets_device(smollm2_untrained):
    pipe = smollm2_untrained
    drafter, target = pipe.engine.proposer.drafter, pipe.engine.target
    assert auto_max_concurrency("cpu") == CPU_MAX_CONCURRENCY == 1 and auto_max_concurrency("cuda") is None
    assert DFlashProposer(drafter, target, max_concurrency="auto").max_concurrency == 1
    assert DFlashProposer(drafter, target).max_concurrency is None  # the low-level default: always speculate


def run(pipe, max_concurrency, prompts, params):
    target, drafter = pipe.engine.target, pipe.engine.proposer.drafter
    proposer = DFlashProposer(drafter, target, max_concurrency=max_concurrency)
    results = Engine(target, proposer).generate(prompts, params)
    return results, proposer


def test_waits_while_busy_then_drafts_with_a_whole_context(smollm2_pipeline):
    """Two requests at max_concurrency 1: no drafts while both are active; once the short one stops,
    the long one drafts, and its drafter context equals that of a run that drafted throughout (the
    one-token steps injected their target features too). Output is the target's greedy output."""
    pipe = smollm2_pipeline
    prompt = pipe.encode_chat(CHAT)
    params = [SamplingParams(max_tokens=SHORT, ignore_eos=True), SamplingParams(max_tokens=LONG, ignore_eos=True)]
    ar = [pipe.engine.generate([prompt], p, "ar")[0].token_ids for p in params]
    limited, proposer = run(pipe, 1, [prompt, prompt], params)
    assert [r.token_ids for r in limited] == ar
    short, long = (r.metrics for r in limited)
    assert short.drafted_tokens == 0 and short.verify_steps == SHORT - 1  # one token per step
    assert long.accepted_tokens > 0 and long.verify_steps < LONG - 1  # drafted after the short one stopped
    free, reference = run(pipe, None, [prompt, prompt], params)
    assert [r.token_ids for r in free] == ar and free[0].metrics.drafted_tokens > 0
    # the long request's drafter context (its row is the last one left in both caches)
    n = len(prompt) + LONG - 1  # committed positions: the prompt and every token but the last
    for got, want in zip(proposer.cache.k + proposer.cache.v, reference.cache.k + reference.cache.v):
        assert torch.allclose(got[0, :, :n], want[0, :, :n], atol=1e-4)
        assert got[0, :, :n].abs().sum() > 0


def test_batch_of_one_speculates_at_max_concurrency_one(smollm2_pipeline):
    pipe = smollm2_pipeline
    prompt = pipe.encode_chat(CHAT)
    params = SamplingParams(max_tokens=LONG, ignore_eos=True)
    (limited,), _ = run(pipe, 1, [prompt], params)
    (free,), _ = run(pipe, None, [prompt], params)
    assert limited.token_ids == free.token_ids
    assert limited.metrics.verify_steps == free.metrics.verify_steps
    assert limited.metrics.accepted_tokens == free.metrics.accepted_tokens
