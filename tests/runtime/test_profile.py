"""PhaseTimer on the real decode loop: it adds up to the loop's wall time, counts its steps, leaves the
output unchanged, and an "ar" loop spends nothing in the drafter phases."""

from __future__ import annotations

import time

import pytest

from dflash_trt.runtime.profile import PHASES, PhaseTimer
from dflash_trt.runtime.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def timed(engine, prompts, mode):
    engine.phase_timer = timer = PhaseTimer(engine.device)
    try:
        t0 = time.perf_counter()
        results = engine.generate(prompts, PARAMS, mode)
        wall = time.perf_counter() - t0
    finally:
        engine.phase_timer = None
    return results, timer, wall


def test_phases_add_up_and_leave_the_output_unchanged(smollm2_untrained):
    pipe = smollm2_untrained
    prompts = [pipe.encode_chat("Name three colours."), pipe.encode("def add(a, b):")]
    engine = pipe.engine
    for mode in ("dflash", "ar"):
        plain = engine.generate(prompts, PARAMS, mode)
        results, timer, wall = timed(engine, prompts, mode)
        assert [r.token_ids for r in results] == [r.token_ids for r in plain]
        assert set(timer.seconds) == set(PHASES) and timer.calls == 1
        # the batch steps together until its last request stops: one timer step per verify step
        assert timer.steps == max(r.metrics.verify_steps for r in results) > 0
        # the timer wraps generate() (a loose lower bound: a busy machine may pause the process outside it)
        assert 0.5 * wall <= timer.total_s <= wall
        named = ("prefill", "target_forward", "logits_and_accept") + (("draft", "inject") if mode == "dflash" else ())
        assert all(timer.seconds[p] > 0 for p in named)
        # phases never overlap: the named ones add up to less than the call, the loop's own time is the rest
        assert timer.seconds["other"] > 0
        if mode == "ar":
            assert timer.seconds["draft"] == 0.0 and timer.seconds["inject"] == 0.0
        d = timer.to_dict(tokens=sum(len(r.token_ids) for r in results))
        assert abs(sum(d["share"].values()) - 1.0) < 1e-9 and d["steps"] == timer.steps
        assert abs(sum(d["ms_per_token"].values()) - 1000 * timer.total_s / 24) < 1e-6
    assert engine.phase_timer is None


def test_a_timer_sums_over_calls(smollm2_untrained):
    pipe = smollm2_untrained
    engine = pipe.engine
    engine.phase_timer = timer = PhaseTimer("cpu")
    try:
        a = engine.generate([pipe.encode("The sky is")], PARAMS, "ar")
        first = dict(timer.seconds)
        b = engine.generate([pipe.encode("The sea is")], PARAMS, "ar")
    finally:
        engine.phase_timer = None
    assert timer.calls == 2 and timer.steps == a[0].metrics.verify_steps + b[0].metrics.verify_steps == 22
    assert all(timer.seconds[p] >= first[p] for p in PHASES) and timer.seconds["prefill"] > first["prefill"]


def test_an_unknown_phase_is_refused():
    timer = PhaseTimer()
    for name in ("verify", "other"):
        with pytest.raises(ValueError, match=f"unknown phase '{name}'"):
            with timer.phase(name):
                pass
    assert timer.total_s == 0.0 and timer.to_dict()["ms_per_token"] is None
