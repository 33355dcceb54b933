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
from dflash_trt.runtime.sampling import SamplingParams, probs_from_logits
from tests.runtime.test_guided import guided_pvalue, tiny_engine
from tests.runtime.test_penalties import SAMPLED, hf_processors, sampled_pvalue
from tests.runtime.test_sampling_distribution import (  # noqa: F401 (tiny: a fixture)
    CASES, N, PROMPT, pvalue, scaled_pvalue_and_rate, tiny)

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

SLOW_ARGMAX = pytest.param(False, id="argmax-drafts", marks=pytest.mark.slow)


@pytest.mark.parametrize("sample_drafts", [pytest.param(True, id="sampled-drafts"), SLOW_ARGMAX])
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


@pytest.mark.parametrize("sample_drafts", [pytest.param(True, id="sampled-drafts"), SLOW_ARGMAX])
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



# ------------------------------------------------ sampling: stop tokens and min_tokens inside a block, mixed batches

#: temperature 1 with the stop token 5 made likely (a +1.5 bias), held back for the first token (min_tokens 1):
#: outputs end at 5 at their second or third token, or run to max_tokens 3
STOPPING = SamplingParams(temperature=1.0, top_k=5, logit_bias={5: 1.5}, min_tokens=1, max_tokens=3,
                          stop_token_ids=(5,))


def stopping_joint(target, params) -> dict[tuple, float]:
    """P(output | PROMPT) of every output under `params` (logit bias, min_tokens, top-k, temperature; HF's
    processors): an output ends at the stop token 5 or after 3 tokens."""
    procs = hf_processors(params, len(PROMPT), params.stop_token_ids)

    def dist(seq):
        ids = torch.tensor([seq])
        cache = target.new_cache(1, len(seq))
        logits = target(ids, torch.arange(len(seq))[None], cache, len(seq)).logits[0, -1:].float().clone()
        return probs_from_logits(procs(ids, logits), params)[0].tolist()

    joint: dict[tuple, float] = {}

    def walk(out: tuple, prob: float) -> None:
        if (out and out[-1] == 5) or len(out) == params.max_tokens:
            joint[out] = prob
            return
        for t, pt in enumerate(dist(PROMPT + list(out))):
            if pt > 0:
                walk(out + (t,), prob * pt)

    with torch.no_grad():
        walk((), 1.0)
    return joint


def stopping_pvalue(engine, batch_extra=()) -> tuple[float, int, float, list]:
    """(chi-square p-value of N seeded STOPPING samples against `stopping_joint`, outputs of probability 0, the
    acceptance rate, the results of `batch_extra`: (prompt, params) requests decoded in the same batch)."""
    params = [dataclasses.replace(STOPPING, seed=i) for i in range(N)]
    results = engine.generate([PROMPT] * N + [p for p, _ in batch_extra], params + [sp for _, sp in batch_extra],
                              "dflash")
    mine = results[:N]
    joint = stopping_joint(engine.target, STOPPING)
    assert sum(1 for k in joint if k[-1] == 5) >= 10  # many outputs end at the stop token
    counts = dict.fromkeys(joint, 0)
    impossible = 0
    for r in mine:
        key = tuple(r.token_ids)
        if key in counts:
            counts[key] += 1
        else:
            impossible += 1
    obs, exp, pooled_o, pooled_e = [], [], 0, 0.0
    for k, pk in joint.items():
        if pk * N >= 5:
            obs.append(counts[k])
            exp.append(pk * N)
        else:  # pool rare outputs into one cell
            pooled_o += counts[k]
            pooled_e += pk * N
    obs.append(pooled_o)
    exp.append(pooled_e)
    p, rate = scaled_pvalue_and_rate(obs, exp, mine)
    return p, impossible, rate, results[N:]


@pytest.mark.parametrize("kw", [pytest.param(dict(), id="chain", marks=pytest.mark.slow),
                                pytest.param(dict(draft_confidence=0.3), id="confidence", marks=pytest.mark.slow),
                                pytest.param(dict(max_draft_len=2, tree_topk=3), id="short+trees")])
def test_sampling_that_stops_inside_a_block_keeps_the_distribution(tiny, kw):  # noqa: F811
    """Outputs ending at a stop token after their first token (min_tokens 1): the emitted prefixes keep the
    processed distribution (the stop in mid-block ends each), with chains, draft-confidence cuts, and trees for
    the greedy rows decoding in the same batch (which give their own autoregressive tokens)."""
    target, drafter = tiny
    engine = Engine(target, DFlashProposer(drafter, target, **kw))
    greedy = [(PROMPT[:3] + [i], SamplingParams(max_tokens=6, ignore_eos=True, presence_penalty=0.5))
              for i in range(3)]
    p, impossible, rate, extra = stopping_pvalue(engine, greedy)
    assert impossible == 0 and p > 0.001 and 0.01 < rate < 0.95
    for (prompt, sp), r in zip(greedy, extra):
        assert r.token_ids == engine.generate([prompt], sp, "ar")[0].token_ids


# ------------------------------------------------------- SmolLM2 + the shipped drafter: one batch, many features

CHATS = ["Write a Python function that reverses a string.", "Name three colours.", "What is the capital of France?",
         "Describe a programmer named Ada, aged 36, as JSON.", "Count from 1 to 20, separated by commas."]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
#: proposer settings: the CPU's trees + prompt lookup + confidence, a short chain with confidence and lookup
PROPOSERS = {"tree+lookup": dict(draft_confidence=0.1, tree_topk=4, prompt_lookup=8),
             "short+confidence": dict(max_draft_len=5, draft_confidence=0.2, prompt_lookup=3)}


def feature_requests(pipe) -> list[tuple[str, list[int], SamplingParams]]:
    """(name, prompt, params): greedy and seeded sampled requests, each with other features."""
    p = [pipe.encode_chat(c) for c in CHATS]
    comma = pipe.encode(",")[-1]
    greedy = [
        ("plain", p[0], SamplingParams(max_tokens=24)),
        ("penalties", p[1], SamplingParams(max_tokens=24, repetition_penalty=1.3, presence_penalty=0.5,
                                           frequency_penalty=0.3)),
        ("bias+min_tokens", p[2], SamplingParams(max_tokens=16, min_tokens=12, logit_bias={comma: 4.0})),
        ("bad_words", p[4], SamplingParams(max_tokens=16, bad_words=[[comma]])),
        ("json", p[3], SamplingParams(max_tokens=24, guided=GuidedDecoding(json=SCHEMA))),
        ("stop string+logprobs", p[4], SamplingParams(max_tokens=40, stop=["5"], logprobs=3)),
        ("max_tokens 7", p[0], SamplingParams(max_tokens=7, ignore_eos=True)),
        ("eos early", p[2], SamplingParams(max_tokens=40)),
    ]
    sampled = [
        ("sampled top_p", p[0], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=11)),
        ("sampled penalties+min_p", p[1], SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2,
                                                         presence_penalty=0.4, max_tokens=16, seed=12, logprobs=2)),
        ("sampled json", p[3], SamplingParams(temperature=0.7, top_k=20, max_tokens=16, seed=13,
                                              guided=GuidedDecoding(json=SCHEMA))),
        ("sampled stop+min_tokens", p[2], SamplingParams(temperature=1.0, max_tokens=16, seed=14, min_tokens=6,
                                                         stop=["."])),
    ]
    return greedy + sampled


def teacher_forced_logprobs(target, prompt: list[int], out: list[int]) -> torch.Tensor:
    """[len(out)] the raw target's log-probability of each output token, from one forward over prompt + out."""
    ids = prompt + out
    cache = target.new_cache(1, len(ids))
    with torch.inference_mode():
        res = target(torch.tensor([ids]), torch.arange(len(ids))[None], cache, len(ids),
                     logits_index=torch.arange(len(prompt) - 1, len(ids) - 1)[None])
        lp = torch.log_softmax(res.logits[0].float(), -1)
    return lp[torch.arange(len(out)), torch.tensor(out)]


@pytest.fixture(scope="module")
def ar_feature_results(smollm2_pipeline):
    """Each greedy request of `feature_requests` decoded alone in mode "ar" (None for the sampled ones)."""
    pipe = smollm2_pipeline
    return [pipe.engine.generate([p], sp, "ar")[0] if sp.greedy else None for _, p, sp in feature_requests(pipe)]


@pytest.mark.slow
@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_smollm2_mixed_feature_batch_decodes_each_request_exactly(smollm2_pipeline, ar_feature_results, proposer):
    """Greedy requests with different features (penalties, logit bias + min_tokens, bad words, JSON and regex
    grammars, a stop string, logprobs, max_tokens and EOS inside a block) and seeded sampled ones decode together
    under each proposer setting: every greedy request gives its autoregressive tokens alone, finish reason and
    logprobs included; every sampled one the tokens it samples alone with the same proposer; every logprob is
    the target's own log-probability of that token (one forward over the whole output)."""
    pipe = smollm2_pipeline
    target = pipe.engine.target
    engine = Engine(target, DFlashProposer(pipe.engine.proposer.drafter, target, **PROPOSERS[proposer]),
                    pipe.engine.eos_token_ids)
    engine.grammars, engine.detokenize = pipe.engine.grammars, pipe.engine.detokenize
    reqs = feature_requests(pipe)
    together = engine.generate([p for _, p, _ in reqs], [sp for _, _, sp in reqs], "dflash")
    for (name, prompt, sp), res, ar in zip(reqs, together, ar_feature_results):
        ref = ar if sp.greedy else engine.generate([prompt], sp, "dflash")[0]
        assert res.token_ids == ref.token_ids, name
        assert (res.finish_reason, res.stop_reason, res.text) == (ref.finish_reason, ref.stop_reason, ref.text), name
        if sp.logprobs is not None:
            forced = teacher_forced_logprobs(target, prompt, res.token_ids)
            assert [x.token_id for x in res.logprobs] == res.token_ids, name
            assert max(abs(x.logprob - y) for x, y in zip(res.logprobs, forced.tolist())) < 2e-3, name
            assert all(abs(a.logprob - b.logprob) < 2e-3 for a, b in zip(res.logprobs, ref.logprobs)), name
    by_name = {name: r for (name, _, _), r in zip(reqs, together)}
    assert by_name["max_tokens 7"].finish_reason == "length" and len(by_name["max_tokens 7"].token_ids) == 7
    assert by_name["stop string+logprobs"].stop_reason == "5"
    assert sum(r.metrics.accepted_tokens for r in together) > 0
