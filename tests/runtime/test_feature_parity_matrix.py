"""Exactness of DFlash in feature combinations the per-feature tests leave out: a reduced draft vocabulary (the
shipped drafter's: 8192 of SmolLM2's 49152 ids) under sampling, logits processing and guided decoding; sampling with
stop tokens and min_tokens inside a block; sampled rows among greedy tree / prompt-lookup / processed rows; and the
logprobs of every mode against a fresh forward of the emitted tokens. Greedy decoding must give the target's own
tokens, sampling the target's own distribution (chi-square against the exact joint, `test_sampling_distribution`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_trt.models.checkpoints import init_drafter, load_drafter, new_drafter_config
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.guided import GuidedDecoding
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams
from tests.runtime.test_guided import guided_pvalue, tiny_engine
from tests.runtime.test_penalties import SAMPLED, sampled_pvalue
from tests.runtime.test_sampling_distribution import CASES, pvalue, tiny  # noqa: F401 (tiny: a fixture)

#: the tiny drafter's draft vocabulary: 4 of the 6 target ids; neither 2 ("c") nor 5 (the stop token) is a draft
DRAFT_IDS = [0, 1, 3, 4]


@pytest.fixture(scope="module")
def tiny_draft_vocab(tiny, tmp_path_factory):  # noqa: F811
    """(target, drafter): the tiny target and a drafter drafting only DRAFT_IDS (d2t: target id = draft id +
    d2t[draft id]), with the tiny drafter's sharp q."""
    target, _ = tiny
    cfg = new_drafter_config(target.config, 1, 4, mask_token_id=0, target_layer_ids=[1, 3])
    cfg = cfg.replace(draft_vocab_size=len(DRAFT_IDS))
    drafter = load_drafter(init_drafter(cfg, tmp_path_factory.mktemp("dv") / "drafter", seed=2))
    with torch.no_grad():
        drafter.d2t.copy_(torch.tensor(DRAFT_IDS) - torch.arange(len(DRAFT_IDS)))
        for n, p in drafter.named_parameters():
            if "norm" not in n:
                p.mul_(10)
    assert drafter.draft_token_ids().tolist() == DRAFT_IDS
    return target, drafter


# ------------------------------------------------------------------------------ a reduced draft vocabulary

@pytest.mark.parametrize("sample_drafts", [True, False], ids=["sampled-drafts", "argmax-drafts"])
def test_sampling_with_a_reduced_draft_vocabulary_matches_target(tiny_draft_vocab, sample_drafts):
    """q lives on the draft ids only (0 elsewhere): the target's tokens outside them come from the residual."""
    target, drafter = tiny_draft_vocab
    engine = Engine(target, DFlashProposer(drafter, target, sample_drafts=sample_drafts))
    p, rate = pvalue(engine, CASES[0])
    assert 0.02 < rate < 0.95
    assert p > 0.001


def test_processed_sampling_with_a_reduced_draft_vocabulary_matches_target(tiny_draft_vocab):
    """Logit bias, penalties, min_tokens and min_p with drafts processed through the draft ids and back."""
    target, drafter = tiny_draft_vocab
    p, impossible, rate = sampled_pvalue(Engine(target, DFlashProposer(drafter, target)), SAMPLED)
    assert impossible == 0 and p > 0.001 and rate > 0.01


@pytest.mark.parametrize("sample_drafts", [True, False], ids=["sampled-drafts", "argmax-drafts"])
def test_guided_sampling_where_the_grammar_allows_no_draft_token(tiny_draft_vocab, sample_drafts):
    """Once the tiny grammar is complete it allows only the stop token 5, which is not a draft token: those draft
    positions have no q to sample from. The drafts end before them, and the output keeps the masked distribution."""
    engine = tiny_engine(tiny_draft_vocab, sample_drafts)
    p, impossible, rate = guided_pvalue(engine)
    assert 0.01 < rate < 0.95
    assert impossible == 0 and p > 0.001


@pytest.mark.slow
def test_smollm2_guided_sampling_of_tokens_outside_the_draft_vocabulary(smollm2_pipeline):
    """The shipped drafter drafts 8192 of SmolLM2's ids; a regex of Japanese text allows only tokens outside them
    at most positions. Sampled (dflash) requests follow it as the autoregressive ones do, and greedy dflash gives
    the autoregressive tokens."""
    pipe = smollm2_pipeline
    text = "日本語ですね"
    prompt = pipe.encode_chat("Write a word in Japanese.")
    greedy = SamplingParams(max_tokens=20, guided=GuidedDecoding(regex=text))
    ar = pipe.engine.generate([prompt], greedy, "ar")[0]
    assert pipe.engine.generate([prompt], greedy, "dflash")[0].token_ids == ar.token_ids
    assert ar.finish_reason == "stop"
    sampled = [dataclasses.replace(greedy, temperature=1.0, seed=s) for s in range(3)]
    for r in pipe.engine.generate([prompt] * 3, sampled, "dflash"):
        assert r.finish_reason == "stop" and pipe.decode(r.token_ids) == text


