"""The resumable DFlash drafter training loop (DFlash paper sec. 4.2; objective in `objective`).

Why our own loop rather than NVIDIA ModelOpt's (`modelopt.torch.speculative`, algorithm "dflash",
which also trains DFlash drafters and exports the z-lab format): measured with ModelOpt 0.47 on this
project's default target (TRAINING_NOTES.md), it
- ties the NUMBER of tapped target layers to the drafter's depth (a 1-layer drafter gets 1 target
  layer), while the z-lab format and our runtime tap any `target_layer_ids` (5 by default);
- predicts over the full target vocabulary only: no reduced draft vocabulary (the largest speed
  lever on CPU, ~3x more blocks per second) and no draft-to-target id map in its export;
- wraps the whole HF target in the training graph (`convert(model, ...)`), recomputing target
  hidden states that our data cache already holds, and evaluates with `pseudo_speculative_generate`,
  which re-runs the whole target every step (far too slow on CPU);
- offers no initialisation of drafter layers from the target's layers, no soft-label distillation,
  and no resumable run whose result equals an uninterrupted one (RNG streams, data order).
What we keep from the paper and ModelOpt's recipe unchanged: random anchors, block-diagonal
attention, the decay-weighted loss with the paper's gamma, AdamW + warmup + cosine, grad clip 1.0,
a frozen target (its embedding and lm_head are used, never trained), the z-lab export format.

Determinism: every random choice is a pure function of (seed, step): the data order of epoch e is
randperm(N) seeded by (seed, e); the anchors of global sample slot g are seeded by (seed, g). A
checkpoint holds the drafter, AdamW state, step, loss history and the log window in progress;
resuming from it on the same machine (CPU, `torch.use_deterministic_algorithms`) gives bitwise the
weights of an uninterrupted run, and its loss records but for their timing
(tests/training/test_trainer.py).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from dflash_trt.errors import DFlashError, TrainingInterrupted
from dflash_trt.files import atomic_write, folder_lock, read_torch
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.training.objective import (block_inputs, block_loss, cosine_lr, decay_weights, default_gamma,
                                           decode_walk_steps, drafter_block_hidden, sample_anchors)

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run (paper defaults where the paper gives one).

    seqs_per_step sequences x anchors_per_seq blocks make one optimizer step. epochs may be
    fractional. soft_weight: share of the soft-label (distillation) cross-entropy in the loss.
    val_samples: samples held out of training (a seeded random subset) to measure the held-out
    acceptance at every checkpoint (`validate`); 0 = none, every sample trains.
    bf16_autocast: run each step's forward (online target features, drafter, loss) under
    `torch.autocast(bfloat16)`; parameters, gradients and AdamW stay float32. On a CPU with AMX
    (Sapphire Rapids and later) the trainer ran 1.9x the blocks/s (113 vs 59, 4 sequences x 64
    anchors, `build_scripts/bench_trainer.py`, session 11); on a CPU without bf16 matmul units it
    is slower. Validation stays float32.
    attention: "blockwise" (each block's queries against its context and its own keys,
    `layers.block_attention`), "sdpa" (one SDPA call with the dense block-diagonal mask over all
    blocks' keys) or "auto" (blockwise on a CPU, sdpa elsewhere: `objective.drafter_block_hidden`).
    The same values either way; a resumed run must keep its choice (bitwise resume).
    """

    block_size: int = 16
    anchors_per_seq: int = 32
    seqs_per_step: int = 4
    epochs: float = 3.0
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None
    soft_weight: float = 0.5
    max_seq_len: int = 512
    seed: int = 0
    checkpoint_every: int = 100
    log_every: int = 10
    val_samples: int = 0
    bf16_autocast: bool = False
    attention: str = "auto"

    def __post_init__(self):
        if self.attention not in ("auto", "blockwise", "sdpa"):
            raise ValueError(f'attention must be "auto", "blockwise" or "sdpa", got {self.attention!r}')

    def total_steps(self, num_samples: int) -> int:
        return max(1, math.ceil(self.epochs * num_samples / self.seqs_per_step))


@dataclass
class TrainState:
    """What a run has done so far. history: one dict per logged step (every log_every steps and the
    last): step, then loss, hard_ce, soft_ce, accepted (per-step means over the steps since the
    previous record), lr (of the step itself), blocks_per_s (over those steps' wall time);
    val_history: one dict per checkpoint with held-out samples (step, acceptance_length (tau),
    anchor_mean, hard_ce, blocks; see `validate`); best_step /
    best_acceptance_length: the checkpoint with the highest held-out tau so far, ties broken by
    the lower held-out cross-entropy (its weights are run_dir/best.pt). log_window: the log window
    in progress (the steps after the last history record, see `_new_log_window`) as of the
    checkpoint, so a resumed run's next record covers the same steps, with the same figures, as an
    uninterrupted run's ({} in a checkpoint from before it was kept: that record then covers only
    the steps after the resume)."""

    step: int = 0
    total_steps: int = 0
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    blocks: int = 0
    finished: bool = False
    budget_fitted: bool = False
    val_history: list[dict] = field(default_factory=list)
    best_step: int | None = None
    best_acceptance_length: float | None = None
    log_window: dict = field(default_factory=dict)


def _new_log_window() -> dict:
    """An empty log window: sums over its steps of the per-sequence loss ("loss"), hard and soft
    cross-entropy ("hard", "soft") and mean accepted drafts ("acc") of the "k" steps that had a
    block, the blocks trained ("blocks"), and "seconds": its wall time up to the last checkpoint
    (the time since then is added when the record is made)."""
    return {"loss": 0.0, "hard": 0.0, "soft": 0.0, "acc": 0.0, "blocks": 0, "k": 0, "seconds": 0.0}


def _window_record(window: dict, step: int, lr: float, seconds: float) -> dict:
    """The history record of log window `window` (`_new_log_window`) ending at `step`: its per-step means,
    the learning rate `lr` of that step, and blocks per second over its `seconds` of wall time."""
    k = max(1, window["k"])
    return {"step": step, "loss": window["loss"] / k, "hard_ce": window["hard"] / k, "soft_ce": window["soft"] / k,
            "accepted": window["acc"] / k, "lr": lr, "blocks_per_s": window["blocks"] / seconds if seconds > 0 else 0.0}


def reported_history(state: TrainState, cfg: TrainConfig) -> list[dict]:
    """`state.history` plus a record of the log window still open when the run stopped early (a time
    limit or max_steps between two log steps: e.g. --max-steps 1 logged nothing), for the exported
    training.json and loss.png. The run's own history (its checkpoint) is unchanged, so a resumed run
    logs the same records as an uninterrupted one."""
    window = state.log_window
    if not window or not window.get("k") or state.step == 0 or (state.history and state.history[-1]["step"] == state.step):
        return list(state.history)
    lr = cfg.lr * cosine_lr(state.step - 1, state.total_steps, int(round(cfg.warmup_frac * state.total_steps)))
    return [*state.history, _window_record(window, state.step, lr, window["seconds"])]


@dataclass
class TrainData:
    """Training sequences in memory.

    tokens: per sample int32 [T + 1]; prompt_len: ints; features: per sample bfloat16 [T, F] of the
    drafter's target_layer_ids; teacher: per sample bfloat16 [T, H] target final-normed hidden
    states (None without soft labels); t2d: int64 [vocab] target -> draft id (-1 = not drafted);
    head: [V', H] float32 target lm_head rows of the draft vocabulary; embed: [vocab, H] target
    embedding (both frozen). With features None, `online` (a `features.OnlineFeatures`) computes
    features and teacher states of each step's samples with the target instead.
    """

    tokens: list[torch.Tensor]
    prompt_len: list[int]
    features: list[torch.Tensor] | None
    teacher: list[torch.Tensor] | None
    t2d: torch.Tensor
    head: torch.Tensor
    embed: torch.Tensor
    online: Callable[[list[int]], tuple[list[torch.Tensor], list[torch.Tensor] | None]] | None = None

    def __len__(self) -> int:
        return len(self.tokens)


def _sample_slot(cfg: TrainConfig, n: int, slot: int) -> int:
    epoch = slot // n
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 7919 + epoch))
    return int(perm[slot % n])


def split_validation(n: int, cfg: TrainConfig) -> tuple[list[int], list[int]]:
    """(validation, training) sample indices: a seeded random subset of cfg.val_samples held out,
    the rest in their original order (all of them when val_samples is 0).

    Raises:
        DFlashError: val_samples leaves no sample to train on.
    """
    if cfg.val_samples <= 0:
        return [], list(range(n))
    if cfg.val_samples >= n:
        from dflash_trt.text import count

        raise DFlashError(f"--val-samples {cfg.val_samples} leaves nothing to train on ({count(n, 'sample')}); "
                          "hold out fewer or add prompts")
    held = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 7919 + 104729))[: cfg.val_samples]
    held_set = set(held.tolist())
    return sorted(held_set), [i for i in range(n) if i not in held_set]


def _atomic_save(obj, path: Path) -> None:
    """torch.save `obj` to `path` through `files.atomic_write` (a temporary file, fsynced, renamed
    over it, the folder fsynced): an interrupted write (Ctrl-C, a full disk) leaves the previous
    `path` as it was and no temporary file behind, and a saved checkpoint survives a power loss."""
    with atomic_write(path) as f:
        torch.save(obj, f)


#: Steps timed (after 5 warm-up steps) before a time budget fixes the schedule's length.
BUDGET_PROBE_STEPS = 20

BEST = "best.pt"


def checkpoint_target_layer_ids(run_dir: str | Path) -> tuple[int, ...] | None:
    """The drafter's target_layer_ids recorded in run_dir's checkpoint; None when there is no
    checkpoint or it predates the record (its fused-feature width is still checked on resume).
    Reads the file memory-mapped: the weights are not loaded."""
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        return None
    ids = read_torch(path, _damaged_checkpoint_fix(path), weights_only=False, mmap=True).get("target_layer_ids")
    return tuple(ids) if ids is not None else None


def _best_step(run: Path) -> int | None:
    """The step whose weights run/best.pt holds; None without one."""
    path = run / BEST
    return read_torch(path, _damaged_checkpoint_fix(path), weights_only=True, mmap=True)["step"] if path.is_file() else None


def _damaged_checkpoint_fix(path: Path) -> str:
    """What to do about a damaged training checkpoint at `path`."""
    return f"restore it from a copy, or remove {path.parent} and run without --resume to train from the start"


@dataclass
class _Frozen:
    """What every batch of a run needs on the drafter's device: the frozen target tensors, the
    loss weights over block positions, the mask id."""

    t2d: torch.Tensor
    head: torch.Tensor
    embed: torch.Tensor
    weights: torch.Tensor
    mask_id: int
    dev: torch.device

    @classmethod
    def of(cls, drafter: DFlashDrafter, data: TrainData, cfg: TrainConfig) -> _Frozen:
        dev = next(iter(drafter.parameters())).device  # every per-step tensor goes there
        gamma = cfg.gamma if cfg.gamma is not None else default_gamma(cfg.block_size)
        return cls(data.t2d.to(dev), data.head.to(dev), data.embed.to(dev), decay_weights(cfg.block_size, gamma).to(dev),
                   drafter.config.mask_token_id, dev)


def _batch_loss(drafter: DFlashDrafter, data: TrainData, indices: list[int], anchor_seeds: list[int],
                cfg: TrainConfig, fz: _Frozen, soft_weight: float):
    """The loss of one batch: the blocks at anchors of samples `indices` (anchors of sample j drawn
    with seed anchor_seeds[j]), all sequences in ONE drafter pass (blocks padded to the most
    anchors: anchor 0, labels -1; features to the longest context, never visible).

    Returns:
        (LossOutput, number of real blocks), or (None, 0) when no sample has an anchor.
    """
    anchor_sets = [sample_anchors(data.prompt_len[i], min(len(data.tokens[i]), cfg.max_seq_len + 1),
                                  cfg.anchors_per_seq, torch.Generator().manual_seed(seed))
                   for seed, i in zip(anchor_seeds, indices)]
    out, _ = _blocks_loss(drafter, data, indices, anchor_sets, cfg, fz, soft_weight)
    return (out, sum(a.numel() for a in anchor_sets)) if out is not None else (None, 0)


def _blocks_loss(drafter: DFlashDrafter, data: TrainData, indices: list[int], anchor_sets: list[torch.Tensor],
                 cfg: TrainConfig, fz: _Frozen, soft_weight: float):
    """`block_loss` of the blocks at the given anchors (anchor_sets[j]: sorted int64 anchors of sample
    indices[j]; a sample may appear more than once), all in one drafter pass.

    Returns:
        (LossOutput, rows): rows[r] = the position in `indices` of LossOutput row r (entries
        without anchors have no row); (None, []) when no entry has an anchor.
    """
    dev = fz.dev
    use_soft = soft_weight > 0
    uniq = list(dict.fromkeys(indices))
    if data.features is None:
        f_u, t_u = data.online(uniq)
    else:
        f_u = [data.features[i] for i in uniq]
        t_u = [data.teacher[i] for i in uniq] if data.teacher is not None else None
    at = {i: u for u, i in enumerate(uniq)}
    rows = []
    for j, (anchors, i) in enumerate(zip(anchor_sets, indices)):
        tokens = data.tokens[i][: cfg.max_seq_len + 1]
        if anchors.numel():
            rows.append((j, at[i], anchors, *block_inputs(tokens, anchors, cfg.block_size, fz.mask_id)))
    if not rows:
        return None, []
    a_max = max(r[2].numel() for r in rows)
    ctx = max(int(r[2].max()) for r in rows)
    b = cfg.block_size
    anchors = torch.zeros(len(rows), a_max, dtype=torch.int64)
    ids = torch.full((len(rows), a_max, b), fz.mask_id, dtype=torch.int64)
    positions = torch.arange(b).repeat(len(rows), a_max, 1)
    labels = torch.full((len(rows), a_max, b - 1), -1, dtype=torch.int64)
    feats = torch.zeros(len(rows), ctx, f_u[0].shape[1], device=dev)
    for r, (_, u, anc, ids_r, pos_r, lab_r) in enumerate(rows):
        n_a = anc.numel()
        anchors[r, :n_a], ids[r, :n_a], positions[r, :n_a], labels[r, :n_a] = anc, ids_r, pos_r, lab_r
        f = f_u[u][: int(anc.max())]
        feats[r, : f.shape[0]] = f.to(dev).float()
    teacher = None
    if use_soft:
        teacher = torch.zeros(len(rows), a_max, b - 1, fz.embed.shape[1], device=dev)
        for r, (_, u, anc, _, pos_r, _) in enumerate(rows):
            t_j = t_u[u]
            pos = (pos_r[:, 1:] - 1).clamp(max=t_j.shape[0] - 1)
            teacher[r, : anc.numel()] = t_j[pos.to(t_j.device)].to(dev).float()
    anchors, ids, positions, labels = anchors.to(dev), ids.to(dev), positions.to(dev), labels.to(dev)
    blockwise = None if cfg.attention == "auto" else cfg.attention == "blockwise"
    hidden = drafter_block_hidden(drafter, fz.embed, feats, ids, positions, anchors, blockwise)
    draft_labels = torch.where(labels >= 0, fz.t2d[labels.clamp(min=0)], labels)
    return block_loss(hidden, draft_labels, fz.head, fz.weights, teacher, soft_weight), [r[0] for r in rows]


@torch.no_grad()
def validate(drafter: DFlashDrafter, data: TrainData, indices: list[int], cfg: TrainConfig,
             fz: _Frozen | None = None) -> dict:
    """Held-out acceptance of the drafter, teacher-forced, on the held-out samples `indices`: the
    block at EVERY anchor of each response (cfg.anchors_per_seq blocks per drafter pass), its
    number of leading drafts whose argmax equals the target's token (the drafter sees the target's
    features of every token before its anchor), then the steps greedy decoding would take over
    the response (`objective.decode_walk_steps`). This is the tau `dflash_trt.training.evaluate`
    measures by decoding (the same figure given the same features), at a fraction of the cost.

    Returns:
        {"acceptance_length": tau = sum(response tokens - 1) / sum(decode steps) (float),
         "anchor_mean": 1 + the mean over each sample's anchors of its leading correct drafts,
         averaged over samples (larger than tau; the trainer's "accepted" estimates it),
         "hard_ce": mean over samples of the decay-weighted cross-entropy on the target's tokens,
         "blocks": int}.
    """
    fz = fz or _Frozen.of(drafter, data, cfg)
    was_training = drafter.training
    drafter.eval()
    entries = []  # (sample, its anchors in passes of at most anchors_per_seq)
    for i in indices:
        n = min(len(data.tokens[i]), cfg.max_seq_len + 1)
        every = torch.arange(data.prompt_len[i], n - 1, dtype=torch.int64)
        entries += [(i, chunk) for chunk in torch.split(every, cfg.anchors_per_seq)]
    runs: dict[int, list[torch.Tensor]] = {}
    ce: dict[int, list[float]] = {}
    for start in range(0, len(entries), cfg.seqs_per_step):
        part = entries[start : start + cfg.seqs_per_step]
        out, rows = _blocks_loss(drafter, data, [i for i, _ in part], [a for _, a in part], cfg, fz, 0.0)
        for r, j in enumerate(rows):
            i, anc = part[j]
            runs.setdefault(i, []).append(out.runs[r, : anc.numel()].cpu())
            ce.setdefault(i, []).append(float(out.per_seq_hard_ce[r]) * anc.numel())
    drafter.train(was_training)
    decoded = steps = blocks = 0
    means, ces = [], []
    for i, parts in runs.items():
        r = torch.cat(parts)
        decoded += r.numel()  # response tokens - 1
        steps += decode_walk_steps(r.tolist())
        blocks += r.numel()
        means.append(1 + float(r.float().mean()))
        ces.append(sum(ce[i]) / r.numel())
    n = max(len(means), 1)
    return {"acceptance_length": decoded / steps if steps else 1.0, "anchor_mean": sum(means) / n,
            "hard_ce": sum(ces) / n, "blocks": blocks}


#: train-drafter's flag for the TrainConfig fields whose flag is not their name (resume errors name it).
_FLAGS = {"anchors_per_seq": "--anchors", "bf16_autocast": "--bf16-autocast"}


def settings_differences(checkpoint: dict, cfg: TrainConfig, num_samples: int) -> list[str]:
    """How `cfg` and `num_samples` differ from the settings a training checkpoint (`checkpoint`, as read) was made
    with: "FIELD (--flag) OLD -> NEW" per TrainConfig field, "samples OLD -> NEW"; [] when they agree. Fields added
    after the checkpoint was written take their defaults."""
    saved = {**asdict(TrainConfig()), **checkpoint["config"]}
    differ = [f"{k}{_flag(k)} {saved[k]} -> {v}" for k, v in asdict(cfg).items() if saved.get(k) != v]
    if checkpoint["num_samples"] != num_samples:
        differ.append(f"samples {checkpoint['num_samples']} -> {num_samples}")
    return differ


def _other_settings(path: Path, differ: list[str]) -> DFlashError:
    """The error for a resumed checkpoint at `path` made with other settings (`differ`, `settings_differences`)."""
    return DFlashError(f"{path} was made with other training settings or data ({'; '.join(differ)}); resume with the "
                       "settings it was started with, or remove it to start over")


def check_resume_settings(run_dir: str | Path, cfg: TrainConfig, num_samples: int) -> None:
    """Before the data is generated or loaded: refuse to resume the checkpoint in `run_dir` with training settings
    `cfg` or a sample count (the prompts the data will hold: `--max-samples` or all of them) it was not made with,
    as `train` would after the data step. Nothing to check without a checkpoint. Reads the checkpoint
    memory-mapped (the weights are not loaded).

    Raises:
        DFlashError: naming each difference and the fix.
    """
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        return
    ck = read_torch(path, _damaged_checkpoint_fix(path), weights_only=False, mmap=True)
    differ = settings_differences(ck, cfg, num_samples)
    if differ:
        raise _other_settings(path, differ)


def _flag(field_name: str) -> str:
    """The train-drafter flag that sets TrainConfig field `field_name`, as " (--flag)"; "" if none does."""
    if field_name in _FLAGS:
        return f" ({_FLAGS[field_name]})"
    cli = {"block_size", "seqs_per_step", "epochs", "lr", "gamma", "soft_weight", "max_seq_len", "seed",
           "checkpoint_every", "val_samples", "attention"}
    return f" (--{field_name.replace('_', '-')})" if field_name in cli else ""


def _shape_differences(saved: dict[str, tuple], own: dict[str, tuple]) -> list[str]:
    """How a checkpoint's drafter (tensor name -> shape) differs from this run's, in flag terms:
    the layer count, the draft vocabulary (d2t), the fused target features (fc: target layer ids)."""
    if saved == own:
        return []
    layers = lambda keys: len({k.split(".")[1] for k in keys if k.startswith("layers.")})  # noqa: E731
    out = []
    if layers(saved) != layers(own):
        out.append(f"drafter layers (--num-layers) {layers(saved)} -> {layers(own)}")
    if saved.get("d2t") != own.get("d2t"):
        size = lambda shapes: shapes["d2t"][0] if "d2t" in shapes else "full"  # noqa: E731
        out.append(f"draft vocabulary (--draft-vocab-size) {size(saved)} -> {size(own)}")
    if saved.get("fc.weight") != own.get("fc.weight"):
        out.append(f"fused target features (--target-layer-ids) {saved.get('fc.weight')} -> {own.get('fc.weight')}")
    return out or ["drafter shape (widths)"]


def _check_trainable(data: TrainData, max_seq_len: int) -> None:
    """Every block the trainer draws lies within a sample's first max_seq_len + 1 tokens and starts in
    its response: a sample whose prompt fills that window trains nothing. One stderr warning counts such
    samples; when no sample has 2 response tokens in the window, training would report a loss of 0.

    Raises:
        DFlashError: no sample has 2 response tokens within max_seq_len + 1 (names the longest prompt
            and the fix).
    """
    pairs = list(zip(data.tokens, data.prompt_len))
    cut = sum(len(t) - p >= 2 > min(len(t), max_seq_len + 1) - p for t, p in pairs)  # a response, outside the window
    if not cut:
        return
    if not any(min(len(t), max_seq_len + 1) - p >= 2 for t, p in pairs):
        raise DFlashError(_no_window(max_seq_len, data.prompt_len))
    print(f"warning: {cut} of {len(data)} training samples have no response within --max-seq-len "
          f"{max_seq_len} (their prompts fill the window) and train nothing; {_window_fix(data.prompt_len)}",
          file=sys.stderr)


def _window_fix(prompt_lens: list[int]) -> str:
    return (f"raise --max-seq-len above the prompt lengths (the longest prompt is {max(prompt_lens)} tokens; the "
            "window holds prompt + response), or use shorter prompts")


def _no_window(max_seq_len: int, prompt_lens: list[int]) -> str:
    return (f"no training sample has a response within --max-seq-len {max_seq_len}: each prompt fills the window, "
            f"so nothing would be trained; {_window_fix(prompt_lens)}")


def check_prompt_window(prompt_lens: list[int], max_seq_len: int) -> None:
    """Before data generation (hours): the check of `_check_trainable` that prompt lengths alone decide.
    A sample trains iff its prompt leaves 2 response tokens in its first max_seq_len + 1 tokens, i.e. its
    prompt is shorter than max_seq_len (given a response of 2+ tokens).

    Raises:
        DFlashError: every prompt (token counts `prompt_lens`) is max_seq_len tokens or longer.
    """
    if prompt_lens and min(prompt_lens) >= max_seq_len:
        raise DFlashError(_no_window(max_seq_len, prompt_lens))


def train(drafter: DFlashDrafter, data: TrainData, cfg: TrainConfig, run_dir: str | Path, resume: bool = False,
          time_limit_s: float | None = None, max_steps: int | None = None, progress: bool = True,
          budget_s: float | None = None, init: str | None = None) -> TrainState:
    """Train `drafter` in place on `data`, checkpointing into `run_dir`.

    Args:
        init: how the drafter's weights were started (train-drafter's --init: "target", "random" or the absolute
            path of the drafter fine-tuned), recorded in the checkpoint: a resume from another start is refused
            (its weights are the checkpoint's either way, but its training.json would record the wrong lineage).
            None records nothing and checks nothing.
        budget_s: fit the schedule to this many seconds of training: after `BUDGET_PROBE_STEPS`
            timed steps, the total step count becomes min(epochs' count, the steps that fit in
            what is left of the budget), so warmup + cosine decay end inside the budget instead of
            being cut off. The fitted count is kept in the checkpoint (a resumed run keeps it).
        resume: continue from run_dir/checkpoint.pt (the drafter's weights are replaced by it).
        time_limit_s: stop (after saving a checkpoint) once this much wall time has passed since
            this call began (its own time, not the resumed run's total, nor the time between
            checkpoints); the returned state has finished=False and a rerun with resume=True continues.
        max_steps: stop after this step (for interruption tests); as with time_limit_s. A run resumed
            at or past it trains no further step.
    Returns:
        the TrainState (finished=True once step == total_steps).
    Raises:
        DFlashError: run_dir holds a checkpoint but resume is False, or none but resume is True;
            the checkpoint was made with another TrainConfig, data size or drafter (shape, target
            layer ids, mask token id, `init`); no sample has a response of 2+ tokens (within max_seq_len + 1 tokens:
            `_check_trainable`, which also warns about the samples without one).
        TrainingInterrupted: Ctrl-C (a KeyboardInterrupt) during training; it names the step and
            the last checkpoint, which is complete (checkpoints and best.pt are written to a
            temporary file, fsynced and renamed over the old one; best.pt after the checkpoint
            that names it).
        ConfigError: another process is training into run_dir (`dflash_trt.files.folder_lock`).
        DFlashError: the run diverged: a step's loss is NaN / infinite, or a checkpoint's weights would hold NaN
            / infinite values (raised before anything of it is saved; names the step and --lr).
    """
    t_call = time.perf_counter()  # what time_limit_s is measured from (never reset)
    run = Path(run_dir)
    if resume and not (run / CHECKPOINT).is_file():
        raise DFlashError(f"nothing to resume in {run} (no {CHECKPOINT}); run without --resume to start")
    with folder_lock(run, "drafter training"):
        return _train(drafter, data, cfg, run, resume, time_limit_s, max_steps, progress, budget_s, init, t_call)


def _diverged(step: int, what: str, cfg: TrainConfig, run: Path, checkpoint_step: int | None) -> DFlashError:
    """The error of a run whose loss or weights stopped being finite at `step` (nothing of it is saved)."""
    if checkpoint_step is None:
        kept, fix = "no checkpoint was written", "rerun with a lower --lr"
    else:  # a resume with another --lr is refused (other settings): the run starts over
        kept = f"the last checkpoint in {run} (step {checkpoint_step}) is from before it"
        fix = f"remove {run} and rerun with a lower --lr"
    return DFlashError(f"training diverged at step {step}: {what} (--lr {cfg.lr:g} is likely too high for this "
                       f"data); nothing of that step was saved and no drafter was exported ({kept}); {fix}")


def _train(drafter: DFlashDrafter, data: TrainData, cfg: TrainConfig, run: Path, resume: bool,
           time_limit_s: float | None, max_steps: int | None, progress: bool, budget_s: float | None,
           init: str | None, t_call: float) -> TrainState:
    """`train`, with run_dir locked."""
    ckpt_path = run / CHECKPOINT
    n = len(data)
    if n == 0 or not any(len(t) - p >= 2 for t, p in zip(data.tokens, data.prompt_len)):
        raise DFlashError("no training sample has a response of at least 2 tokens; check the prompts and data")
    _check_trainable(data, cfg.max_seq_len)
    val_idx, train_idx = split_validation(n, cfg)
    n_train = len(train_idx)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    state = TrainState(total_steps=cfg.total_steps(n_train))
    checkpoint_step = None  # the step of the checkpoint on disk (the one a resume continues from)
    if ckpt_path.is_file():
        if not resume:
            raise DFlashError(f"{run} already holds a training checkpoint; pass --resume to continue it, "
                              "or remove the folder to start over")
        ck = read_torch(ckpt_path, _damaged_checkpoint_fix(ckpt_path), weights_only=False)
        differ = settings_differences(ck, cfg, n)
        saved_ids, own_ids = ck.get("target_layer_ids"), list(drafter.config.target_layer_ids)
        if saved_ids is not None and list(saved_ids) != own_ids:  # the same count keeps fc's shape
            differ.append(f"target layer ids (--target-layer-ids) {list(saved_ids)} -> {own_ids}")
        saved_mask, own_mask = ck.get("mask_token_id"), drafter.config.mask_token_id
        if saved_mask is not None and saved_mask != own_mask:  # no shape shows it: the weights learned that token's row
            differ.append(f"mask token id (--mask-token-id) {saved_mask} -> {own_mask}")
        if ck.get("init") is not None and init is not None and ck["init"] != init:
            differ.append(f"init (--init) {ck['init']} -> {init}")
        differ += [d for d in _shape_differences({k: tuple(v.shape) for k, v in ck["drafter"].items()},
                                                 {k: tuple(v.shape) for k, v in drafter.state_dict().items()})
                   if saved_ids is None or "--target-layer-ids" not in d]
        if differ:
            raise _other_settings(ckpt_path, differ)
        drafter.load_state_dict(ck["drafter"])
        opt.load_state_dict(ck["optimizer"])
        state = TrainState(**ck["state"])
        checkpoint_step = state.step
    fz = _Frozen.of(drafter, data, cfg)
    use_soft = cfg.soft_weight > 0 and (data.teacher is not None or data.online is not None)
    drafter.train()

    def save() -> None:
        nonlocal checkpoint_step
        _atomic_save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "state": asdict(state),
                      "config": asdict(cfg), "num_samples": n,
                      "target_layer_ids": list(drafter.config.target_layer_ids),
                      "mask_token_id": drafter.config.mask_token_id, "init": init}, ckpt_path)
        checkpoint_step = state.step

    def save_best() -> None:
        _atomic_save({"drafter": drafter.state_dict(), "step": state.step}, run / BEST)

    def validate_checkpoint() -> bool:
        """Held-out acceptance of the current weights (once per step); True when they are the best
        so far (state.best_step is then this step; the caller writes best.pt: after the checkpoint
        that records it, so an interruption in between leaves a checkpoint whose best.pt a resume
        rewrites, never a best.pt ahead of its checkpoint)."""
        if state.val_history and state.val_history[-1]["step"] == state.step:
            return False
        rec = {"step": state.step, **validate(drafter, data, val_idx, cfg, fz)}
        state.val_history.append(rec)
        # a record without "anchor_mean" is from a run started before the decode-walk tau (its
        # "acceptance_length" was the anchor mean): never compared with the new figures
        best = next((v for v in state.val_history if v["step"] == state.best_step and "anchor_mean" in v), None)
        # ties (a short run often stays at the same acceptance): the lower held-out cross-entropy
        if best is None or (rec["acceptance_length"], -rec["hard_ce"]) > (best["acceptance_length"], -best["hard_ce"]):
            state.best_step, state.best_acceptance_length = state.step, rec["acceptance_length"]
            return True
        return False

    bar = None
    try:
        if checkpoint_step is not None and state.best_step == state.step and _best_step(run) != state.best_step:
            save_best()  # interrupted between the checkpoint and its best.pt: the checkpoint's weights are the best
        if val_idx and state.step == 0 and validate_checkpoint():
            save_best()  # the starting weights (an --init drafter may already be the best)
        t_start = t_begin = time.perf_counter()
        first_step, t_probe = state.step, None
        device_type = next(drafter.parameters()).device.type
        bar = tqdm(total=state.total_steps, initial=state.step, desc="train drafter", unit="step", disable=not progress)
        postfix = {"val_tau": f"{state.val_history[-1]['acceptance_length']:.3f}"} if state.val_history else {}
        window = {**_new_log_window(), **state.log_window}  # a resumed run continues the checkpoint's window
        t_window = time.perf_counter()  # window["seconds"] counts up to here
        while state.step < state.total_steps and (max_steps is None or state.step < max_steps):
            warmup = int(round(cfg.warmup_frac * state.total_steps))
            lr = cfg.lr * cosine_lr(state.step, state.total_steps, warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            slots = [state.step * cfg.seqs_per_step + j for j in range(cfg.seqs_per_step)]
            indices = [train_idx[_sample_slot(cfg, n_train, slot)] for slot in slots]
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
                out, step_blocks = _batch_loss(drafter, data, indices, [cfg.seed * 1_000_003 + slot for slot in slots],
                                               cfg, fz, cfg.soft_weight if use_soft else 0.0)
            if out is not None:
                if not torch.isfinite(out.loss.detach()):
                    raise _diverged(state.step + 1, f"its loss is {out.loss.item()}", cfg, run, checkpoint_step)
                (out.loss / cfg.seqs_per_step).backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            state.step += 1
            state.blocks += step_blocks
            if out is not None:
                window["loss"] += out.loss.item() / max(1, out.sequences)
                window["hard"] += out.hard_ce
                window["soft"] += out.soft_ce
                window["acc"] += out.accepted
                window["k"] += 1
            window["blocks"] += step_blocks
            bar.update(1)
            if budget_s is not None and not state.budget_fitted:
                if state.step == first_step + 5:
                    t_probe = time.perf_counter()
                elif state.step == first_step + 5 + BUDGET_PROBE_STEPS:
                    per_step = (time.perf_counter() - t_probe) / BUDGET_PROBE_STEPS
                    left = budget_s - (time.perf_counter() - t_begin)
                    state.total_steps = max(state.step + 1, min(state.total_steps, state.step + int(left / per_step)))
                    state.budget_fitted = True
                    bar.total = state.total_steps
            if state.step % cfg.log_every == 0 or state.step == state.total_steps:
                rec = _window_record(window, state.step, lr, window["seconds"] + time.perf_counter() - t_window)
                state.history.append(rec)
                postfix.update(loss=f"{rec['loss']:.3f}", anchor_mean=f"{1 + rec['accepted']:.2f}",
                               tok_s=f"{rec['blocks_per_s'] * cfg.block_size:.0f}")
                bar.set_postfix(postfix)
                window, t_window = _new_log_window(), time.perf_counter()
            out_of_time = time_limit_s is not None and time.perf_counter() - t_call >= time_limit_s
            stop_here = max_steps is not None and state.step >= max_steps
            if state.step % cfg.checkpoint_every == 0 or out_of_time or stop_here or state.step == state.total_steps:
                bad = next((name for name, p in drafter.named_parameters() if not torch.isfinite(p.detach()).all()),
                           None)
                if bad is not None:  # never checkpointed, so never exported or resumed from
                    raise _diverged(state.step, f"its update left non-finite values in {bad}", cfg, run,
                                    checkpoint_step)
                better = False
                if val_idx:
                    better = validate_checkpoint()
                    postfix["val_tau"] = f"{state.val_history[-1]['acceptance_length']:.3f}"
                    bar.set_postfix(postfix)  # this checkpoint's figure, not the previous one's
                state.seconds += time.perf_counter() - t_start
                t_start = time.perf_counter()
                state.finished = state.step == state.total_steps
                window["seconds"] += time.perf_counter() - t_window
                t_window = time.perf_counter()
                state.log_window = dict(window)
                save()
                if better:
                    save_best()
            if (out_of_time or stop_here) and state.step < state.total_steps:
                break
    except DFlashError:
        if bar is not None:
            bar.close()  # the error line starts on a line of its own
        raise
    except KeyboardInterrupt as exc:
        from dflash_trt.interrupts import Terminated

        if bar is not None:
            bar.close()  # the message that follows starts on a line of its own
        raise TrainingInterrupted(state.step, state.total_steps, ckpt_path, checkpoint_step,
                                  terminated=isinstance(exc, Terminated)) from None
    bar.close()
    drafter.eval()
    return state


def replace_config(cfg: TrainConfig, **changes) -> TrainConfig:
    return dataclasses.replace(cfg, **changes)
