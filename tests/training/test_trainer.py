"""The trainer on a tiny target: loss falls, acceptance rises, interrupt + resume == uninterrupted."""

from pathlib import Path

import pytest
import torch

from tests.training.conftest import DATA_LAYERS, EOS, MASK
from dflash_trt.files import LOCK_FILE
from dflash_trt.errors import DFlashError, TrainingInterrupted
from dflash_trt.models.checkpoints import new_drafter_config
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.training.evaluate import set_tau
from dflash_trt.training.pipeline import make_train_data
from dflash_trt.training.objective import block_inputs, drafter_block_hidden
from dflash_trt.training.trainer import (BEST, CHECKPOINT, TrainConfig, checkpoint_target_layer_ids, split_validation,
                                         train, validate)

CFG = TrainConfig(block_size=4, anchors_per_seq=8, seqs_per_step=4, epochs=20, lr=1e-2, soft_weight=0.5,
                  checkpoint_every=1000, log_every=5, seed=0)


def _drafter(target, seed=0, layers=1, ids=(0, 1)):
    cfg = new_drafter_config(target.config, layers, 4, MASK, list(ids))
    torch.manual_seed(seed)
    return DFlashDrafter(cfg)


def _data(target, samples):
    return make_train_data(samples, DATA_LAYERS, (0, 1), target, None)


def _tau(target, drafter, prompts):
    engine = Engine(target, DFlashProposer(drafter.eval(), target), (EOS,))
    results = engine.generate(prompts, SamplingParams(max_tokens=40), mode="dflash")
    ar = Engine(target, None, (EOS,)).generate(prompts, SamplingParams(max_tokens=40), mode="ar")
    assert [r.token_ids for r in results] == [r.token_ids for r in ar]  # greedy parity holds throughout
    return set_tau(results)


def test_loss_falls_and_acceptance_rises(tmp_path, tiny_target, tiny_samples, tiny_prompts):
    drafter = _drafter(tiny_target)
    untrained_tau = _tau(tiny_target, drafter, tiny_prompts)
    state = train(drafter, _data(tiny_target, tiny_samples), CFG, tmp_path / "run", progress=False)
    assert state.finished and state.step == CFG.total_steps(len(tiny_samples)) == 120
    first, last = state.history[0], state.history[-1]
    assert last["hard_ce"] < 0.75 * first["hard_ce"]
    assert last["loss"] < first["loss"] - 0.8
    assert last["accepted"] > first["accepted"]
    trained_tau = _tau(tiny_target, drafter, tiny_prompts)
    assert trained_tau > untrained_tau + 0.3, (untrained_tau, trained_tau)


def test_bf16_autocast_trains_too(tmp_path, tiny_target, tiny_samples, tiny_prompts):
    """bf16_autocast: the forward runs in bfloat16 (a different loss from float32's), the parameters
    stay float32, the loss falls and the acceptance rises as in float32."""
    drafter = _drafter(tiny_target)
    untrained_tau = _tau(tiny_target, drafter, tiny_prompts)
    cfg = TrainConfig(**{**CFG.__dict__, "bf16_autocast": True})
    state = train(drafter, _data(tiny_target, tiny_samples), cfg, tmp_path / "run", progress=False)
    assert state.finished and all(p.dtype == torch.float32 for p in drafter.parameters())
    first, last = state.history[0], state.history[-1]
    assert last["loss"] < first["loss"] - 0.8
    plain = train(_drafter(tiny_target), _data(tiny_target, tiny_samples), CFG, tmp_path / "plain", max_steps=10,
                  progress=False)
    assert plain.history[0]["loss"] != first["loss"]  # bf16 forward really ran
    assert _tau(tiny_target, drafter, tiny_prompts) > untrained_tau + 0.3


def _records(history):
    """The loss records without their timing (blocks_per_s is wall-clock)."""
    return [{k: v for k, v in h.items() if k != "blocks_per_s"} for h in history]


def test_resume_gives_bitwise_same_weights_and_loss_records(tmp_path, tiny_target, tiny_samples):
    """Interrupted at step 5 (a log step), 7 and 11 (inside log windows of 5 steps, each past a
    periodic checkpoint), then resumed to the end (step 12): bitwise the weights and the loss records
    (every field but the timing) of an uninterrupted run; the record at step 10 covers steps 6-10
    although steps 6-7 ran before a resume."""
    torch.use_deterministic_algorithms(True)
    try:
        cfg = TrainConfig(**{**CFG.__dict__, "epochs": 2, "checkpoint_every": 3})
        data = _data(tiny_target, tiny_samples)
        straight = _drafter(tiny_target)
        straight_state = train(straight, data, cfg, tmp_path / "a", progress=False)
        interrupted = _drafter(tiny_target)
        state = train(interrupted, data, cfg, tmp_path / "b", max_steps=5, progress=False)
        assert not state.finished and state.step == 5
        for stop in (7, 11):
            state = train(_drafter(tiny_target, seed=stop), data, cfg, tmp_path / "b", resume=True, max_steps=stop,
                          progress=False)
            assert state.step == stop and [h["step"] for h in state.history] == list(range(5, stop, 5))
        resumed = _drafter(tiny_target, seed=123)  # different init: the checkpoint must replace it
        state = train(resumed, data, cfg, tmp_path / "b", resume=True, progress=False)
        assert state.finished and state.step == cfg.total_steps(len(tiny_samples)) == 12
        for (k, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
            assert torch.equal(a, b), k
        assert [h["step"] for h in state.history] == [5, 10, 12]
        assert _records(state.history) == _records(straight_state.history)
        assert all(h["blocks_per_s"] > 0 for h in state.history)
    finally:
        torch.use_deterministic_algorithms(False)


class _StepClock:
    """A stand-in for the trainer's `time` module: its clock moves `per_step` seconds per training
    step (each `_batch_loss` call), and not otherwise."""

    def __init__(self, monkeypatch, per_step):
        from dflash_trt.training import trainer

        self.now = 0.0
        real = trainer._batch_loss

        def batch_loss(*args, **kwargs):
            self.now += per_step
            return real(*args, **kwargs)
        monkeypatch.setattr(trainer, "_batch_loss", batch_loss)
        monkeypatch.setattr(trainer, "time", self)

    def perf_counter(self):
        return self.now

    monotonic = time = perf_counter


def test_time_limit_counts_the_call_not_the_time_since_the_last_checkpoint(tmp_path, tiny_target, tiny_samples,
                                                                            monkeypatch):
    """time_limit_s is this call's wall time: with 10 s a step and a 45 s limit the run stops (with a
    checkpoint of its own) at step 5, though a checkpoint every 3 steps never lets 45 s pass between
    two (it used to run to the end); each resumed call has the limit afresh, and the run ends with
    bitwise the weights of an uninterrupted one."""
    torch.use_deterministic_algorithms(True)
    try:
        cfg = TrainConfig(**{**CFG.__dict__, "epochs": 2, "checkpoint_every": 3})
        data = _data(tiny_target, tiny_samples)
        straight = _drafter(tiny_target)
        train(straight, data, cfg, tmp_path / "a", progress=False)
        clock = _StepClock(monkeypatch, per_step=10.0)
        paused = []
        resume = False
        while True:
            drafter = _drafter(tiny_target, seed=len(paused))
            state = train(drafter, data, cfg, tmp_path / "b", resume=resume, time_limit_s=45.0, progress=False)
            if state.finished:
                break
            paused.append(state.step)
            ck = torch.load(tmp_path / "b" / CHECKPOINT, weights_only=False)
            assert ck["state"]["step"] == state.step and not ck["state"]["finished"]
            resume = True
        assert paused == [5, 10] and state.step == cfg.total_steps(len(tiny_samples)) == 12 and clock.now == 120.0
        for (k, a), (_, b) in zip(straight.state_dict().items(), drafter.state_dict().items()):
            assert torch.equal(a, b), k
    finally:
        torch.use_deterministic_algorithms(False)


def test_existing_checkpoint_needs_resume_and_same_settings(tmp_path, tiny_target, tiny_samples):
    cfg = TrainConfig(**{**CFG.__dict__, "epochs": 1})
    data = _data(tiny_target, tiny_samples)
    train(_drafter(tiny_target), data, cfg, tmp_path / "r", max_steps=2, progress=False)
    with pytest.raises(DFlashError, match="--resume"):
        train(_drafter(tiny_target), data, cfg, tmp_path / "r", progress=False)
    other = TrainConfig(**{**cfg.__dict__, "lr": 1e-4})
    with pytest.raises(DFlashError, match=r"other training settings or data \(lr \(--lr\) 0.01 -> 0.0001\); resume with"):
        train(_drafter(tiny_target), data, other, tmp_path / "r", resume=True, progress=False)
    anchors = TrainConfig(**{**cfg.__dict__, "anchors_per_seq": 16})
    with pytest.raises(DFlashError, match=r"\(anchors_per_seq \(--anchors\) 8 -> 16\)"):
        train(_drafter(tiny_target), data, anchors, tmp_path / "r", resume=True, progress=False)
    with pytest.raises(DFlashError, match=r"other training settings or data \(drafter layers \(--num-layers\) 1 -> 2\)"):
        train(_drafter(tiny_target, layers=2), data, cfg, tmp_path / "r", resume=True, progress=False)
    # as many layers, so fc has the same shape: the checkpoint's record of the ids tells them apart
    with pytest.raises(DFlashError, match=r"data \(target layer ids \(--target-layer-ids\) \[0, 1\] -> \[0, 3\]\); resume"):
        train(_drafter(tiny_target, ids=(0, 3)), data, cfg, tmp_path / "r", resume=True, progress=False)
    assert checkpoint_target_layer_ids(tmp_path / "r") == (0, 1) and checkpoint_target_layer_ids(tmp_path) is None
    with pytest.raises(DFlashError, match="nothing to resume in .* run without --resume to start"):
        train(_drafter(tiny_target), data, cfg, tmp_path / "fresh", resume=True, progress=False)
    assert not (tmp_path / "fresh").exists()


def test_time_budget_fits_the_schedule(tmp_path, tiny_target, tiny_samples):
    """budget_s shortens the schedule to what fits, the run finishes (LR annealed to 0) and a
    resumed run keeps the fitted length."""
    cfg = TrainConfig(block_size=4, anchors_per_seq=4, seqs_per_step=2, epochs=200.0, checkpoint_every=10)
    drafter = _drafter(tiny_target)
    full = cfg.total_steps(len(tiny_samples))
    state = train(drafter, _data(tiny_target, tiny_samples), cfg, tmp_path / "run", budget_s=1.0, progress=False)
    assert state.budget_fitted and state.finished and 25 < state.total_steps < full
    assert state.history[-1]["lr"] < 0.01 * cfg.lr  # the cosine reached its end
    again = train(_drafter(tiny_target), _data(tiny_target, tiny_samples), cfg, tmp_path / "run", resume=True,
                  budget_s=1000.0, progress=False)
    assert again.total_steps == state.total_steps and again.step == state.step


def _reference_acceptance(drafter, data, indices, cfg):
    """Held-out tau computed one sample at a time (every anchor in one drafter pass, without the
    trainer's batching and chunking), walking the response as greedy decoding does."""
    decoded = steps = 0
    with torch.no_grad():
        for i in indices:
            tokens = data.tokens[i][: cfg.max_seq_len + 1]
            first = data.prompt_len[i]
            anchors = torch.arange(first, len(tokens) - 1)
            if not anchors.numel():
                continue
            ids, pos, lab = block_inputs(tokens, anchors, cfg.block_size, MASK)
            feats = data.features[i][: int(anchors.max())].float()[None]
            h = drafter_block_hidden(drafter, data.embed, feats, ids[None], pos[None], anchors[None])[0]
            pred = (h[:, 1:] @ data.head.t()).argmax(-1)
            lab_d = torch.where(lab >= 0, data.t2d[lab.clamp(min=0)], lab)
            run = ((pred == lab_d) & (lab >= 0)).int().cumprod(1).sum(1)
            at = first  # the prefill's token; each verify step commits the accepted drafts + 1
            while at < len(tokens) - 1:
                at += int(run[at - first]) + 1
                steps += 1
            decoded += len(tokens) - 1 - first
    return decoded / steps


def test_validation_tau_is_the_decoded_tau(tmp_path, tiny_target, tiny_samples, tiny_prompts):
    """validate's teacher-forced tau, with float32 features from the target (what decoding has),
    equals the tau that greedy DFlash decoding measures on the same prompts, untrained and trained;
    the mean over all anchors is larger (a long easy run is one decode step but many anchors)."""
    assert sorted(s["tokens"][: s["prompt_len"]].tolist() for s in tiny_samples) == sorted(tiny_prompts)
    online = _data(tiny_target, [{k: v for k, v in s.items() if k != "features"} for s in tiny_samples])
    assert online.features is None
    drafter = _drafter(tiny_target)
    taus = []
    for steps in (0, 120):
        if steps:
            train(drafter, _data(tiny_target, tiny_samples), CFG, tmp_path / "run", max_steps=steps, progress=False)
        v = validate(drafter, online, list(range(len(tiny_samples))), CFG)
        decoded = _tau(tiny_target, drafter, tiny_prompts)
        assert v["acceptance_length"] == pytest.approx(decoded, abs=1e-12), steps
        assert v["blocks"] == sum(len(s["tokens"]) - 1 - s["prompt_len"] for s in tiny_samples)
        taus.append(decoded)
    assert taus[1] > taus[0] + 0.3 and v["anchor_mean"] > v["acceptance_length"] + 0.1, (taus, v)


def test_validation_holds_out_samples_and_keeps_the_best(tmp_path, tiny_target, tiny_samples):
    cfg = TrainConfig(**{**CFG.__dict__, "epochs": 8, "checkpoint_every": 12, "val_samples": 6})
    n = len(tiny_samples)
    val, rest = split_validation(n, cfg)
    assert len(val) == 6 and sorted(val + rest) == list(range(n)) and split_validation(n, cfg) == (val, rest)
    assert split_validation(n, TrainConfig(**{**cfg.__dict__, "val_samples": 0})) == ([], list(range(n)))
    with pytest.raises(DFlashError, match="leaves nothing to train on"):
        split_validation(n, TrainConfig(**{**cfg.__dict__, "val_samples": n}))
    data = _data(tiny_target, tiny_samples)
    torch.use_deterministic_algorithms(True)
    try:
        drafter = _drafter(tiny_target)
        untrained = _reference_acceptance(drafter, data, val, cfg)
        untrained_train = _reference_acceptance(drafter, data, rest, cfg)
        state = train(drafter, data, cfg, tmp_path / "run", progress=False)
        # the held-out samples never train: the same run on the other 18 samples alone, without
        # validation, gives bitwise the same weights
        alone = _drafter(tiny_target)
        train(alone, _data(tiny_target, [tiny_samples[i] for i in rest]),
              TrainConfig(**{**cfg.__dict__, "val_samples": 0}), tmp_path / "alone", progress=False)
        for (k, a), (_, b) in zip(drafter.state_dict().items(), alone.state_dict().items()):
            assert torch.equal(a, b), k
    finally:
        torch.use_deterministic_algorithms(False)
    assert state.total_steps == cfg.total_steps(n - 6) == 36
    steps = [v["step"] for v in state.val_history]
    assert steps == [0, 12, 24, 36]  # the starting weights, every checkpoint (the last included)
    accs = [v["acceptance_length"] for v in state.val_history]
    assert accs[0] == pytest.approx(untrained, abs=1e-9)  # batched + padded == one sample at a time
    assert accs[-1] == pytest.approx(_reference_acceptance(drafter, data, val, cfg), abs=1e-9)
    assert all(1.0 <= a <= cfg.block_size for a in accs)
    assert _reference_acceptance(drafter, data, rest, cfg) > untrained_train + 0.15  # it did learn its samples
    best = max(state.val_history, key=lambda v: (v["acceptance_length"], -v["hard_ce"]))  # ties: lower CE
    assert state.best_acceptance_length == max(accs) and state.best_step == best["step"]
    best = _drafter(tiny_target, seed=5)
    best.load_state_dict(torch.load(tmp_path / "run" / BEST, weights_only=True)["drafter"])
    assert validate(best, data, val, cfg)["acceptance_length"] == pytest.approx(max(accs), abs=1e-9)


def test_attention_choices_train_alike(tmp_path, tiny_target, tiny_samples):
    """attention "blockwise" (the CPU's auto) and "sdpa" compute the same steps up to float rounding:
    after 6 steps the weights agree closely; "auto" on the CPU is "blockwise" bit for bit."""
    data = _data(tiny_target, tiny_samples)
    weights = {}
    for attention in ("auto", "blockwise", "sdpa"):
        cfg = TrainConfig(**{**CFG.__dict__, "epochs": 2, "attention": attention})
        drafter = _drafter(tiny_target)
        state = train(drafter, data, cfg, tmp_path / attention, max_steps=6, progress=False)
        assert state.step == 6
        weights[attention] = drafter.state_dict()
    for k, w in weights["auto"].items():
        assert torch.equal(w, weights["blockwise"][k]), k
        torch.testing.assert_close(w, weights["sdpa"][k], rtol=1e-3, atol=1e-4, msg=k)
    with pytest.raises(ValueError, match='attention must be "auto", "blockwise" or "sdpa"'):
        TrainConfig(attention="flash")


def test_resume_shape_differences_name_the_flags():
    from dflash_trt.training.trainer import _shape_differences

    base = {"fc.weight": (64, 128), "layers.0.mlp.up_proj.weight": (128, 64), "d2t": (32,)}
    assert _shape_differences(base, dict(base)) == []
    assert _shape_differences(base, {**base, "d2t": (16,)}) == ["draft vocabulary (--draft-vocab-size) 32 -> 16"]
    full = {k: v for k, v in base.items() if k != "d2t"}
    assert _shape_differences(base, full) == ["draft vocabulary (--draft-vocab-size) 32 -> full"]
    assert _shape_differences(base, {**base, "fc.weight": (64, 192)}) == [
        "fused target features (--target-layer-ids) (64, 128) -> (64, 192)"]
    assert _shape_differences(base, {**base, "layers.1.mlp.up_proj.weight": (128, 64)}) == [
        "drafter layers (--num-layers) 1 -> 2"]


def test_ctrl_c_keeps_the_last_complete_checkpoint_and_best(tmp_path, tiny_target, tiny_samples, monkeypatch):
    """Ctrl-C while a checkpoint is written leaves the previous one whole and no temporary file, and
    TrainingInterrupted (a KeyboardInterrupt) names both steps; Ctrl-C between a checkpoint and its
    best.pt makes the resume rewrite best.pt from the checkpoint. The resumed run then ends with
    bitwise the weights, held-out history, loss records and best.pt of an uninterrupted run. SIGTERM (the second
    stop) is told apart (`terminated`)."""
    from dflash_trt.interrupts import Terminated

    cfg = TrainConfig(**{**CFG.__dict__, "epochs": 2, "checkpoint_every": 3, "val_samples": 4})
    data = _data(tiny_target, tiny_samples)
    real_save = torch.save

    def interrupt_when(hit, stop=KeyboardInterrupt):
        def save(obj, f, *args, **kwargs):
            if hit(Path(f.name), obj):
                f.write(b"PK\x03\x04 half a checkpoint")  # what a killed write leaves
                raise stop
            return real_save(obj, f, *args, **kwargs)
        monkeypatch.setattr(torch, "save", save)

    torch.use_deterministic_algorithms(True)
    try:
        straight = _drafter(tiny_target)
        ref = train(straight, data, cfg, tmp_path / "a", progress=False)
        bests, top = [], None  # the steps at which the uninterrupted run found a new best
        for v in ref.val_history:
            if top is None or (v["acceptance_length"], -v["hard_ce"]) > top:
                top = (v["acceptance_length"], -v["hard_ce"])
                bests.append(v["step"])
        later = [b for b in bests if b > 6]
        assert later, bests  # this run's held-out tau improves after step 6
        run = tmp_path / "b"
        interrupt_when(lambda f, obj: f.name.startswith(".checkpoint.pt.") and obj["state"]["step"] == 6)
        with pytest.raises(TrainingInterrupted) as exc:
            train(_drafter(tiny_target), data, cfg, run, progress=False)
        assert isinstance(exc.value, KeyboardInterrupt) and not exc.value.terminated
        assert (exc.value.step, exc.value.total_steps, exc.value.checkpoint_step) == (6, ref.total_steps, 3)
        assert str(exc.value).startswith(f"training interrupted at step 6/{ref.total_steps}; last checkpoint: step 3")
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, BEST, CHECKPOINT]
        assert torch.load(run / CHECKPOINT, weights_only=False)["state"]["step"] == 3
        interrupt_when(lambda f, obj: f.name.startswith(".best.pt.") and obj["step"] == later[0], Terminated)
        with pytest.raises(TrainingInterrupted) as exc:  # SIGTERM (kill, Slurm), as terminate_as_interrupt raises it
            train(_drafter(tiny_target), data, cfg, run, resume=True, progress=False)
        assert exc.value.step == exc.value.checkpoint_step == later[0] and exc.value.terminated
        assert torch.load(run / BEST, weights_only=True)["step"] < later[0]  # behind its checkpoint's best_step
        monkeypatch.setattr(torch, "save", real_save)
        train(_drafter(tiny_target), data, cfg, run, resume=True, max_steps=later[0], progress=False)  # no step
        best, ck = torch.load(run / BEST, weights_only=True), torch.load(run / CHECKPOINT, weights_only=False)
        assert best["step"] == ck["state"]["best_step"] == later[0]  # rewritten from the checkpoint's weights
        assert all(torch.equal(w, ck["drafter"][k]) for k, w in best["drafter"].items())
        resumed = _drafter(tiny_target, seed=9)
        state = train(resumed, data, cfg, run, resume=True, progress=False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert state.finished and state.val_history == ref.val_history and state.best_step == ref.best_step
    assert _records(state.history) == _records(ref.history)  # resumed from step 3, inside the first log window
    for (k, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), k
    best, ref_best = (torch.load(d / BEST, weights_only=True) for d in (run, tmp_path / "a"))
    assert best["step"] == ref_best["step"] == ref.best_step
    for k, w in ref_best["drafter"].items():
        assert torch.equal(w, best["drafter"][k]), k
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, BEST, CHECKPOINT]


def test_prompts_that_fill_max_seq_len_are_named_not_trained_as_zero_loss(tmp_path, tiny_target, tiny_samples, capsys):
    """Blocks lie within a sample's first max_seq_len + 1 tokens and start in its response: when every
    prompt fills that window the run is refused before it starts (it reported loss 0.000 and exported
    a drafter trained on nothing); when some do, one warning counts them (prompts here: 4-8 tokens)."""
    from dflash_trt.training.trainer import _check_trainable

    data = _data(tiny_target, tiny_samples)
    cfg = TrainConfig(**{**CFG.__dict__, "max_seq_len": 4})
    with pytest.raises(DFlashError) as exc:
        train(_drafter(tiny_target), data, cfg, tmp_path / "run", progress=False)
    assert str(exc.value) == ("no training sample has a response within --max-seq-len 4: each prompt fills the window, "
                              "so nothing would be trained; raise --max-seq-len above the prompt lengths (the longest "
                              "prompt is 8 tokens; the window holds prompt + response), or use shorter prompts")
    assert not (tmp_path / "run" / CHECKPOINT).exists()
    capsys.readouterr()
    _check_trainable(data, 6)  # a window of 7 tokens: prompts of 6, 7 and 8 tokens leave < 2 response tokens
    err = capsys.readouterr().err
    assert err.startswith("warning: 15 of 24 training samples have no response within --max-seq-len 6 "), err
    _check_trainable(data, 512)
    assert capsys.readouterr().err == ""
