"""Stop checks on every emitted token, max_tokens, context limits and the acceptance counters."""

from __future__ import annotations

import pytest

from dflash_trt.config import TargetConfig
from dflash_trt.errors import InvalidRequestError, PromptTooLongError
from dflash_trt.models.checkpoints import init_drafter, load_drafter, load_target, new_drafter_config
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams
from tests.conftest import make_hf_model
from tests.runtime.oracle import OracleProposer

CHAT = "Write a short poem about the sea."


def check_counters(res, block_size):
    m = res.metrics
    assert m.completion_tokens == len(res.token_ids)
    assert 0 <= m.accepted_tokens <= max(m.completion_tokens - 1, 0)
    assert sum(m.accepted_per_position) == m.accepted_tokens
    assert m.drafted_tokens == (block_size - 1) * m.verify_steps
    assert 0.0 <= m.acceptance_rate <= 1.0


@pytest.fixture(scope="module")
def greedy_ref(smollm2_untrained):
    pipe = smollm2_untrained
    prompt = pipe.encode_chat(CHAT)
    ref = pipe.engine.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True), "ar")[0].token_ids
    return pipe, prompt, ref


@pytest.mark.parametrize("proposer", ["drafter", "oracle", "oracle-wrong-3"])
def test_eos_inside_a_block_cuts_the_output(greedy_ref, proposer):
    pipe, prompt, ref = greedy_ref
    eos = ref[12]  # a token the greedy output really produces
    first = ref.index(eos)
    engine = pipe.engine
    if proposer != "drafter":
        wrong = (3,) if proposer.endswith("3") else ()
        engine = Engine(pipe.engine.target, OracleProposer([prompt + ref], 16, wrong))
    res = engine.generate([prompt], SamplingParams(max_tokens=40, stop_token_ids=(eos,)), "dflash")[0]
    assert res.token_ids == ref[: first + 1] and res.token_ids.count(eos) == 1
    assert res.finish_reason == "stop"
    check_counters(res, 16)
    if proposer == "oracle":  # every draft is right: the EOS lands inside an accepted block
        assert res.metrics.verify_steps == 1 and res.metrics.accepted_tokens == first  # the EOS was a draft


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
@pytest.mark.parametrize("proposer", ["drafter", "oracle"])
def test_max_tokens_smaller_than_the_block(greedy_ref, max_tokens, proposer):
    pipe, prompt, ref = greedy_ref
    engine = pipe.engine if proposer == "drafter" else Engine(pipe.engine.target, OracleProposer([prompt + ref], 16))
    res = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True), "dflash")[0]
    assert res.token_ids == ref[:max_tokens] and res.finish_reason == "length"
    check_counters(res, 16)
    if proposer == "oracle":
        assert res.metrics.accepted_tokens == max_tokens - 1  # nothing counted past max_tokens


def test_partial_acceptance_counts(greedy_ref):
    pipe, prompt, ref = greedy_ref
    engine = Engine(pipe.engine.target, OracleProposer([prompt + ref], 8, wrong_positions=(5,)))
    res = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True), "dflash")[0]
    assert res.token_ids == ref[:30]
    check_counters(res, 8)
    # each full step accepts drafts 1..4 and the target corrects draft 5: 5 tokens per step
    assert res.metrics.accepted_per_position[:4] == [res.metrics.verify_steps] * 4
    assert res.metrics.accepted_per_position[4:] == [0, 0, 0]


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ctx")
    _, folder = make_hf_model(tmp, "llama", max_position_embeddings=24)
    target = load_target(folder)
    dcfg = new_drafter_config(TargetConfig.from_pretrained(folder), 1, 4, 95, [1, 2])
    drafter = load_drafter(init_drafter(dcfg.replace(max_position_embeddings=16), tmp / "d"))
    return target, drafter


def test_context_limit_and_short_drafter_context(short_context):
    target, drafter = short_context
    engine = Engine(target, DFlashProposer(drafter, target))
    prompt = list(range(3, 13))
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    ar = engine.generate([prompt], params, "ar")[0]
    sd = engine.generate([prompt], params, "dflash")[0]
    assert len(ar.token_ids) == 24 - 10 and ar.finish_reason == "length"  # cut short of max_tokens
    # drafting stops where a block would pass the drafter's 16 positions; decoding goes on to 24
    assert sd.token_ids == ar.token_ids and sd.finish_reason == "length"
    assert sd.metrics.drafted_tokens < 3 * sd.metrics.verify_steps
    exact = engine.generate([prompt], SamplingParams(max_tokens=14, ignore_eos=True), "ar")[0]
    assert exact.token_ids == ar.token_ids and exact.finish_reason == "length"  # max_tokens met: not cut


def test_huge_max_tokens_allocates_only_the_context(short_context, monkeypatch):
    target, drafter = short_context
    engine = Engine(target, DFlashProposer(drafter, target))
    sizes = []
    new_cache = target.new_cache
    monkeypatch.setattr(target, "new_cache", lambda batch, capacity: sizes.append(capacity) or new_cache(batch, capacity))
    res = engine.generate([list(range(3, 13))], SamplingParams(max_tokens=10**12, ignore_eos=True), "dflash")[0]
    assert res.finish_reason == "length" and len(res.token_ids) == 24 - 10
    assert sizes == [24 + 4 + 1]  # context + one block + 1, not prompt + max_tokens


def test_bad_requests(short_context):
    target, drafter = short_context
    engine = Engine(target, DFlashProposer(drafter, target))
    with pytest.raises(PromptTooLongError, match="prompt of 24 tokens .* context of 24 tokens"):
        engine.generate([[5] * 24])
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        engine.generate([[]])
    with pytest.raises(InvalidRequestError, match=r"prompt 0 holds token id 96 \(at position 1\), outside the "
                                                  r"target's vocabulary \[0, 96\)"):
        engine.generate([[5, 96]])
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
