"""Run every mode on the same prompts in one process, interleaved, after a warm-up.

Order: for each prompt, each mode in turn (the starting mode rotates per prompt), so slow drifts
of the machine (thermal, other load) hit every mode alike. Same dtype and thread count for all.
"""

from __future__ import annotations

import dataclasses
import platform
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_trt.bench.modes import ModeRun, ModeRunner
from dflash_trt.errors import InvalidRequestError
from dflash_trt.runtime.sampling import SamplingParams, offset_seed

DATASETS = ("mt-bench", "humaneval")


def encode_dataset(tokenizer, dataset: str, num_prompts: int, source: str = "the target") -> tuple[list[list[int]], list[str]]:
    """Token ids of the first `num_prompts` prompts of `dataset` ("mt-bench", "humaneval" or a JSONL path;
    fewer when it holds fewer), encoded with the target's `tokenizer` (no model needed), and where each
    comes from: "FILE:LINE" for a JSONL file, "mt-bench prompt 3" for a built-in set.

    MT-Bench: first turns in the chat template. HumanEval: the code prompt inside the same chat
    instruction the training corpus uses (`dflash_trt.training.evalsets`). A JSONL file: lines of
    {"prompt": ...} (plain text, no chat template) or {"messages": [...]} (the chat template), as
    `generate --prompts-file` encodes them. `source` names the target in a missing-chat-template error.
    """
    from dflash_trt.cli.common import prompt_file_lines
    from dflash_trt.training.prompts import encode_prompt, load_prompts_jsonl
    from dflash_trt.training.evalsets import humaneval_subset, mtbench_subset

    if dataset in DATASETS:
        questions = (mtbench_subset if dataset == "mt-bench" else humaneval_subset)(num_prompts)
        ids = [encode_prompt(tokenizer, [{"role": "user", "content": q}], source) for q in questions]
        return ids, [f"{dataset} prompt {i}" for i in range(1, len(ids) + 1)]
    if not Path(dataset).exists() or Path(dataset).is_dir():  # a pipe (<(...)) is a file here
        raise InvalidRequestError(f"--dataset must be one of {', '.join(DATASETS)} or a JSONL file; {dataset} is neither")
    items = load_prompts_jsonl(dataset)[:num_prompts]
    wheres = [f"{dataset}:{n}" for n in prompt_file_lines(dataset)[: len(items)]]
    ids = [list(tokenizer(it)["input_ids"]) if isinstance(it, str) else encode_prompt(tokenizer, it, source, where)
           for it, where in zip(items, wheres)]
    return ids, wheres


def load_prompts(pipe, dataset: str, num_prompts: int) -> list[list[int]]:
    """Token ids of `num_prompts` prompts of `dataset` ("mt-bench", "humaneval" or a JSONL path): see
    `encode_dataset`."""
    return encode_dataset(pipe.tokenizer, dataset, num_prompts, f"the target at {pipe.target_path}")[0]


@dataclass
class ModeSummary:
    """Aggregates of one mode on one dataset (sums over prompts; rates from the sums)."""

    mode: str
    prompts: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    tau_per_prompt: list[float] = field(default_factory=list)
    identical_to_ar: int | None = None  # None when the run has no "ar" mode to compare with

    def add(self, run: ModeRun) -> None:
        self.prompts += 1
        self.completion_tokens += len(run.token_ids)
        self.seconds += run.seconds
        if run.ttft_s is not None:
            self.ttft_s.append(run.ttft_s)
        m = run.metrics
        if m:
            self.drafted += m["drafted_tokens"]
            self.accepted += m["accepted_tokens"]
            self.verify_steps += m["verify_steps"]
            self.tau_per_prompt.append(m["acceptance_length"])
            app = m["accepted_per_position"]
            if app:
                if not self.accepted_per_position:
                    self.accepted_per_position = [0] * len(app)
                self.accepted_per_position = [a + b for a, b in zip(self.accepted_per_position, app)]

    def to_dict(self) -> dict:
        decoded = self.completion_tokens - self.prompts  # first tokens come from prefill
        return {
            "mode": self.mode,
            "prompts": self.prompts,
            "completion_tokens": self.completion_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": self.completion_tokens / self.seconds if self.seconds else 0.0,
            "mean_ttft_s": sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else None,
            "verify_steps": self.verify_steps,
            "acceptance_length": decoded / self.verify_steps if self.verify_steps else None,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "drafts_per_step": self.drafted / self.verify_steps if self.drafted else None,
            "acceptance_by_position": [a / self.verify_steps for a in self.accepted_per_position] if self.verify_steps else [],
            "tau_per_prompt": self.tau_per_prompt,
            "identical_to_ar": self.identical_to_ar,
        }


def machine_info(threads: int, dtype: str) -> dict:
    """The results.json "machine" record: CPU architecture and model name, the instruction set the CPU
    kernels are built for here (`dflash_trt.ops.cpu_isa`, null where they cannot run), versions,
    threads, dtype, and the GPU's name (null without CUDA)."""
    from dflash_trt.ops import cpu_isa, cpu_model_name

    return {"cpu": platform.processor() or platform.machine(), "cpu_model": cpu_model_name(),
            "kernel_isa": cpu_isa(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": threads, "dtype": dtype,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def run_benchmark(pipe, datasets: list[str], modes: list[str], num_prompts: int, params: SamplingParams,
                  dtype: torch.dtype, batch_size: int = 1, progress=None, profile: bool = False,
                  prompts: dict[str, list[list[int]]] | None = None) -> dict:
    """Every mode on the same prompts of every dataset. Returns the results.json dict:
    {"datasets": {name: {"prompts": how many ran (at most num_prompts: a JSONL may hold fewer),
    "modes": {mode: summary}, "speedup_vs_ar": {...}, "speedup_vs_hf": {...}}}, ...}.

    profile: our modes (dflash, ar) also time each decode-loop phase (`dflash_trt.runtime.profile`);
    each of their summaries gets "time_breakdown" (PhaseTimer.to_dict: seconds, share, ms per output
    token, steps). The warm-up is not timed. On a CUDA device the timer synchronizes at every phase.

    prompts: each dataset's token ids, encoded already (`encode_dataset`); a dataset missing from it is
    loaded here (`load_prompts`)."""
    from dflash_trt.runtime.profile import PhaseTimer

    runner = ModeRunner(pipe, dtype)
    warm = pipe.encode_chat("Say hello.")
    for mode in modes:  # warm-up: allocator, kernels, lazy HF load
        runner.run(mode, [warm], [SamplingParams(max_tokens=4, temperature=params.temperature, seed=0)])
    out = {"datasets": {}}
    for ds in datasets:
        ds_prompts = prompts[ds] if prompts is not None and ds in prompts else load_prompts(pipe, ds, num_prompts)
        summaries = {m: ModeSummary(m) for m in modes}
        timers = {m: PhaseTimer(pipe.engine.device) for m in modes if profile and m in ("dflash", "ar")}
        for g, lo in enumerate(range(0, len(ds_prompts), batch_size)):
            group = ds_prompts[lo : lo + batch_size]
            group_params = [params if params.greedy else dataclasses.replace(params, seed=offset_seed(params.seed or 0, lo + j))
                            for j in range(len(group))]
            order = modes[g % len(modes):] + modes[: g % len(modes)]
            runs = {}
            for mode in order:
                before, pipe.engine.phase_timer = pipe.engine.phase_timer, timers.get(mode, pipe.engine.phase_timer)
                try:
                    runs[mode] = runner.run(mode, group, group_params)
                finally:
                    pipe.engine.phase_timer = before
                for run in runs[mode]:
                    summaries[mode].add(run)
                if progress:
                    progress(len(group))
            if "ar" in runs:
                for mode, group_runs in runs.items():
                    for run, ref in zip(group_runs, runs["ar"]):
                        same = int(run.token_ids == ref.token_ids)
                        summaries[mode].identical_to_ar = (summaries[mode].identical_to_ar or 0) + same
        modes_d = {m: s.to_dict() for m, s in summaries.items()}
        for m, timer in timers.items():
            modes_d[m]["time_breakdown"] = timer.to_dict(summaries[m].completion_tokens)
        entry = {"prompts": len(ds_prompts), "modes": modes_d}
        for base in ("ar", "hf"):
            if base in modes_d and modes_d[base]["tokens_per_s"]:
                entry[f"speedup_vs_{base}"] = {m: d["tokens_per_s"] / modes_d[base]["tokens_per_s"] for m, d in modes_d.items()}
        out["datasets"][ds] = entry
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
