"""Lazy greedy verification (logits only where the verifier reads them) decides exactly what full
verification decides: same tokens, same acceptance statistics, on the real model, for rows that
reject early, rows whose drafts are all accepted, and batches that mix them (and sampled rows)."""

from __future__ import annotations

import pytest

from dflash_trt.runtime import engine as engine_module
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.sampling import SamplingParams
from tests.runtime.oracle import OracleProposer, chat_references

MAX_TOKENS = 20
CHATS = ["Write a short poem about the sea.", "Name three colours.", "What is 17 times 23?"]
TIMES = ("time_to_first_token_s", "total_time_s", "tokens_per_s")


@pytest.fixture(scope="module")
def refs(smollm2_untrained):
    return chat_references(smollm2_untrained, CHATS, MAX_TOKENS)


def run(engine, prompts, params, monkeypatch):
    """Tokens and time-free metrics of every request, and how many positions greedy verification
    computed logits for."""
    seen = []
    verify = engine_module.lazy_greedy_accept

    def counting_verify(drafts, hidden, logits_fn, first, on_logits=None):
        def head(h):
            seen.append(h.shape[0])
            return logits_fn(h)

        return verify(drafts, hidden, head, first, on_logits)

    with monkeypatch.context() as m:
        m.setattr(engine_module, "lazy_greedy_accept", counting_verify)
        results = engine.generate(prompts, params, "dflash")
    stats = [{k: v for k, v in r.metrics.to_dict().items() if k not in TIMES} for r in results]
    return [r.token_ids for r in results], stats, sum(seen)


def engine_for(proposer, pipe, prompts, ar, lazy):
    target = pipe.engine.target
    if proposer == "drafter":  # untrained: rejects almost everything at draft position 1
        return Engine(target, pipe.engine.proposer, lazy_logits=lazy)
    if proposer == "mixed-batch":  # row 0 all accepted, row 1 all rejected (a shifted reference), row 2 sampled
        bad = prompts[1] + [(t + 1) % 49152 for t in ar[1]]
        return Engine(target, OracleProposer([prompts[0] + ar[0], bad, prompts[2] + ar[2]], 16), lazy_logits=lazy)
    wrong = () if proposer == "oracle" else (int(proposer[-1]),)
    return Engine(target, OracleProposer([p + r for p, r in zip(prompts, ar)], 16, wrong), lazy_logits=lazy)


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["drafter", "oracle", "oracle-wrong-2", "oracle-wrong-5", "mixed-batch"])
def test_lazy_verification_equals_full_verification(refs, monkeypatch, proposer):
    pipe, prompts, ar = refs
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    if proposer == "mixed-batch":
        params = [params, params, SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=5)]

    def make(lazy):
        return engine_for(proposer, pipe, prompts, ar, lazy)

    full_tokens, full_stats, full_rows = run(make(0), prompts, params, monkeypatch)
    lazy_tokens, lazy_stats, lazy_rows = run(make(3), prompts, params, monkeypatch)
    # always lazy, even for rows whose drafts keep passing position 3 (the rest of their block is
    # then computed in a second product every step)
    monkeypatch.setattr(engine_module, "LAZY_MAX_ACCEPT_RATE", 1.0)
    always_tokens, always_stats, _ = run(make(3), prompts, params, monkeypatch)

    assert lazy_tokens == full_tokens == always_tokens
    assert lazy_stats == full_stats == always_stats
    greedy_rows = [0, 1] if proposer == "mixed-batch" else [0, 1, 2]
    assert [full_tokens[i] for i in greedy_rows] == [ar[i] for i in greedy_rows]  # lossless
    if proposer == "oracle":
        # every draft accepted: the 19 tokens after the prefill's come in 2 steps of up to 16
        assert all(s["verify_steps"] == 2 and s["accepted_tokens"] == 15 + 3 for s in full_stats)
    if proposer in ("drafter", "oracle-wrong-2"):
        assert lazy_rows < full_rows / 3  # most of the block's logits were never computed
