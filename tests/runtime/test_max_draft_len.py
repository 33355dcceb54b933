"""max_draft_len (TensorRT-LLM's knob): the target verifies only the first k drafts of each block.

Output stays the target's own (greedy) for every k, the counts follow k exactly (an oracle whose
drafts are all right accepts k per step), and bad values are refused with the valid range."""

from __future__ import annotations

import pytest

from dflash_trt.errors import ConfigError
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams
from tests.runtime.oracle import OracleProposer, chat_references

MAX_TOKENS = 24
CHATS = ["Write a short poem about the sea.", "Name three colours."]


@pytest.fixture(scope="module")
def refs(smollm2_untrained):
    return chat_references(smollm2_untrained, CHATS, MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 7])
def test_oracle_accepts_exactly_max_draft_len_per_step(refs, k):
    pipe, prompts, ar = refs
    oracle = OracleProposer([p + r for p, r in zip(prompts, ar)], 16, max_draft_len=k)
    engine = Engine(pipe.engine.target, oracle)
    results = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), "dflash")
    for res, ref in zip(results, ar):
        assert res.token_ids == ref
        m = res.metrics
        # prefill gives token 1; each step then commits k accepted drafts + 1 target token
        assert m.verify_steps == -(-(MAX_TOKENS - 1) // (k + 1))
        assert m.drafted_tokens == k * m.verify_steps
        assert len(m.accepted_per_position) == k
        assert m.accepted_per_position[0] == m.verify_steps
        assert m.drafted_per_position == [m.verify_steps] * k  # a chain's position j + 1: its j + 1-th draft


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4])
def test_drafter_with_max_draft_len_is_lossless(refs, k):
    pipe, prompts, ar = refs
    target, drafter = pipe.engine.target, pipe.engine.proposer.drafter
    proposer = DFlashProposer(drafter, target, 16, max_draft_len=k)
    results = Engine(target, proposer).generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [r.token_ids for r in results] == ar
    assert all(r.metrics.drafted_tokens == k * r.metrics.verify_steps for r in results)


@pytest.mark.parametrize("block, k", [(16, 0), (16, 16), (4, 5)])
def test_max_draft_len_out_of_range_is_refused(smollm2_untrained, block, k):
    pipe = smollm2_untrained
    with pytest.raises(ConfigError, match=rf"max_draft_len must be in \[1, block_size - 1 = {block - 1}\]"):
        DFlashProposer(pipe.engine.proposer.drafter, pipe.engine.target, block, max_draft_len=k)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_draft_len": 16}, r"max_draft_len must be in \[1, block_size - 1 = 15\], got 16"),  # the drafter's block 16
    ({"block_size": 1}, r"block size must be >= 2, got 1"),
    ({"max_draft_len": 4, "prompt_lookup": 5}, r"integer in \[0, max_draft_len = 4\] \(0 = off\), got 5"),
])
def test_load_pipeline_refuses_draft_lengths_before_weights_load(monkeypatch, smollm2_path, untrained_drafter,
                                                                   kwargs, match):
    """A max_draft_len the drafter's own block cannot hold (no --block-size given) is refused from the
    configs, before either model's weights load (it used to load the target first)."""
    import dflash_trt.models.checkpoints as checkpoints
    from dflash_trt.api import load_pipeline

    def no_load(*args, **kwargs):
        raise AssertionError("weights loaded before the draft length was checked")

    monkeypatch.setattr(checkpoints, "load_target", no_load)
    monkeypatch.setattr(checkpoints, "load_drafter", no_load)
    with pytest.raises(ConfigError, match=match):
        load_pipeline(smollm2_path, untrained_drafter, **kwargs)
