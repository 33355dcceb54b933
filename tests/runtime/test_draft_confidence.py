"""Dynamic draft length (`draft_confidence`): each row verifies only its confident leading drafts.

The engine handles per-row lengths in one batch (0 .. max_draft_len, ragged) with exact counts and
the target's own output; the real drafter keeps greedy parity and verifies fewer drafts; sampling
keeps the target's distribution; the cut rule is the running product of confidences."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import ConfigError
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.proposer import DFlashProposer, confident_prefix_lengths
from dflash_trt.runtime.sampling import SamplingParams
from tests.runtime.oracle import OracleProposer, chat_references, record_drafts
from tests.runtime.test_sampling_distribution import CASES, pvalue, tiny  # noqa: F401 (fixture)

MAX_TOKENS = 24
CHATS = ["Write a short poem about the sea.", "Name three colours."]


def test_confident_prefix_lengths_cut_at_the_running_product():
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.9],   # products 0.9 0.81 0.729 0.656
                         [0.4, 1.0, 1.0, 1.0],   # 0.4 from the first position on
                         [1.0, 1.0, 0.5, 0.99],  # 1 1 0.5 0.495
                         [0.7, 0.2, 1.0, 1.0]], dtype=torch.float64)  # 0.7 0.14 ...
    assert confident_prefix_lengths(conf, 0.7) == [3, 0, 2, 1]
    assert confident_prefix_lengths(conf, 0.5) == [4, 0, 3, 1]
    assert confident_prefix_lengths(conf, 0.0) == [4, 4, 4, 4]
    assert confident_prefix_lengths(conf, 0.95) == [0, 0, 2, 0]
    assert confident_prefix_lengths(conf, [0.7, 0.0, 0.5, 0.95]) == [3, 4, 3, 0]  # one threshold per row


@pytest.fixture(scope="module")
def refs(smollm2_untrained):
    return chat_references(smollm2_untrained, CHATS, MAX_TOKENS)


@pytest.mark.slow
def test_ragged_lengths_in_one_batch_accept_exactly_what_was_verified(refs):
    """An oracle with every draft right accepts exactly the length it reports: row 0 cycles 0, 1, 2,
    5 drafts by position, row 1 always 3; output stays the reference, counts follow the lengths."""
    pipe, prompts, ar = refs
    k = 7
    pattern = lambda request, start: (0, 1, 2, 5)[start % 4] if request == 0 else 3  # noqa: E731
    oracle = OracleProposer([p + r for p, r in zip(prompts, ar)], 16, max_draft_len=k, lengths=pattern)
    results = Engine(pipe.engine.target, oracle).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), "dflash")
    for i, (res, ref) in enumerate(zip(results, ar)):
        assert res.token_ids == ref
        steps, drafted, start, emitted = 0, 0, len(prompts[i]), 1  # prefill emitted token 1
        per_position = [0] * k
        while emitted < MAX_TOKENS:
            n = pattern(i, start)
            steps, drafted = steps + 1, drafted + n
            per_position = [c + (p < n) for p, c in enumerate(per_position)]
            emitted += n + 1
            start += n + 1
        m = res.metrics
        assert (m.verify_steps, m.drafted_tokens) == (steps, drafted)
        assert len(m.accepted_per_position) == k
        assert m.drafted_per_position == per_position  # the later positions drafted in fewer steps


@pytest.mark.slow
def test_default_drafter_with_draft_confidence_is_lossless_and_verifies_fewer(refs):
    from dflash_trt.models.checkpoints import load_drafter
    from dflash_trt.models.default import default_drafter_path

    pipe, prompts, ar = refs
    target = pipe.engine.target
    drafter = load_drafter(default_drafter_path())
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    full = Engine(target, DFlashProposer(drafter, target)).generate(prompts, params)
    cut = Engine(target, DFlashProposer(drafter, target, draft_confidence=0.3)).generate(prompts, params)
    assert [r.token_ids for r in full] == ar
    assert [r.token_ids for r in cut] == ar
    for f, c in zip(full, cut):
        assert f.metrics.drafted_tokens == 15 * f.metrics.verify_steps
        assert c.metrics.drafted_tokens < 15 * c.metrics.verify_steps / 2  # most of the block is cut
        assert c.metrics.acceptance_rate > f.metrics.acceptance_rate


@pytest.mark.parametrize("threshold, lengths", [(0.5, {0, 1}), (0.2, {1, 2, 3})])
def test_sampling_with_draft_confidence_matches_target(tiny, threshold, lengths):  # noqa: F811
    """Lengths 0 (only the target's token) to 3 (the whole block of 4) all occur across the two cuts."""
    target, drafter = tiny
    proposer = DFlashProposer(drafter, target, draft_confidence=threshold)
    seen = record_drafts(proposer)
    p, rate = pvalue(Engine(target, proposer), CASES[0])
    assert 0.05 < rate < 0.95
    assert p > 0.001
    assert lengths <= {n for drafts in seen for n in drafts.lengths}


@pytest.mark.parametrize("value", [-0.1, 1.0, 2.0, float("nan"), "0.3", "on", None, True])
def test_draft_confidence_out_of_range_is_refused(smollm2_untrained, value):
    pipe = smollm2_untrained
    with pytest.raises(ConfigError, match=r'draft_confidence must be "auto" or a number in \[0, 1\) .*got ' + repr(value)):
        DFlashProposer(pipe.engine.proposer.drafter, pipe.engine.target, draft_confidence=value)


def test_auto_draft_confidence_is_picked_by_the_targets_device(smollm2_path, untrained_drafter, smollm2_untrained):
    """"auto": CPU_DRAFT_CONFIDENCE and CPU_TREE_TOPK where the target runs on a CPU (the defaults of
    load_pipeline and the CLI), a chain verifying every draft on a GPU; the low-level DFlashProposer
    defaults stay a chain with every draft verified (0, 1)."""
    from dflash_trt.api import load_pipeline
    from dflash_trt.runtime.proposer import (CPU_DRAFT_CONFIDENCE, CPU_SAMPLED_DRAFT_CONFIDENCE, CPU_TREE_TOPK,
                                             auto_draft_confidence, auto_tree_topk)

    default = load_pipeline(str(smollm2_path), str(untrained_drafter), cpu_kernels="off")
    assert default.engine.proposer.draft_confidence == CPU_DRAFT_CONFIDENCE == 0.2  # load_pipeline's default, on cpu
    assert default.engine.proposer.tree_topk == CPU_TREE_TOPK == 4
    pipe = smollm2_untrained
    proposer = DFlashProposer(pipe.engine.proposer.drafter, pipe.engine.target, draft_confidence="auto", tree_topk="auto")
    assert (proposer.draft_confidence, proposer.tree_topk) == (0.2, 4)
    assert proposer.sampled_draft_confidence == CPU_SAMPLED_DRAFT_CONFIDENCE == 0.07
    plain = DFlashProposer(pipe.engine.proposer.drafter, pipe.engine.target)
    assert (plain.draft_confidence, plain.sampled_draft_confidence, plain.tree_topk) == (0.0, 0.0, 1)
    fixed = DFlashProposer(pipe.engine.proposer.drafter, pipe.engine.target, draft_confidence=0.3)
    assert (fixed.draft_confidence, fixed.sampled_draft_confidence) == (0.3, 0.3)  # a number sets both
    assert auto_draft_confidence("cuda:1") == 0.0 and auto_draft_confidence(torch.device("cpu")) == 0.2
    assert auto_draft_confidence("cuda:1", sampled=True) == 0.0 and auto_draft_confidence("cpu", sampled=True) == 0.07
    assert auto_tree_topk("cuda:1") == 1 and auto_tree_topk(torch.device("cpu")) == 4


def test_auto_cuts_sampled_drafts_at_their_own_threshold(refs):
    """With "auto" on the CPU, a request whose drafts are sampled is cut at sampled_draft_confidence
    and a greedy one at draft_confidence, alone or in one batch: each gives exactly the drafts,
    counts and tokens of a proposer with that number for both; 0.07 verifies more sampled drafts
    than 0.2 (the same request, same seed)."""
    from dflash_trt.models.checkpoints import load_drafter
    from dflash_trt.models.default import default_drafter_path

    pipe, prompts, ar = refs
    target = pipe.engine.target
    drafter = load_drafter(default_drafter_path())
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0, seed=3)

    def run(conf, batch):
        out = Engine(target, DFlashProposer(drafter, target, draft_confidence=conf)).generate(
            [prompts[0]] * len(batch), batch)
        return [(r.token_ids, r.metrics.verify_steps, r.metrics.drafted_tokens, r.metrics.accepted_tokens) for r in out]

    auto = run("auto", [greedy, sampled])
    assert auto[0] == run(0.2, [greedy])[0] and auto[0][0] == ar[0]
    assert auto[1] == run(0.07, [sampled])[0] == run("auto", [sampled])[0]
    at_02 = run(0.2, [sampled])[0]
    assert auto[1][2] / auto[1][1] > at_02[2] / at_02[1]  # more drafts verified per step


@pytest.mark.parametrize("tree_topk, threshold, temperature", [(1, 0.3, 0.0), (4, 0.1, 0.0), (1, 1e-4, 0.0),
                                                               (4, 1e-4, 0.0), (1, 0.3, 1.0), (1, 1e-4, 1.0)])
def test_lazy_draft_logits_give_the_same_drafts(refs, monkeypatch, tree_topk, threshold, temperature):
    """With a draft confidence, the drafter's last layer and the draft logits past
    LAZY_DRAFT_POSITIONS are computed only while a row is still confident there: the same drafts,
    lengths and counts as computing all 15 positions, greedy and sampled (same seed). At 0.3 / 0.1
    no step of these chats needs the rest; at 1e-4 some do."""
    import dflash_trt.runtime.proposer as proposer_mod
    from dflash_trt.models.checkpoints import load_drafter
    from dflash_trt.models.default import default_drafter_path

    pipe, prompts, ar = refs
    target = pipe.engine.target
    drafter = load_drafter(default_drafter_path())
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=temperature, seed=5)
    runs = {}
    for lazy in (4, 15):
        monkeypatch.setattr(proposer_mod, "LAZY_DRAFT_POSITIONS", lazy)
        proposer = DFlashProposer(drafter, target, draft_confidence=threshold, tree_topk=tree_topk)
        widths = []
        draft_logits = proposer._draft_logits

        def recording(hidden, draft_logits=draft_logits, widths=widths):
            widths.append(hidden.shape[1])
            return draft_logits(hidden)

        proposer._draft_logits = recording
        results = [Engine(target, proposer).generate([p], params)[0] for p in prompts]
        runs[lazy] = ([(r.token_ids, r.metrics.verify_steps, r.metrics.drafted_tokens, r.metrics.accepted_per_position)
                       for r in results], widths)
    if temperature == 0:
        assert [r[0] for r in runs[4][0]] == ar
    assert runs[4][0] == runs[15][0]
    assert set(runs[15][1]) == {15}
    steps = sum(r[1] for r in runs[4][0])
    assert runs[4][1].count(4) == steps and len(runs[4][1]) == steps + runs[4][1].count(11)
    assert (runs[4][1].count(11) > 0) == (threshold < 0.01)
