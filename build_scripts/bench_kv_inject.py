"""KV injection time: the PyTorch path (per layer: k_proj, v_proj, k_norm, RoPE, two cache writes) vs the
fused op (one product over every layer's k_proj / v_proj, then k_norm + RoPE + cache write of all layers
in one pass: csrc/kv_inject.cpp on the CPU, csrc/kv_inject.cu on a CUDA GPU), side by side in one run on
the default drafter (on the CPU: float32, linears packed in both, as the runtime runs them).

Times `DFlashDrafter.inject_context` for c new context tokens of one sequence (c = 1-16: the tokens a
verify step commits; c = 256: a prefill), alternating the two paths repetition by repetition, and
reports the best of --reps for each and their ratio (on a GPU each timing synchronizes before and after:
launch overheads included, as a decode step pays them). Checks the caches agree: on the CPU V exactly
and K to 1e-6; on a GPU to 2 units in the last place of --dtype (cuBLAS may round the one concatenated
product differently from the per-layer ones). Prints a table and writes JSON with --out.

Usage: python build_scripts/bench_kv_inject.py [--device cpu|cuda] [--dtype float32|bfloat16|float16]
       [--threads 1] [--tokens 1,3,8,16,256] [--reps 50] [--out F]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from dflash_trt.models.checkpoints import load_drafter
from dflash_trt.models.default import default_drafter_path
from dflash_trt.ops import cpu_isa, cpu_kernels_unavailable
from dflash_trt.ops.packed_linear import use_packed_linears


def time_ms(drafter, cache, features, positions) -> float:
    cuda = features.is_cuda
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    drafter.inject_context(features, positions, cache, None)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000


def caches_agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    """V exactly and K to 1e-6 on the CPU; both to 2 units in the last place of the dtype on a GPU."""
    if not a.is_cuda:
        return torch.equal(a[1], b[1]) and torch.allclose(a[0], b[0], rtol=1e-6, atol=1e-6)
    ulp = torch.finfo(a.dtype).eps * a.float().abs().clamp_min(1.0)
    return bool(((a.float() - b.float()).abs() <= 2 * ulp).all())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", default="1,3,8,16,256")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.device == "cpu":
        why = cpu_kernels_unavailable() or (None if dtype == torch.float32 else "the CPU op takes float32 only")
        if why is not None:
            raise SystemExit(f"the fused op needs the CPU op library: {why}")
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here")
    torch.set_num_threads(args.threads)
    ref = load_drafter(default_drafter_path(), dtype, args.device)
    fused = load_drafter(default_drafter_path(), dtype, args.device)
    fused.use_fused_injection()
    if args.device == "cpu":
        use_packed_linears(ref)
        use_packed_linears(fused)
    rows = []
    torch.manual_seed(0)
    with torch.inference_mode():
        for c in [int(x) for x in args.tokens.split(",")]:
            features = torch.randn(1, c, ref.config.fc_in_features).to(args.device)
            positions = torch.arange(300, 300 + c, device=args.device)[None]
            caches = {name: m.new_cache(1, 300 + c + 1) for name, m in (("torch", ref), ("fused", fused))}
            best = {"torch": float("inf"), "fused": float("inf")}
            for _ in range(args.reps):
                for name, model in (("torch", ref), ("fused", fused)):
                    best[name] = min(best[name], time_ms(model, caches[name], features, positions))
            assert caches_agree(caches["torch"].buffer, caches["fused"].buffer), "caches differ"
            rows.append({"tokens": c, "torch_ms": best["torch"], "fused_ms": best["fused"],
                         "speedup": best["torch"] / best["fused"]})
    where = (f"{args.threads} thread(s), {cpu_isa()}" if args.device == "cpu"
             else torch.cuda.get_device_name())
    print(f"KV injection, default drafter ({ref.config.num_hidden_layers} layers), {args.dtype}, {where}, "
          f"best of {args.reps}")
    print("| tokens | torch ms | fused ms | torch / fused |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['torch_ms']:.3f} | {r['fused_ms']:.3f} | {r['speedup']:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "isa": cpu_isa(),
                       "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
                       "dtype": args.dtype, "threads": args.threads, "reps": args.reps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
