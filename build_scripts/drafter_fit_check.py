"""Does a drafter fit its own training data better than unseen prompts of the same corpus?

The question behind it: is the shipped drafter's tau limited by its training data (it would then
draft its training responses much better than new ones: memorising) or by its fit (capacity and
training steps: both about the same)? BENCHMARKS.md, session 15.

It rebuilds the prompts of a `train-drafter` run (the large corpus by default, as
`finetune_default_drafter_gpu.sh` made the shipped drafter), lists which prompts that run trained
on and which it never saw (`datagen.batch_order` with the run's --gen-batch-size and
--max-samples, then `trainer.split_validation` with its --val-samples), draws N of each, has the
target write their responses here (float32, greedy, as the run did) and reports the
teacher-forced tau (`evaluate.teacher_forced`: the decoded tau, given the same responses) per
group and kind of prompt (function completions vs the rest).

    .venv/bin/python build_scripts/drafter_fit_check.py --out docs/bench/session15/fit_check.json

About 10 minutes on the 2-core dev CPU at the defaults (the target writes 2 x 100 responses).

The code prompts of the large corpus come from installed packages: on another machine the corpus,
and so the split, may differ (the script prints the corpus size; the shipped drafter's was 19,654).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from dflash_trt.models.checkpoints import load_drafter
from dflash_trt.models.default import default_drafter_path
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.training import pipeline
from dflash_trt.training.datagen import batch_order
from dflash_trt.training.evalsets import CODE_INSTRUCTION
from dflash_trt.training.evaluate import teacher_forced
from dflash_trt.training.prompts import large_corpus, load_prompts_jsonl
from dflash_trt.training.trainer import TrainConfig, split_validation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--drafter", default=str(default_drafter_path()), help="the drafter the run made")
    ap.add_argument("--prompts", default=None, help="the run's --prompts JSONL; None = the large corpus")
    ap.add_argument("--max-samples", type=int, default=14000, help="the run's --max-samples")
    ap.add_argument("--gen-batch-size", type=int, default=512, help="the run's --gen-batch-size")
    ap.add_argument("--val-samples", type=int, default=512, help="the run's --val-samples (also never trained on)")
    ap.add_argument("--max-new-tokens", type=int, default=160, help="the run's --max-new-tokens")
    ap.add_argument("--num", type=int, default=100, help="prompts drawn from each group")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="JSON report; None = print only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    corpus = load_prompts_jsonl(args.prompts) if args.prompts else large_corpus()
    print(f"corpus: {len(corpus)} prompts", flush=True)
    path, model, tokenizer, stops = pipeline.load_target_and_tokenizer(None)
    ids = pipeline.encode_all(tokenizer, corpus, path, pipeline.MIN_PROMPT_BUDGET)
    used = [i for b in batch_order([len(p) for p in ids], args.gen_batch_size, args.max_samples) for i in b]
    held, trained = split_validation(len(used), TrainConfig(val_samples=args.val_samples))
    groups_all = {"trained on": [used[j] for j in trained],
                  "never seen": sorted(set(range(len(ids))) - {used[j] for j in trained} - {used[j] for j in held})}
    rng = random.Random(1)
    drafter = load_drafter(args.drafter, torch.float32, "cpu").eval()
    engine = Engine(model, None, stops)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    code_prefix = CODE_INSTRUCTION.split("{code}")[0]
    report = {"drafter": args.drafter, "corpus_prompts": len(corpus), "args": vars(args), "groups": {}}
    for name, pool in groups_all.items():
        pick = rng.sample(pool, min(args.num, len(pool)))
        t0 = time.perf_counter()
        outs = []
        for s in range(0, len(pick), 50):
            outs += [r.token_ids for r in engine.generate([ids[i] for i in pick[s : s + 50]], params, mode="ar")]
        gen_s = time.perf_counter() - t0
        kinds = {"all": list(range(len(pick)))}
        is_code = [corpus[i][-1]["content"].startswith(code_prefix) for i in pick]
        kinds["function completion"] = [k for k, c in enumerate(is_code) if c]
        kinds["other (chat)"] = [k for k, c in enumerate(is_code) if not c]
        entry = {"pool": len(pool), "generation_seconds": round(gen_s, 1)}
        for kind, ks in kinds.items():
            if ks:
                entry[kind] = {"prompts": len(ks), **teacher_forced(model, drafter, [ids[pick[k]] for k in ks],
                                                                    [outs[k] for k in ks])}
        report["groups"][name] = entry
        print(name, json.dumps(entry), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
