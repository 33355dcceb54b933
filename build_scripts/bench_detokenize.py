"""Incremental detokenization (`StopText`, what serve, the Triton model, `generate --stop` and the engine's stop
strings run every step for every request) against decoding the whole output again each step (what it did before
session 49), side by side in one run on the SmolLM2 tokenizer.

A real text (HumanEval's prompts joined) is tokenized and fed as a decode loop feeds it: --chunk tokens per step
(about tau: the tokens one verify step emits), `add` then `delta` per step, with one stop string that never
appears (so every step searches). For each output length, the two are alternated --repeats times; the median
total time and the mean time per step are reported, and the ratio. Text and deltas are checked identical.

On a GPU server the decode loop's step is a few milliseconds, and this runs once per request per step on the
CPU: at long outputs and large batches, the whole-output decode is what bounds the step.

Usage: python build_scripts/bench_detokenize.py [--lengths 512,2048,8192] [--chunk 3] [--repeats 3] [--out F]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

from dflash_trt.api import load_tokenizer
from dflash_trt.datasets import humaneval_problems
from dflash_trt.files import write_json_atomic
from dflash_trt.models.default import default_target_path
from dflash_trt.runtime.stop_text import StopText


class WholeDecode(StopText):
    """The reference: never commits, so each step decodes the whole output again."""

    LAG = 10**9


def feed(cls, decode, ids: list[int], chunk: int) -> tuple[float, str, list[str]]:
    """(seconds, final text, deltas) of one decode loop over `ids`."""
    st = cls(decode, ("<never in this text>",))
    deltas = []
    start = time.perf_counter()
    for i in range(0, len(ids), chunk):
        st.add(ids[i : i + chunk])
        deltas.append(st.delta())
    return time.perf_counter() - start, st.text, deltas


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="512,2048,8192", help="output lengths in tokens, comma-separated")
    ap.add_argument("--chunk", type=int, default=3, help="tokens per step (about tau)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.chunk < 1 or args.repeats < 1 or min(lengths) < 1:
        ap.error("--chunk, --repeats and every --lengths value must be positive")

    tok = load_tokenizer(default_target_path())

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    corpus: list[int] = []
    problems = [p["prompt"] for p in humaneval_problems()]
    while len(corpus) < max(lengths):
        corpus += tok.encode("\n\n".join(problems))
    rows = []
    print(f"{'tokens':>7} {'steps':>6} {'whole decode':>14} {'incremental':>13} {'per step (us)':>20} {'ratio':>7}")
    for n in lengths:
        ids = corpus[:n]
        times: dict[str, list[float]] = {"whole": [], "incremental": []}
        for _ in range(args.repeats):
            t_whole, text_whole, d_whole = feed(WholeDecode, decode, ids, args.chunk)
            t_inc, text_inc, d_inc = feed(StopText, decode, ids, args.chunk)
            if (text_whole, d_whole) != (text_inc, d_inc):
                raise SystemExit(f"{n} tokens: incremental text differs from the whole decode")
            times["whole"].append(t_whole)
            times["incremental"].append(t_inc)
        steps = -(-n // args.chunk)
        whole, inc = statistics.median(times["whole"]), statistics.median(times["incremental"])
        rows.append({"tokens": n, "steps": steps, "whole_decode_s": whole, "incremental_s": inc,
                     "whole_per_step_us": whole / steps * 1e6, "incremental_per_step_us": inc / steps * 1e6,
                     "ratio": whole / inc, "identical": True})
        print(f"{n:>7} {steps:>6} {whole * 1e3:>11.1f} ms {inc * 1e3:>10.1f} ms "
              f"{whole / steps * 1e6:>9.0f} -> {inc / steps * 1e6:>6.0f} {whole / inc:>6.1f}x")
    if args.out:
        write_json_atomic(Path(args.out), {"chunk": args.chunk, "repeats": args.repeats, "machine": platform.processor()
                                     or platform.machine(), "tokenizer": "SmolLM2-135M-Instruct", "rows": rows})


if __name__ == "__main__":
    main()
