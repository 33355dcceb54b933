"""Where a decode loop's time goes: wall-clock seconds per phase of `Engine.generate`.

Phases (the steps of the DFlash paper's decoding loop, sec. 3; an "ar" step has no draft or inject phase):
- prefill: the target's pass over the prompts, the first token, and (dflash) the KV injection of
  the prompts' target features into the drafter's cache.
- draft: the drafter's one pass over a block and the choice of drafts (`DFlashProposer.propose`).
- target_forward: the target's decoder layers over the step's tokens (the verify pass; one token in "ar").
- logits_and_accept: the target's lm_head where the verifier reads it, greedy acceptance or
  speculative sampling, and committing the tokens (stop checks, metrics, KV-cache lengths).
- inject: KV injection of the step's target features into the drafter's cache.
- other: the rest of `generate` after its requests are checked (cache allocation, dropping finished
  rows, the loop itself; in "ar" also a training-data feature sink, when one is attached).

On a CUDA device each phase boundary synchronizes the timer's device, so the phases are the work's
own time but the loop runs slower than without a timer (tokens/s of a profiled run are not the
headline figures); on the CPU a timer costs two clock reads per phase. An `Engine` without a timer
(the default) measures nothing.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

PHASES = ("prefill", "draft", "target_forward", "logits_and_accept", "inject", "other")


class PhaseTimer:
    """Seconds per phase (PHASES), summed over every `generate` call made while it is attached
    (`Engine.phase_timer = PhaseTimer(engine.device)`).

    Attributes:
        seconds: {phase: float seconds}; `other` = generate's wall time minus the named phases.
        steps: decode steps of the whole batch (one draft + verify, or one "ar" token); at batch
            size 1 the request's verify_steps, larger batches step together.
        calls: generate() calls.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.sync = self.device.type == "cuda"
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.calls = 0

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        """Add the block's wall time to `seconds[name]` (name in PHASES, not "other").

        Raises:
            ValueError: an unknown phase name.
        """
        if name not in self.seconds or name == "other":
            raise ValueError(f"unknown phase {name!r}; one of {PHASES[:-1]}")
        t0 = self._now()
        try:
            yield
        finally:
            self.seconds[name] += self._now() - t0

    @contextmanager
    def call(self):
        """One generate() call: its wall time not spent in a named phase goes to `other`."""
        before = sum(v for k, v in self.seconds.items() if k != "other")
        t0 = self._now()
        try:
            yield
        finally:
            total = self._now() - t0
            inside = sum(v for k, v in self.seconds.items() if k != "other") - before
            self.seconds["other"] += total - inside  # phases never nest and all run inside: >= 0
            self.calls += 1

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def to_dict(self, tokens: int | None = None) -> dict:
        """{"seconds": {phase: s}, "share": {phase: fraction of total}, "steps", "calls",
        "ms_per_token": {phase: ms per output token} (None without `tokens`, the output tokens of
        the timed calls)}."""
        total = self.total_s
        d = {"seconds": dict(self.seconds), "share": {k: (v / total if total else 0.0) for k, v in self.seconds.items()},
             "steps": self.steps, "calls": self.calls}
        d["ms_per_token"] = {k: 1000 * v / tokens for k, v in self.seconds.items()} if tokens else None
        return d
