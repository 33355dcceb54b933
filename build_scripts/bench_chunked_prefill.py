"""Chunked prefill vs a whole prefill in the server's scheduler, side by side in one run on the same model.

The workload: one greedy stream is being written (--stream-tokens, EOS ignored) when a request with a long
prompt (--prompt-tokens) arrives (after the stream's 16th token). Without chunked prefill the step that
admits it reads its whole prompt, and the stream gets no token meanwhile; with `--prefill-chunk-size N`
(`DecodeBatch(prefill_chunk=N)`) each step reads N prompt tokens, then decodes the stream. Outputs must be
identical under every setting (checked).

Per setting (median over --reps, settings alternated after a warm-up): the stream's longest gap between
two tokens (its stall), its latency, and the long request's time to first token and latency; then the
ratios whole / chunked. Chunking trades the stall for a later first token of the long request (more,
smaller passes, each also waiting for a decode step). Prints a table; writes JSON with --out.

Usage: python build_scripts/bench_chunked_prefill.py [--prompt-tokens 1536] [--stream-tokens 96]
       [--chunks 64,256] [--reps 3] [--threads 1] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from bench_inflight import LONG, Timed, write_result  # this folder's in-flight batching benchmark

from dflash_trt.api import load_pipeline
from dflash_trt.runtime.decode_batch import DecodeBatch
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.serve.scheduler import Scheduler, StopText

#: the long prompt: this text repeated to --prompt-tokens tokens (plain, no chat template)
FILLER = ("The lighthouse stood on a rock at the edge of the bay. Each night the keeper climbed the stairs, "
          "trimmed the wick, wound the clockwork and wrote the weather in his log. ")


def run_once(pipe, chunk: int | None, args) -> dict:
    """The workload under one setting: the stream's stall and latency, the long request's TTFT and latency."""
    sched = Scheduler(lambda: DecodeBatch(pipe.engine, "dflash", chunk), max_batch_size=8)
    done, finished, errors = {}, threading.Event(), []

    def on_done(name):
        def record(result, error):
            done[name] = (time.perf_counter(), result)
            if error is not None:
                errors.append(f"{name}: {error}")
            if len(done) == 2 or error is not None:
                finished.set()
        return record

    ids = pipe.encode(FILLER * (args.prompt_tokens // 30 + 1))[: args.prompt_tokens]
    long = Timed(ids, SamplingParams(max_tokens=8, ignore_eos=True), StopText(pipe.decode), None, on_done("long"))

    submitted = []

    def on_progress(count):  # on the generation thread: the long prompt arrives after the stream's 16th token
        if count >= 16 and not submitted:
            long.arrival = time.perf_counter()
            submitted.append(long)
            sched.submit([long])

    stream = Timed(pipe.encode_chat(LONG), SamplingParams(max_tokens=args.stream_tokens, ignore_eos=True),
                   StopText(pipe.decode), None, on_done("stream"), on_progress=on_progress)
    stream.arrival = time.perf_counter()
    sched.submit([stream])
    if not finished.wait(3600):
        raise RuntimeError("the workload did not finish in an hour")
    sched.close()
    if errors:
        raise RuntimeError("a request failed: " + "; ".join(errors))
    return {
        "stream_stall_s": max(b - a for a, b in zip(stream.times, stream.times[1:])),
        "stream_latency_s": done["stream"][0] - stream.arrival,
        "long_ttft_s": long.first_token_at - long.arrival,
        "long_latency_s": done["long"][0] - long.arrival,
        "tokens": {name: r.token_ids for name, (_, r) in done.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=1536)
    ap.add_argument("--stream-tokens", type=int, default=96)
    ap.add_argument("--chunks", default="64,256", help="comma-separated prefill chunk sizes to compare with none")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.stream_tokens <= 32:
        ap.error("--stream-tokens must be above 32 (the long prompt arrives after the 16th)")
    torch.set_num_threads(args.threads)
    pipe = load_pipeline()  # the default model and drafter, the CPU defaults
    settings = {"whole": None, **{f"chunk_{c}": int(c) for c in args.chunks.split(",")}}
    run_once(pipe, 64, argparse.Namespace(**{**vars(args), "prompt_tokens": 128, "stream_tokens": 40}))  # warm-up
    runs = {name: [] for name in settings}
    for _ in range(args.reps):
        for name, chunk in settings.items():
            runs[name].append(run_once(pipe, chunk, args))
    identical = all(r["tokens"] == runs["whole"][0]["tokens"] for rs in runs.values() for r in rs)
    keys = ("stream_stall_s", "stream_latency_s", "long_ttft_s", "long_latency_s")
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    ratios = {name: {k: med["whole"][k] / med[name][k] for k in keys} for name in settings if name != "whole"}
    print(f"{'':20}" + "".join(f"{name:>14}" for name in settings))
    for k in keys:
        print(f"{k:20}" + "".join(f"{med[name][k]:14.3f}" for name in settings))
    for name, r in ratios.items():
        print(f"whole / {name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    print(f"identical outputs under every setting: {identical}")
    write_result(args, med, ratios, identical, "outputs differ between the settings: a chunked prefill bug")


if __name__ == "__main__":
    main()
