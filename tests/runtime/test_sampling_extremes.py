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


def test_a_huge_temperature_keeps_top_k_and_top_p_to_the_top_logits():
    """A temperature beyond float32's range (1e40: logits / T rounded to 0) or near its top (1e30, 1e38: the
    probabilities round to equal values) made top-k 1 keep every token (uniform, random text); the filters now
    rank by the logits, so top-k keeps the k largest and top-p a prefix of the logits' order, near uniform."""
    torch.manual_seed(0)
    vocab = 49152  # SmolLM2's: at 1e40 its top logits rounded to the same subnormal value
    logits = torch.randn(3, vocab) * 3
    rank = logits.argsort(-1, descending=True)
    for temperature in (1e30, 1e38, 1e40, 1e300):
        probs = probs_from_logits(logits, SamplingParams(temperature=temperature, top_k=1))
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()), temperature
        probs = probs_from_logits(logits, SamplingParams(temperature=temperature, top_k=5))
        assert torch.isfinite(probs).all() and torch.allclose(probs.gather(-1, rank[:, :5]), torch.full((3, 5), 0.2))
        assert (probs.gather(-1, rank[:, 5:]) == 0).all()
        probs = probs_from_logits(logits, SamplingParams(temperature=temperature, top_p=0.25))
        kept = (probs > 0).sum(-1)
        assert ((kept >= vocab // 4) & (kept <= vocab // 4 + 2)).all(), kept  # a quarter of a near-uniform vocab
        for row, n in enumerate(kept.tolist()):
            assert (probs[row, rank[row, :n]] > 0).all() and torch.allclose(probs[row, rank[row, :n]].sum(), torch.tensor(1.0))
