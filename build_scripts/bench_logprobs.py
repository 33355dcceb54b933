"""What returning logprobs costs: DFlash decoding with logprobs off, on (the token's own) and with 20
alternatives per token, side by side in one run on the same model and prompts.

Each setting decodes the same chat prompts one at a time (greedy, EOS ignored, --max-tokens each) after a
warm-up, settings alternated per repetition; the outputs must be identical under every setting (checked:
logprobs are read beside the verification, they never change it). Reports output tokens/s per setting
(median over --reps) and each setting's time relative to logprobs off. Logprobs reuse the logits the
verifier computed (`StepLogits`), so the cost is a log-softmax over the vocabulary per emitted token and,
with alternatives, a top-k. Prints a table; writes JSON with --out.

Usage: python build_scripts/bench_logprobs.py [--max-tokens 96] [--reps 3] [--threads 1] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_inflight import write_result  # this folder's in-flight batching benchmark

from dflash_trt.api import load_pipeline
from dflash_trt.runtime.sampling import SamplingParams

CHATS = ("Write a Python function that checks whether a number is prime.",
         "Explain what a KV cache is in two sentences.",
         "List five fruits and their colors.")
#: setting name -> SamplingParams.logprobs
SETTINGS = {"off": None, "logprobs 0": 0, "logprobs 20": 20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load_pipeline(dtype="float32")
    prompts = [pipe.encode_chat(c) for c in CHATS]

    def run(k):
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, logprobs=k)
        t = time.perf_counter()
        outs = [pipe.engine.generate([p], params)[0].token_ids for p in prompts]
        return time.perf_counter() - t, outs

    for k in SETTINGS.values():  # warm-up
        run(k)
    seconds = {name: [] for name in SETTINGS}
    outputs = {}
    for _ in range(args.reps):
        for name, k in SETTINGS.items():
            s, outs = run(k)
            seconds[name].append(s)
            outputs[name] = outs
    identical = all(o == outputs["off"] for o in outputs.values())
    tokens = len(prompts) * args.max_tokens
    med = {name: {"seconds": statistics.median(v), "tokens_per_s": tokens / statistics.median(v)}
           for name, v in seconds.items()}
    ratios = {f"{name} / off (time)": med[name]["seconds"] / med["off"]["seconds"] for name in SETTINGS if name != "off"}
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens, DFlash (CPU defaults), {args.threads} thread(s), "
          f"median of {args.reps}")
    print("| setting | tokens/s | time vs off |\n|---|---|---|")
    for name in SETTINGS:
        print(f"| {name} | {med[name]['tokens_per_s']:.1f} | {med[name]['seconds'] / med['off']['seconds']:.3f}x |")
    print(f"identical outputs: {identical}")
    write_result(args, med, ratios, identical, "outputs differ between settings: logprobs changed the decoding")


if __name__ == "__main__":
    main()
