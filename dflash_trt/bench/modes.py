"""The decoding modes a benchmark compares, each behind one function: prompt ids -> ModeRun.

- dflash: our runtime with the drafter (speculative).
- ar: our runtime without drafting (the baseline every speedup is measured against).
- hf: Hugging Face transformers `generate` (greedy or sampling) on the same weights and dtype.
- hf-prompt-lookup: HF prompt lookup decoding (an n-gram drafter, `prompt_lookup_num_tokens`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dflash_trt.errors import InvalidRequestError
from dflash_trt.runtime.sampling import SamplingParams

MODES = ("dflash", "ar", "hf", "hf-prompt-lookup")
PROMPT_LOOKUP_TOKENS = 10


@dataclass
class ModeRun:
    """One prompt decoded by one mode. Times in seconds; `metrics` holds our runtime's statistics
    (None for the HF modes, which do not report acceptance)."""

    token_ids: list[int]
    seconds: float
    ttft_s: float | None
    metrics: dict | None = field(default=None)


class ModeRunner:
    """Runs prompts through any of MODES on one pipeline (and a lazily loaded HF model)."""

    def __init__(self, pipeline, dtype: torch.dtype):
        self.pipe = pipeline
        self.dtype = dtype
        self._hf = None

    @property
    def hf(self):
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            from dflash_trt.models.loading import no_transformers_bars

            with no_transformers_bars():
                self._hf = AutoModelForCausalLM.from_pretrained(str(self.pipe.target_path), dtype=self.dtype).eval()
            self._hf.to(self.pipe.engine.device)  # the same device as our modes
        return self._hf

    def run(self, mode: str, prompts: list[list[int]], params: list[SamplingParams]) -> list[ModeRun]:
        """Decode `prompts` together (our modes) or one by one (HF modes, batch size 1 only).

        Each ModeRun's `seconds` is the batch's wall time divided evenly among its prompts.
        """
        if mode in ("dflash", "ar"):
            t0 = time.perf_counter()
            results = self.pipe.engine.generate(prompts, params, mode)
            share = (time.perf_counter() - t0) / len(prompts)
            return [ModeRun(r.token_ids, share, r.metrics.time_to_first_token_s, r.metrics.to_dict()) for r in results]
        if len(prompts) != 1:
            raise InvalidRequestError(f"mode {mode} runs at batch size 1; drop it from --modes to bench larger batches")
        return [self._run_hf(mode, prompts[0], params[0])]

    @torch.inference_mode()
    def _run_hf(self, mode: str, prompt: list[int], params: SamplingParams) -> ModeRun:
        ids = torch.tensor([prompt], device=self.pipe.engine.device)
        eos = list(params.stop_token_ids or self.pipe.engine.eos_token_ids)
        kwargs = dict(max_new_tokens=params.max_tokens, eos_token_id=eos, pad_token_id=eos[0] if eos else 0,
                      do_sample=not params.greedy)
        if not params.greedy:
            kwargs.update(temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
            torch.manual_seed(params.seed or 0)
        if mode == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        t0 = time.perf_counter()
        out = self.hf.generate(ids, **kwargs)
        tokens = out[0, len(prompt):].tolist()  # a host copy: on a GPU, the clock stops after the work
        seconds = time.perf_counter() - t0
        return ModeRun(tokens, seconds, None)
