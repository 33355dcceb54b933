"""Target forward time with torch's linears vs dflash-trt's packed CPU kernel, side by side in one run.

Loads the default target (SmolLM2-135M-Instruct, float32) three times: with torch's linears (the
runtime's layout before the kernel: contiguous [in, out] weights), with every linear and the lm_head
packed in float32 (`--cpu-kernels on` before the exact formats), and packed in the smallest exact
format (the default: GGUF Q4_1 layers and a Q8_0 lm_head for this model, `dflash_trt.ops.packed_linear`).
Times one forward over t new tokens after a 300-token context (the verify pass of a DFlash step when
t = 1 + drafts; t = 1 is an autoregressive step), plus the lm_head over those t positions,
alternating the models repetition by repetition, and reports the best of --reps for each. Also checks
that the exact-format logits equal the float32-packed ones bit for bit, that a t-token forward's
first row equals a 1-token forward's (batch invariance), and how far they are from torch's. Prints a
table and writes JSON with --out.

Usage: python build_scripts/bench_cpu_kernels.py [--threads 1] [--tokens 1,2,3,4,8,16] [--reps 7] [--out F]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from dflash_trt.models.checkpoints import load_target
from dflash_trt.models.default import default_target_path
from dflash_trt.ops import cpu_isa, cpu_kernels_unavailable

CONTEXT = 300


def forward_ms(model, cache, ids: torch.Tensor, t: int) -> tuple[float, torch.Tensor]:
    positions = torch.arange(CONTEXT, CONTEXT + t)[None]
    start = time.perf_counter()
    out = model(ids[:, :t], positions, cache, CONTEXT + t)
    return (time.perf_counter() - start) * 1000, out.logits[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", default="1,2,3,4,8,16", help="comma-separated new tokens per forward")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()
    why = cpu_kernels_unavailable()
    if why is not None:
        raise SystemExit(f"bench_cpu_kernels: {why}")
    torch.set_num_threads(args.threads)
    path = default_target_path()
    models = {"torch": load_target(path), "packed_f32": load_target(path), "packed": load_target(path)}
    models["packed_f32"].use_packed_linears(formats=("float32",))
    models["packed"].use_packed_linears()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, models["torch"].config.vocab_size, (1, CONTEXT + 16), generator=gen)
    caches = {}
    with torch.inference_mode():
        for name, model in models.items():  # the shared 300-token context, then one warm-up forward
            caches[name] = model.new_cache(1, CONTEXT + 32)
            model(ids[:, :CONTEXT], torch.arange(CONTEXT)[None], caches[name], CONTEXT, with_logits=False)
            forward_ms(model, caches[name], ids[:, CONTEXT:], 2)
        print("row 0 == 1-token: a t-token forward's first row vs a 1-token forward, bit for bit; False for t > 1 "
              "is expected: torch's attention rounds 1 and t query rows differently (docs/kernels.md)", flush=True)
        rows = []
        for t in (int(s) for s in args.tokens.split(",")):
            best = {name: float("inf") for name in models}
            logits = {}
            for _ in range(args.reps):
                for name, model in models.items():
                    ms, logits[name] = forward_ms(model, caches[name], ids[:, CONTEXT:], t)
                    best[name] = min(best[name], ms)
            _, one = forward_ms(models["packed"], caches["packed"], ids[:, CONTEXT:], 1)
            rows.append({"tokens": t, "torch_ms": round(best["torch"], 2),
                         "packed_f32_ms": round(best["packed_f32"], 2), "packed_ms": round(best["packed"], 2),
                         "speedup": round(best["torch"] / best["packed"], 3),
                         "exact_formats_equal_f32": bool(torch.equal(logits["packed"], logits["packed_f32"])),
                         "packed_first_row_equals_1_token": bool(torch.equal(logits["packed"][0], one[0])),
                         "max_abs_logit_diff_vs_torch": float((logits["packed"] - logits["torch"]).abs().max())})
            r = rows[-1]
            print(f"t={t:2d}  torch {r['torch_ms']:6.1f} ms  packed f32 {r['packed_f32_ms']:6.1f} ms  "
                  f"packed {r['packed_ms']:6.1f} ms  speedup {r['speedup']:.2f}x  "
                  f"== f32: {r['exact_formats_equal_f32']}  row 0 == 1-token: {r['packed_first_row_equals_1_token']}  "
                  f"max |logit diff| vs torch {r['max_abs_logit_diff_vs_torch']:.2e}", flush=True)
    formats = sorted({m.format for m in models["packed"].modules() if hasattr(m, "format")})
    result = {"what": "target forward + lm_head over t new tokens after a 300-token context, best of reps (ms)",
              "packed_formats": formats,
              "target": str(path), "threads": args.threads, "reps": args.reps, "dtype": "float32",
              "cpu": platform.processor() or platform.machine(), "kernel_isa": cpu_isa(), "torch": torch.__version__, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
