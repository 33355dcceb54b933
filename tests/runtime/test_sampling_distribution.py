"""End to end: DFlash sampling keeps exactly the target's distribution (temperature 1, with top-k
and top-p), for argmax drafts and sampled drafts; a wrong verifier is caught by the same test."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

import dflash_trt.runtime.engine as engine_mod
from dflash_trt.config import TargetConfig
from dflash_trt.models.checkpoints import init_drafter, load_drafter, load_target, new_drafter_config
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams, probs_from_logits
from tests.conftest import make_hf_model
from tests.runtime.test_verifier import wrong_verifier

VOCAB, PROMPT, N = 6, [3, 1, 4, 1, 5], 3000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    _, folder = make_hf_model(tmp, "llama", vocab=VOCAB, seed=5)
    target = load_target(folder)
    dcfg = new_drafter_config(TargetConfig.from_pretrained(folder), 1, 4, mask_token_id=0, target_layer_ids=[1, 3])
    drafter = load_drafter(init_drafter(dcfg, tmp / "drafter", seed=2))
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            if "norm" not in n:
                p.mul_(10)  # a sharper (still wrong) draft distribution q
    return target, drafter


def exact_joint(target, params, process=None):
    """P(t1, t2, t3 | prompt) under the shaped target distribution, over all VOCAB**3 sequences; `process`,
    if given, maps (ids [1, t], logits [1, V]) to the logits to shape (a reference logits processing)."""
    def dist(seq):
        ids = torch.tensor([seq])
        cache = target.new_cache(1, len(seq))
        out = target(ids, torch.arange(len(seq))[None], cache, len(seq))
        logits = out.logits[0, -1:].float().clone()
        return probs_from_logits(logits if process is None else process(ids, logits), params)[0]

    joint = {}
    p1 = dist(PROMPT)
    for a in range(VOCAB):
        p2 = dist(PROMPT + [a])
        for b in range(VOCAB):
            p3 = dist(PROMPT + [a, b])
            for c in range(VOCAB):
                joint[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return joint


def scaled_pvalue_and_rate(observed: list[int], expected: list[float], results) -> tuple[float, float]:
    """(chi-square p-value of `observed` against `expected` rescaled to the same total, acceptance rate of the
    GenerationResults `results`: accepted / drafted tokens)."""
    scale = sum(observed) / sum(expected)  # float32 probabilities sum to 1 only up to ~1e-7
    accepted = sum(r.metrics.accepted_tokens for r in results)
    drafted = sum(r.metrics.drafted_tokens for r in results)
    return chisquare(observed, [e * scale for e in expected]).pvalue, accepted / max(drafted, 1)


def pvalue(engine, params, mode="dflash"):
    batch = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, max_tokens=3,
                            ignore_eos=True, seed=i) for i in range(N)]
    results = engine.generate([PROMPT] * N, batch, mode)
    counts = {k: 0 for k in itertools.product(range(VOCAB), repeat=3)}
    for r in results:
        counts[tuple(r.token_ids)] += 1
    with torch.no_grad():
        joint = exact_joint(engine.target, params)
    obs, exp, pooled_o, pooled_e = [], [], 0.0, 0.0
    for k, pk in joint.items():
        if pk == 0:
            assert counts[k] == 0, f"{k} is outside the top-k/top-p support but was emitted"
        elif pk * N >= 5:
            obs.append(counts[k])
            exp.append(pk * N)
        else:  # pool rare sequences into one cell
            pooled_o += counts[k]
            pooled_e += pk * N
    if pooled_e > 0:
        obs.append(pooled_o)
        exp.append(pooled_e)
    assert len(obs) >= 10, "too few cells for a meaningful test"
    return scaled_pvalue_and_rate(obs, exp, results)


CASES = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=3),
         SamplingParams(temperature=2.0, top_p=0.8)]


@pytest.mark.parametrize("sample_drafts", [True, False], ids=["sampled-drafts", "argmax-drafts"])
@pytest.mark.parametrize("params", CASES, ids=["t1", "t1-topk3", "t2-topp0.8"])
def test_dflash_sampling_matches_target(tiny, params, sample_drafts):
    target, drafter = tiny
    engine = Engine(target, DFlashProposer(drafter, target, sample_drafts=sample_drafts))
    p, rate = pvalue(engine, params)
    assert 0.05 < rate < 0.95  # drafts are neither always rejected nor always accepted: both paths run
    assert p > 0.001


@pytest.mark.parametrize("max_draft_len", [1, 2])
def test_sampling_with_max_draft_len_matches_target(tiny, max_draft_len):
    """Verifying only the first drafts of the block keeps the distribution (q sliced with the drafts)."""
    target, drafter = tiny
    engine = Engine(target, DFlashProposer(drafter, target, max_draft_len=max_draft_len))
    p, rate = pvalue(engine, CASES[0])
    assert 0.05 < rate < 0.95
    assert p > 0.001


@pytest.mark.parametrize("sample_drafts", [True, False], ids=["sampled-drafts", "argmax-drafts"])
def test_wrong_verifier_fails_the_same_test(tiny, monkeypatch, sample_drafts):
    target, drafter = tiny
    monkeypatch.setattr(engine_mod, "speculative_sample", wrong_verifier)
    engine = Engine(target, DFlashProposer(drafter, target, sample_drafts=sample_drafts))
    p, _ = pvalue(engine, CASES[0])
    assert p < 1e-6
