"""In-flight batching vs static batching in the server's scheduler, side by side in one run on the same model.

The workload a server sees when a long answer is being written and short questions keep arriving: one
long request (--long-tokens) starts; each time it has produced another --every tokens, a short request
(--short-tokens) arrives, --shorts of them (arrivals are tied to the long request's progress, so both
policies see the same arrival pattern whatever the machine's speed). All greedy, EOS ignored, so every
request decodes exactly its token budget and the two policies must give identical outputs (checked).

- in-flight (`Scheduler(in_flight=True)`, what `dflash-trt serve` runs): a short request joins the
  running batch at the next decode step.
- static (`in_flight=False`): it waits until the batch in progress has ended, then the waiting ones
  decode together.

Per policy (median over --reps, alternating the two after a warm-up): the short requests' mean latency
(arrival to last token) and time to first token, the long request's latency, and the makespan; then the
ratios static / in-flight. On a CPU the runtime drafts only for a lone request (`--max-concurrency`
auto), so a long request with company decodes without drafting: the long request may be slower under
in-flight batching, which the long-latency ratio shows. Prints a table; writes JSON with --out.

Usage: python build_scripts/bench_inflight.py [--long-tokens 192] [--short-tokens 16] [--shorts 4]
       [--every 32] [--reps 3] [--threads 1] [--out F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time

import torch

from dflash_trt.api import load_pipeline
from dflash_trt.runtime.decode_batch import DecodeBatch
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.serve.scheduler import Scheduler, Sequence, StopText

LONG = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."
SHORTS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
          "Who wrote Hamlet?", "What is the boiling point of water?", "Name a planet with rings.",
          "What language is spoken in Brazil?", "How many legs does a spider have?"]


class Timed(Sequence):
    """A Sequence that records when its tokens came (`times`, one entry per batch of tokens; `first_token_at`)
    and counts them (`on_progress(count)` after each)."""

    def __init__(self, *args, on_progress=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_token_at = None
        self.times: list[float] = []
        self.tokens = 0
        self.on_progress = on_progress

    def on_tokens(self, ids):
        self.times.append(time.perf_counter())
        if self.first_token_at is None:
            self.first_token_at = self.times[0]
        self.tokens += len(ids)
        if self.on_progress is not None:
            self.on_progress(self.tokens)
        return super().on_tokens(ids)


def run_once(pipe, in_flight: bool, args) -> dict:
    """One workload under one policy: per-request latencies (s) and token ids."""
    sched = Scheduler(lambda: DecodeBatch(pipe.engine, "dflash"), max_batch_size=8, in_flight=in_flight)
    done, finished, errors = {}, threading.Event(), []
    total = 1 + args.shorts

    def on_done(name):
        def record(result, error):
            done[name] = (time.perf_counter(), result)
            if error is not None:
                errors.append(f"{name}: {error}")
            if len(done) == total or error is not None:
                finished.set()
        return record

    shorts = []
    for k in range(args.shorts):
        ids = pipe.encode_chat(SHORTS[k % len(SHORTS)])
        shorts.append(Timed(ids, SamplingParams(max_tokens=args.short_tokens, ignore_eos=True),
                            StopText(pipe.decode), None, on_done(f"short{k}")))

    def on_progress(count):  # runs on the generation thread: a short request arrives every `every` tokens
        due = min(count // args.every, args.shorts)
        while len(submitted) < due:
            s = shorts[len(submitted)]
            s.arrival = time.perf_counter()
            submitted.append(s)
            sched.submit([s])

    submitted: list[Timed] = []
    long_ids = pipe.encode_chat(LONG)
    long = Timed(long_ids, SamplingParams(max_tokens=args.long_tokens, ignore_eos=True), StopText(pipe.decode), None,
                 on_done("long"), on_progress=on_progress)
    start = long.arrival = time.perf_counter()
    sched.submit([long])
    if not finished.wait(3600):
        raise RuntimeError("the workload did not finish in an hour")
    sched.close()
    if errors:
        raise RuntimeError("a request failed: " + "; ".join(errors))
    end = max(t for t, _ in done.values())
    return {
        "short_latency_s": statistics.mean(done[f"short{k}"][0] - shorts[k].arrival for k in range(args.shorts)),
        "short_ttft_s": statistics.mean(shorts[k].first_token_at - shorts[k].arrival for k in range(args.shorts)),
        "long_latency_s": done["long"][0] - start,
        "makespan_s": end - start,
        "tokens": {name: r.token_ids for name, (_, r) in done.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long-tokens", type=int, default=192)
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--shorts", type=int, default=4)
    ap.add_argument("--every", type=int, default=32, help="long-request tokens between two short arrivals")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.every * args.shorts >= args.long_tokens:
        ap.error("--every x --shorts must be below --long-tokens (every short request arrives during the long one)")
    torch.set_num_threads(args.threads)
    pipe = load_pipeline()  # the default model and drafter, the CPU defaults
    run_once(pipe, True, argparse.Namespace(**{**vars(args), "long_tokens": 8, "shorts": 1, "every": 4}))  # warm-up
    runs = {"in_flight": [], "static": []}
    for _ in range(args.reps):
        for name, flag in (("in_flight", True), ("static", False)):
            runs[name].append(run_once(pipe, flag, args))
    identical = all(r["tokens"] == runs["in_flight"][0]["tokens"] for rs in runs.values() for r in rs)
    keys = ("short_latency_s", "short_ttft_s", "long_latency_s", "makespan_s")
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    ratios = {k: med["static"][k] / med["in_flight"][k] for k in keys}
    print(f"{'':22}{'in-flight':>12}{'static':>12}{'static / in-flight':>20}")
    for k in keys:
        print(f"{k:22}{med['in_flight'][k]:12.3f}{med['static'][k]:12.3f}{ratios[k]:19.2f}x")
    print(f"identical outputs under both policies: {identical}")
    write_result(args, med, ratios, identical, "outputs differ between the two policies: a scheduling bug")


def write_result(args, med: dict, ratios: dict, identical: bool, differ: str) -> None:
    """The settings (the command-line arguments but --out), medians, ratios and machine as JSON at --out (if
    given); then exit with `differ` when the outputs were not identical."""
    result = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "median": med, "ratios": ratios,
              "identical_outputs": identical, "machine": {"cpu": platform.processor() or platform.machine(),
                                                          "torch": torch.__version__}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if not identical:
        raise SystemExit(differ)


if __name__ == "__main__":
    main()
