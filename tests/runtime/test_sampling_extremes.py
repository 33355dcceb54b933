"""Sampling parameters at the edge of float32: a temperature so small that logits / T overflows, a top_p that
rounds to 0. Both are valid requests and must sample the top token, not fail on NaN probabilities."""

from __future__ import annotations

import torch

from dflash_trt.runtime.sampling import SamplingParams, probs_from_logits


def test_tiny_temperature_and_top_p_give_the_top_token():
    torch.manual_seed(0)
    logits = torch.randn(3, 100) * 8
    for temperature, top_p in ((1e-40, 1.0), (1e-45, 1.0), (1e-50, 1.0), (1e-300, 0.5), (0.8, 1e-300), (1e-38, 1e-300)):
        probs = probs_from_logits(logits, SamplingParams(temperature=temperature, top_p=top_p))
        assert torch.isfinite(probs).all()
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 100).float())


def test_moderate_temperature_is_unchanged():
    logits = torch.randn(2, 64) * 3
    probs = probs_from_logits(logits, SamplingParams(temperature=0.7))
    assert torch.equal(probs, torch.softmax(logits / 0.7, dim=-1))


def test_a_tiny_temperature_decodes_the_greedy_answer(smollm2_pipeline):
    pipe = smollm2_pipeline
    prompt = pipe.encode_chat("Name three colors.")
    [greedy] = pipe.generate([prompt], SamplingParams(max_tokens=16))
    [tiny] = pipe.generate([prompt], SamplingParams(max_tokens=16, temperature=1e-40, seed=3))
    assert tiny.token_ids == greedy.token_ids
