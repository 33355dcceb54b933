"""Data-generation throughput: our engine's batched "ar" mode vs Hugging Face `generate`.

Same prompts (the first N of the built-in training corpus), same target (the embedded
SmolLM2-135M-Instruct, float32), greedy, same batch size and token cap, one thread each, run
back to back in one process. Prints response tokens/s of each and whether the outputs agree.

    OMP_NUM_THREADS=1 python build_scripts/bench_datagen.py [--prompts 32] [--batch 32] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from dflash_trt.runtime.engine import Engine
    from dflash_trt.runtime.sampling import SamplingParams
    from dflash_trt.training.pipeline import MIN_PROMPT_BUDGET, encode_all, load_target_and_tokenizer
    from dflash_trt.training.prompts import default_corpus

    path, target, tok, stops = load_target_and_tokenizer(None)
    ids = encode_all(tok, default_corpus()[: args.prompts], path, MIN_PROMPT_BUDGET)
    engine = Engine(target, None, stops)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    ours = []
    for i in range(0, len(ids), args.batch):
        ours += [r.token_ids for r in engine.generate(ids[i : i + args.batch], params, mode="ar")]
    t_ours = time.perf_counter() - t0

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    pad = stops[0]
    t0 = time.perf_counter()
    theirs = []
    with torch.inference_mode():
        for i in range(0, len(ids), args.batch):
            chunk = ids[i : i + args.batch]
            width = max(map(len, chunk))
            inp = torch.tensor([[pad] * (width - len(c)) + c for c in chunk])
            att = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
            out = hf.generate(input_ids=inp, attention_mask=att, max_new_tokens=args.max_new_tokens, do_sample=False,
                              eos_token_id=list(stops), pad_token_id=pad)
            for row in out[:, width:].tolist():
                cut = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
                theirs.append(row[:cut])
    t_hf = time.perf_counter() - t0
    n_ours, n_hf = sum(map(len, ours)), sum(map(len, theirs))
    print(json.dumps({
        "prompts": len(ids), "batch": args.batch, "max_new_tokens": args.max_new_tokens,
        "ours": {"seconds": round(t_ours, 1), "tokens": n_ours, "tokens_per_s": round(n_ours / t_ours, 1)},
        "hf_generate": {"seconds": round(t_hf, 1), "tokens": n_hf, "tokens_per_s": round(n_hf / t_hf, 1)},
        "speedup": round((n_ours / t_ours) / (n_hf / t_hf), 2),
        "identical_outputs": sum(a == b for a, b in zip(ours, theirs)),
    }, indent=2))


if __name__ == "__main__":
    main()
