"""The verifier on its own: forced-argmax cases, empty drafts, determinism, and the distribution of
emitted tokens by a chi-square test (which also rejects a deliberately wrong verifier)."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from dflash_trt.runtime.verifier import (
    ChunkedProbs,
    greedy_accept,
    lazy_greedy_accept,
    speculative_sample,
)


def onehot_logits(tokens, vocab=6):
    out = torch.full((len(tokens), vocab), -5.0)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return out


def test_greedy_accept_prefix_and_bonus():
    target = torch.stack([onehot_logits([3, 1, 4, 0]), onehot_logits([3, 1, 4, 0]), onehot_logits([5, 5, 5, 5])])
    drafts = torch.tensor([[3, 1, 4], [3, 2, 4], [0, 5, 5]])
    acc, nxt = greedy_accept(drafts, target)
    assert acc == [3, 1, 0]  # all accepted; stops at first mismatch (later match ignored); none
    assert nxt == [0, 1, 5]  # bonus after a full block; the target's correction otherwise


def test_greedy_accept_empty_draft():
    acc, nxt = greedy_accept(torch.zeros(2, 0, dtype=torch.int64), torch.stack([onehot_logits([2]), onehot_logits([4])]))
    assert acc == [0, 0] and nxt == [2, 4]


def test_lazy_greedy_accept_equals_greedy_accept_and_skips_unread_logits():
    """Random drafts that often match: every `first` gives greedy_accept's verdicts, and logits are
    computed past `first` only for rows whose drafts 1..first all matched."""
    g = torch.Generator().manual_seed(0)
    n, k, vocab = 64, 7, 4
    logits = torch.randn(n, k + 1, vocab, generator=g)
    target = logits.argmax(-1)
    wrong = torch.rand(n, k, generator=g) < 0.3
    drafts = torch.where(wrong, (target[:, :k] + 1) % vocab, target[:, :k])
    expected = greedy_accept(drafts, logits)
    for first in [1, 2, 3, k, k + 1]:
        computed = []

        def head(h, computed=computed):  # hidden == logits here: the identity; count the rows it sees
            computed.append(h.shape[0])
            return h

        first_t = torch.full((n,), first)
        reported = []
        acc, nxt = lazy_greedy_accept(drafts, logits, head, first_t, lambda where, lg: reported.append((where, lg)))
        assert (acc, nxt) == expected
        # on_logits hands over every product with the positions it covers, which hold 0 .. accepted
        assert [lg.shape[0] for _, lg in reported] == computed
        seen = torch.zeros(n, k + 1, dtype=torch.bool)
        for where, lg in reported:
            assert torch.equal(lg, logits[where])
            seen |= where
        assert all(bool(seen[r, : a + 1].all()) for r, a in enumerate(acc))
        all_matched = int((~wrong[:, :first]).all(1).sum()) if first <= k else 0
        assert computed[0] == n * first
        assert sum(computed[1:]) == all_matched * (k + 1 - first)


def test_lazy_greedy_accept_per_row_first_empty_draft_and_never_accepted_id():
    logits = torch.stack([onehot_logits([3, 1, 4, 0]), onehot_logits([3, 1, 4, 0]), onehot_logits([5, 5, 5, 5])])
    drafts = torch.tensor([[3, 1, 4], [3, 1, 4], [6, 5, 5]])  # row 2: id 6 == vocab, never accepted
    acc, nxt = lazy_greedy_accept(drafts, logits, lambda h: h, torch.tensor([2, 4, 1]))
    assert acc == [3, 3, 0] and nxt == [0, 0, 5]
    acc, nxt = lazy_greedy_accept(torch.zeros(2, 0, dtype=torch.int64), torch.stack([onehot_logits([2]), onehot_logits([4])]),
                                  lambda h: h, torch.tensor([1, 1]))
    assert acc == [0, 0] and nxt == [2, 4]


def test_speculative_sample_empty_draft_and_seeded_determinism():
    p = torch.softmax(torch.randn(3, 6, generator=torch.Generator().manual_seed(0)), -1)
    draws = [speculative_sample(torch.zeros(0, dtype=torch.int64), None, p[:1], torch.Generator().manual_seed(7))
             for _ in range(2)]
    assert draws[0] == draws[1] and draws[0][0] == 0
    q = torch.softmax(torch.randn(2, 6, generator=torch.Generator().manual_seed(1)), -1)
    a = speculative_sample(torch.tensor([1, 2]), q, p, torch.Generator().manual_seed(3))
    b = speculative_sample(torch.tensor([1, 2]), q, p, torch.Generator().manual_seed(3))
    assert a == b


def test_chunked_probs_give_the_full_tensors_decisions_and_compute_the_rest_only_when_read():
    """speculative_sample over ChunkedProbs (p's first f positions up front, the rest on demand)
    makes exactly the decisions it makes over the full p, for every split and seed, sampled or
    argmax drafts; the rest is computed at most once, and only when a draft at or past position f
    was reached (all drafts before it accepted)."""
    g = torch.Generator().manual_seed(0)
    k, vocab = 4, 5
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g), -1)
    drafts = p[:k].argmax(-1)  # likely drafts: runs reach every position
    reached_rest = 0
    for f in range(1, k + 2):
        for seed in range(60):
            for dq in (q, None):
                calls = []
                lazy = ChunkedProbs(p[:f], lambda f=f: calls.append(f) or p[f:])
                got = speculative_sample(drafts, dq, lazy, torch.Generator().manual_seed(seed))
                assert got == speculative_sample(drafts, dq, p, torch.Generator().manual_seed(seed)), (f, seed)
                assert len(calls) <= 1
                assert bool(calls) == (f <= k and got[0] >= f)  # read past f only if drafts 1 .. f were kept
                reached_rest += bool(calls)
    assert reached_rest > 50


def wrong_verifier(draft_tokens, draft_probs, target_probs, generator):
    """Deliberately wrong: on rejection resamples from p instead of norm(max(0, p - q))."""
    for j in range(draft_tokens.shape[0]):
        d = int(draft_tokens[j])
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        if float(torch.rand((), generator=generator)) * q_d >= float(target_probs[j, d]):
            return j, int(torch.multinomial(target_probs[j], 1, generator=generator))
    k = draft_tokens.shape[0]
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))


def first_token_pvalue(verify, sampled_drafts: bool, n=6000):
    """Emitted first token over n trials vs p[0] (chi-square goodness of fit)."""
    g = torch.Generator().manual_seed(1234)
    p = torch.softmax(torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0], [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]]), -1)
    q = torch.softmax(torch.tensor([[0.0, 2.0, 2.0, 0.0, 0.0, 0.0]]), -1)
    counts = torch.zeros(6)
    for _ in range(n):
        if sampled_drafts:
            d = torch.multinomial(q[0], 1, generator=g)
            acc, nxt = verify(d, q, p, g)
        else:
            d = torch.tensor([1])  # an argmax draft: q is one-hot on token 1
            acc, nxt = verify(d, None, p, g)
        first = int(d[0]) if acc >= 1 else nxt
        counts[first] += 1
    return chisquare(counts.numpy(), (p[0] * n).numpy()).pvalue


def test_emitted_distribution_is_the_targets():
    assert first_token_pvalue(speculative_sample, sampled_drafts=True) > 0.01
    assert first_token_pvalue(speculative_sample, sampled_drafts=False) > 0.01


def test_chi_square_catches_a_wrong_verifier():
    assert first_token_pvalue(wrong_verifier, sampled_drafts=True) < 1e-6
    assert first_token_pvalue(wrong_verifier, sampled_drafts=False) < 1e-6


def test_greedy_tokens_is_argmax_first_index_on_ties():
    from dflash_trt.runtime.sampling import greedy_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (6, 5, 300), generator=g).float()  # many tied maxima per row
    logits[0, 0, 7] = float("nan")  # nan wins, as in argmax
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64 and got.shape == (6, 5)
    assert torch.equal(got, logits.argmax(-1))
    assert got[0, 0] == 7 and torch.equal(greedy_tokens(torch.zeros(2, 9)), torch.zeros(2, dtype=torch.int64))
