"""Lossless greedy decoding on the real model: DFlash output == autoregressive output, token for
token, with an UNTRAINED drafter (parity must not depend on drafter quality); batching is invisible."""

from __future__ import annotations

import random

import pytest

from dflash_trt.datasets import mt_bench_first_turns
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def mt_bench_prompts(smollm2_untrained):
    return [smollm2_untrained.encode_chat(q) for q in mt_bench_first_turns(20)]


@pytest.fixture(scope="module")
def ar_reference(smollm2_untrained, mt_bench_prompts):
    """Greedy autoregressive output of each prompt decoded ALONE (batch size 1)."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    return [smollm2_untrained.engine.generate([p], params, "ar")[0].token_ids for p in mt_bench_prompts]


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_dflash_equals_autoregressive_on_mt_bench(smollm2_untrained, mt_bench_prompts, ar_reference, block_size):
    target, drafter = smollm2_untrained.engine.target, smollm2_untrained.engine.proposer.drafter
    engine = Engine(target, DFlashProposer(drafter, target, block_size), smollm2_untrained.engine.eos_token_ids)
    results = engine.generate(mt_bench_prompts, SamplingParams(max_tokens=MAX_TOKENS), "dflash")
    for i, (res, ref) in enumerate(zip(results, ar_reference)):
        assert res.token_ids == ref, f"prompt {i} diverges at block size {block_size}"
        assert res.metrics.drafted_tokens == (block_size - 1) * res.metrics.verify_steps


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_batch_of_8_equals_batch_of_1_in_any_order(smollm2_untrained, mt_bench_prompts, ar_reference, mode):
    engine = smollm2_untrained.engine
    prompts = mt_bench_prompts[:8]
    assert len({len(p) for p in prompts}) > 4  # really different lengths
    params = SamplingParams(max_tokens=MAX_TOKENS)
    order = list(range(8))
    random.Random(0).shuffle(order)
    for idx in (list(range(8)), order):
        results = engine.generate([prompts[i] for i in idx], params, mode)
        assert [r.token_ids for r in results] == [ar_reference[i] for i in idx]


@pytest.mark.slow
def test_sampled_batch_equals_each_request_alone(smollm2_untrained, mt_bench_prompts):
    """Per-request RNG: a seeded request samples the same tokens alone or inside a batch."""
    engine = smollm2_untrained.engine
    prompts = mt_bench_prompts[8:12]
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=100 + i) for i in range(4)]
    alone = [engine.generate([p], [sp], "dflash")[0].token_ids for p, sp in zip(prompts, params)]
    together = [r.token_ids for r in engine.generate(prompts[::-1], params[::-1], "dflash")][::-1]
    assert together == alone
