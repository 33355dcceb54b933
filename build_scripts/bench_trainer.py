"""Drafter-trainer throughput (blocks/s) on a random SmolLM2-135M-shaped target: speed only.

Online target features (one target forward per step), 2-layer drafter, block 16, draft vocabulary
8192, soft labels on. Prints one line per --seqs value and writes JSON with --out.

Usage: python build_scripts/bench_trainer.py --device cuda --seqs 32,64,128 [--anchors 64] [--steps 24] [--bf16-autocast]
       [--attention auto|blockwise|sdpa]   (TrainConfig.attention; time both on a new device)
       [--offline-features]   (random cached features instead of a target forward per step: the CPU recipes' way)
Measured on one H200 (2026-11-29, float32 without TF32): 10.9k / 11.9k / 12.4k blocks/s at 32 / 64 /
128 sequences x 64 anchors; the per-sequence loop it replaced (commit 4b81c27) ran 3.1k at 32.
On the 2 vCPU Sapphire Rapids dev machine (2026-11-30, --device cpu --seqs 4 --steps 8, 2 threads):
59 blocks/s in float32, 113 with --bf16-autocast (AMX); docs/bench/session11/trainer.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dflash_trt.config import TargetConfig
from dflash_trt.models.checkpoints import new_drafter_config
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.layers import use_transposed_weight_layout
from dflash_trt.models.target import TargetModel
from dflash_trt.training.features import OnlineFeatures
from dflash_trt.training.trainer import TrainConfig, TrainData, train
from dflash_trt.training.vocab import target_to_draft

SMOLLM2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "tie_word_embeddings": True, "eos_token_id": 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqs", default="32,64", help="comma-separated sequences per step")
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--tf32", action="store_true")
    ap.add_argument("--bf16-autocast", action="store_true", help="TrainConfig.bf16_autocast")
    ap.add_argument("--attention", default="auto", choices=["auto", "blockwise", "sdpa"], help="TrainConfig.attention")
    ap.add_argument("--offline-features", action="store_true",
                    help="random bfloat16 features and teacher states held in memory (as a data cache gives them) "
                         "instead of computing them with the target every step")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    dev = args.device
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    cfg = TargetConfig.from_hf_config(SMOLLM2)
    torch.manual_seed(0)
    target = use_transposed_weight_layout(TargetModel(cfg).eval().requires_grad_(False)).to(dev)
    gen = torch.Generator().manual_seed(0)
    n = 2048 if not args.offline_features else max(int(x) for x in args.seqs.split(",")) * args.steps
    tokens = [torch.randint(0, cfg.vocab_size, (int(k),), generator=gen, dtype=torch.int32)
              for k in torch.randint(150, 320, (n,), generator=gen)]
    prompt_len = [int(p) for p in torch.randint(40, 120, (n,), generator=gen)]
    ids = torch.arange(8192, device=dev)
    head = target.head_weight[ids].float().contiguous()
    layer_ids = (1, 8, 14, 20, 27)
    if args.offline_features:
        feats = [torch.randn(len(t) - 1, len(layer_ids) * cfg.hidden_size, generator=gen).bfloat16() for t in tokens]
        teacher = [torch.randn(len(t) - 1, cfg.hidden_size, generator=gen).bfloat16() for t in tokens]
        data = TrainData(tokens, prompt_len, feats, teacher, target_to_draft(ids.cpu(), cfg.vocab_size), head,
                         target.embed_weight)
    else:
        data = TrainData(tokens, prompt_len, None, None, target_to_draft(ids.cpu(), cfg.vocab_size), head,
                         target.embed_weight, OnlineFeatures(target, tokens, layer_ids, True, 512))
    results = []
    for seqs in (int(x) for x in args.seqs.split(",")):
        torch.manual_seed(0)
        dcfg = new_drafter_config(cfg, 2, 16, 16, list(layer_ids)).replace(draft_vocab_size=8192)
        drafter = DFlashDrafter(dcfg).to(dev)
        tc = TrainConfig(block_size=16, anchors_per_seq=args.anchors, seqs_per_step=seqs, epochs=100.0,
                         checkpoint_every=10**9, bf16_autocast=args.bf16_autocast, attention=args.attention)
        with tempfile.TemporaryDirectory() as tmp:
            if dev.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            state = train(drafter, data, tc, Path(tmp), max_steps=args.steps, progress=False)
            if dev.startswith("cuda"):
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        row = {"device": dev, "seqs_per_step": seqs, "anchors": args.anchors, "steps": args.steps,
               "blocks_per_s": round(state.blocks / dt), "steps_per_s": round(args.steps / dt, 2), "tf32": args.tf32,
               "bf16_autocast": args.bf16_autocast, "attention": args.attention, "features": "offline" if args.offline_features else "online"}
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
