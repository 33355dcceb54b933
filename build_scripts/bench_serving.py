"""`dflash-trt serve` with DFlash vs the same server without drafting (`--mode ar`), under GuideLLM's load.

What a deployer measures before choosing a server: two real servers (subprocesses, real HTTP on 127.0.0.1),
the default model, same thread count, each loaded with the same requests by GuideLLM (the vLLM project's
load generator; `build_scripts/guidellm_venv.sh` installs it) at each concurrency of --concurrency:
streamed chat requests of the MT-Bench first turns (or HumanEval prompts on /v1/completions), greedy
(temperature 0, sent in the body), at most --max-tokens each. The modes alternate (their order swapped every
repetition) so that both see the same machine state.

Per mode and concurrency (the median over --reps): output tokens/s (GuideLLM's mean over the run), request
latency, time to first token (TTFT), inter-token latency (ITL) and time per output token (TPOT), medians over
requests; tau from the server's own Prometheus counters ((generation tokens - requests) / verify steps); then
the DFlash / ar ratios. The two servers' outputs are compared prompt by prompt: at temperature 0 they must be
identical (the target's greedy output), and the script fails if they are not. On a CPU the runtime drafts only
while one request is running (`--max-concurrency` auto = 1), so at concurrency > 1 DFlash decodes mostly
without drafting: the table shows that too. Prints a table; writes JSON with --out.

Usage: python build_scripts/bench_serving.py [--guidellm /tmp/guidellm-venv/bin/guidellm]
       [--dataset mt-bench|humaneval] [--num-prompts 10] [--max-tokens 128] [--concurrency 1,2] [--reps 1]
       [--threads 1] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MODES = ("dflash", "ar")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(mode: str, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    """A `dflash-trt serve` subprocess in `mode` on a free port (its output in `log`), once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-c", "from dflash_trt.cli import main; main()", "serve", "--threads", str(threads),
           "--port", str(port), "--mode", mode]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise SystemExit(f"the {mode} server did not start; its log: {log}")
            time.sleep(0.5)


def counters(url: str) -> dict[str, float]:
    """The server's Prometheus counters this script reads, summed over their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url + "/prometheus/metrics", timeout=30).read().decode()
    want = {"trtllm_generation_tokens", "trtllm_spec_decode_num_verify_steps", "trtllm_request_success"}
    out = dict.fromkeys(want, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.removesuffix("_total") in want and s.name.endswith("_total"):
                out[s.name.removesuffix("_total")] += s.value
    return out


def run_guidellm(exe: str, url: str, route: str, data: Path, n: int, concurrency: int, max_tokens: int,
                 tokenizer: str, work: Path) -> dict:
    """One GuideLLM benchmark: n requests (the prompts of `data` in order) at `concurrency`; returns its
    figures and the outputs by prompt."""
    out = work / f"guidellm-{time.time_ns()}.json"
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": url, "request_format": route, "max_tokens": max_tokens,
                    "extras": {"body": {"temperature": 0}}},
        "profile": {"kind": "concurrent", "streams": [concurrency]},
        "constraints": [{"kind": "max_requests", "count": n}],
        "data": [{"kind": "json_file", "path": str(data)}],
        "tokenizer": {"kind": "hf_auto", "model": tokenizer},
        "outputs": [{"kind": "json", "path": str(out)}]}}
    path = work / "scenario.json"
    path.write_text(json.dumps(scenario))
    before = counters(url)
    run = subprocess.run([exe, "run", "--scenario", str(path), "--disable-console"], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if run.returncode != 0:
        raise SystemExit(f"guidellm failed ({run.returncode}):\n{run.stderr[-3000:]}")
    after = counters(url)
    [bench] = json.loads(out.read_text())["benchmarks"]
    m = bench["metrics"]
    if m["request_totals"]["successful"] != n:
        raise SystemExit(f"{url}: {m['request_totals']} of {n} requests")

    def median(name: str) -> float:
        return m[name]["successful"]["median"]

    done = bench["requests"]["successful"]
    added = {k: after[k] - before[k] for k in after}
    steps = added["trtllm_spec_decode_num_verify_steps"]
    return {
        "output_tokens_per_s": m["output_tokens_per_second"]["successful"]["mean"],
        "request_latency_s": median("request_latency"), "ttft_ms": median("time_to_first_token_ms"),
        "itl_ms": median("inter_token_latency_ms"), "tpot_ms": median("time_per_output_token_ms"),
        "output_tokens": sum(r["output_metrics"]["text_tokens"] for r in done),
        "tau": (added["trtllm_generation_tokens"] - added["trtllm_request_success"]) / steps if steps else None,
        "outputs": {json.loads(r["request_args"])["body"].get("prompt") or
                    json.dumps(json.loads(r["request_args"])["body"].get("messages")): r["output"] for r in done},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--guidellm", default="/tmp/guidellm-venv/bin/guidellm")
    ap.add_argument("--dataset", choices=("mt-bench", "humaneval"), default="mt-bench")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,2")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not Path(args.guidellm).is_file():
        raise SystemExit(f"no guidellm at {args.guidellm}: run build_scripts/guidellm_venv.sh, or pass --guidellm")
    from dflash_trt.datasets import humaneval_prompts, mt_bench_first_turns
    from dflash_trt.models.default import default_target_path

    prompts = (mt_bench_first_turns if args.dataset == "mt-bench" else humaneval_prompts)(args.num_prompts)
    route = "/v1/chat/completions" if args.dataset == "mt-bench" else "/v1/completions"
    levels = [int(c) for c in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    servers = {mode: start_server(mode, args.threads, work / f"{mode}.log") for mode in MODES}
    runs: dict = {c: {mode: [] for mode in MODES} for c in levels}
    try:
        for rep in range(args.reps):
            for c in levels:
                for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                    print(f"rep {rep + 1}/{args.reps}, concurrency {c}: {mode}", file=sys.stderr, flush=True)
                    runs[c][mode].append(run_guidellm(args.guidellm, servers[mode][1], route, data, len(prompts), c,
                                                      args.max_tokens, str(default_target_path()), work))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    keys = ("output_tokens_per_s", "request_latency_s", "ttft_ms", "itl_ms", "tpot_ms", "tau")
    results = {}
    for c in levels:
        row = {}
        for mode in MODES:
            reps = runs[c][mode]
            row[mode] = {k: statistics.median(r[k] for r in reps) if reps[0][k] is not None else None for k in keys}
            row[mode]["output_tokens"] = reps[0]["output_tokens"]
        outs = [r["outputs"] for mode in MODES for r in runs[c][mode]]
        row["identical_outputs"] = all(o == outs[0] for o in outs)
        row["ratios_dflash_over_ar"] = {k: row["dflash"][k] / row["ar"][k] for k in keys[:5]}
        results[c] = row
    print(f"\n{args.dataset}, {len(prompts)} prompts, <= {args.max_tokens} tokens, temperature 0, "
          f"{args.threads} thread(s), median of {args.reps}")
    print("| concurrency | mode | output tok/s | latency (s) | TTFT (ms) | ITL (ms) | TPOT (ms) | tau |")
    print("|---|---|---|---|---|---|---|---|")
    for c, row in results.items():
        for mode in MODES:
            r = row[mode]
            tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
            print(f"| {c} | {mode} | {r['output_tokens_per_s']:.1f} | {r['request_latency_s']:.2f} | {r['ttft_ms']:.0f} "
                  f"| {r['itl_ms']:.1f} | {r['tpot_ms']:.1f} | {tau} |")
        q = row["ratios_dflash_over_ar"]
        print(f"| {c} | dflash / ar | {q['output_tokens_per_s']:.2f}x | {q['request_latency_s']:.2f}x | "
              f"{q['ttft_ms']:.2f}x | {q['itl_ms']:.2f}x | {q['tpot_ms']:.2f}x | identical: {row['identical_outputs']} |")
    bad = [c for c, row in results.items() if not row["identical_outputs"]]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": vars(args), "machine": platform.processor() or platform.machine(),
                                              "results": results, "runs": {c: {m: [{k: v for k, v in r.items()
                                              if k != "outputs"} for r in runs[c][m]] for m in MODES} for c in levels}},
                                             indent=1))
    if bad:
        raise SystemExit(f"the two servers' outputs differ at concurrency {bad}")


if __name__ == "__main__":
    main()
