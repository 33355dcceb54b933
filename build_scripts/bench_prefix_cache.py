"""Prefix caching on multi-turn chats: with vs without, side by side in one run on the same model.

The workload: MT-Bench's two-turn questions (the first --num-prompts), each a conversation: turn 1 (the first
question, chat template applied), then turn 2 (question, greedy answer, second question). Run by the runtime
(`Engine.generate`, DFlash, greedy, --max-tokens per turn) once without a prefix cache and once with one (kept
over the whole run, as a server keeps it: turn 2 reuses turn 1's prompt and answer, and every turn 1 the chat
template's default system prompt that earlier conversations read), the two settings alternated per
conversation after a warm-up. Outputs must be identical (checked).

Per setting: time to first token of each turn (median and mean), the conversation's latency, the prompt tokens
prefilled vs reused; then the ratios without / with, and the cache's K/V bytes at the end vs the bytes of the same
sequences held each whole. Prints a table; writes JSON with --out.

With --burst N: N requests (MT-Bench first turns behind one ~450-token few-shot system prompt) arriving together,
generated as one batch without a prefix cache and with an empty one (requests read together reuse each other's
shared prefix), alternated --repeats times: the batch's time to first token and latency, outputs checked identical.

With --document T: questions about one long document of at least T tokens (HumanEval's code prompts, joined, then
"what does `function` return?" about each function in it, one user message each: the document is the shared prefix),
asked one at a time without a prefix cache and with one (kept over the run: every question after the first reads
the document's K/V from it), alternated per question after a warm-up: time to first token per question, outputs
checked identical. This is where a prefix cache pays: the prefill it saves grows with the prefix.

Usage: python build_scripts/bench_prefix_cache.py [--num-prompts 10] [--max-tokens 128] [--threads 1]
       [--mode dflash|ar] [--burst N [--repeats 3] | --document T] [--out F]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from dflash_trt.api import load_pipeline
from dflash_trt.datasets import humaneval_problems, mt_bench_questions
from dflash_trt.files import write_json_atomic
from dflash_trt.runtime.prefix_cache import PrefixCache
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.training.prompts import encode_prompt


def conversation(pipe, turns: list[str], max_tokens: int, mode: str) -> dict:
    """Both turns of one question with the engine's current prefix cache (or none): per turn the prompt
    length, reused tokens, time to first token, latency and token ids."""
    messages, out = [], []
    for q in turns:
        messages.append({"role": "user", "content": q})
        ids = encode_prompt(pipe.tokenizer, messages)
        t0 = time.perf_counter()
        [r] = pipe.generate([ids], SamplingParams(max_tokens=max_tokens), mode=mode)
        latency = time.perf_counter() - t0
        out.append({"prompt_tokens": len(ids), "cached_tokens": r.metrics.cached_tokens,
                    "ttft_s": r.metrics.time_to_first_token_s, "latency_s": latency, "token_ids": r.token_ids})
        messages.append({"role": "assistant", "content": pipe.decode(r.token_ids)})
    return {"turns": out, "latency_s": sum(t["latency_s"] for t in out)}


def burst(pipe, questions: list[str], max_tokens: int, mode: str, repeats: int) -> dict:
    """Requests arriving together: `questions` (first turns) behind one few-shot system prompt, generated as one
    batch (`Engine.generate`: one add call, a whole prefill), without a prefix cache and with an empty one (the
    first row reads the shared part, the others copy it), alternated `repeats` times. Time to first token is the
    batch's prefill."""
    system = ("You are a careful assistant. Follow these examples of the answer style. " + " ".join(
        f"Example {i}: Q: What is {i} times {i + 1}? A: {i} times {i + 1} is {i * (i + 1)}." for i in range(1, 16)))
    prompts = [encode_prompt(pipe.tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    eng, out = pipe.engine, {"off": [], "on": []}
    for i in range(repeats):
        for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
            eng.prefix_cache = PrefixCache(1 << 30) if name == "on" else None
            t0 = time.perf_counter()
            rs = pipe.generate(prompts, SamplingParams(max_tokens=max_tokens), mode=mode)
            out[name].append({"ttft_s": rs[0].metrics.time_to_first_token_s, "latency_s": time.perf_counter() - t0,
                              "cached_tokens": [r.metrics.cached_tokens for r in rs],
                              "token_ids": [r.token_ids for r in rs]})
    eng.prefix_cache = None
    return {"requests": len(prompts), "prompt_tokens": [len(p) for p in prompts], "runs": out,
            "identical": all(a["token_ids"] == b["token_ids"] for a, b in zip(out["off"], out["on"])),
            "ttft_median_s": {k: statistics.median(r["ttft_s"] for r in v) for k, v in out.items()},
            "latency_median_s": {k: statistics.median(r["latency_s"] for r in v) for k, v in out.items()}}


def document_prompts(pipe, min_tokens: int, num: int) -> tuple[int, list[list[int]]]:
    """(the document's length in tokens, `num` prompts: one user message each, the document then a question
    about one of its functions). The document: HumanEval's code prompts joined until it holds `min_tokens`
    tokens (and at least `num` functions)."""
    problems, parts = humaneval_problems(), []
    while len(parts) < len(problems) and (len(parts) < num or len(pipe.encode("\n".join(parts))) < min_tokens):
        parts.append(problems[len(parts)]["prompt"])
    doc = "\n".join(parts)
    names = [p["entry_point"] for p in problems[: len(parts)]]
    questions = [f"{doc}\n\nIn the code above, what does `{name}` return? Answer in one sentence." for name in names]
    prompts = [encode_prompt(pipe.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    return len(pipe.encode(doc)), prompts[:num]


def document(pipe, prompts: list[list[int]], max_tokens: int, mode: str) -> dict:
    """Each prompt generated alone without a prefix cache and with one kept over the run, the settings alternated
    per prompt: per setting each prompt's time to first token, reused tokens and token ids."""
    eng, cache, runs = pipe.engine, PrefixCache(1 << 30), {"off": [], "on": []}
    for i, ids in enumerate(prompts):
        for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
            eng.prefix_cache = cache if name == "on" else None
            [r] = pipe.generate([ids], SamplingParams(max_tokens=max_tokens), mode=mode)
            runs[name].append({"prompt_tokens": len(ids), "cached_tokens": r.metrics.cached_tokens,
                               "ttft_s": r.metrics.time_to_first_token_s, "token_ids": r.token_ids})
        print(f"question {i + 1}/{len(prompts)}: TTFT {runs['off'][-1]['ttft_s'] * 1e3:.0f} ms without the cache, "
              f"{runs['on'][-1]['ttft_s'] * 1e3:.0f} ms with it ({runs['on'][-1]['cached_tokens']} of {len(ids)} "
              "prompt tokens reused)", flush=True)
    eng.prefix_cache = None
    later = {k: [r["ttft_s"] for r in v[1:]] for k, v in runs.items()}  # the first question fills the cache
    return {"runs": runs, "identical": all(a["token_ids"] == b["token_ids"] for a, b in zip(runs["off"], runs["on"])),
            "ttft_median_s": {k: statistics.median(v) for k, v in later.items()},
            "ttft_mean_s": {k: statistics.fmean(v) for k, v in later.items()}}


def summary(runs: list[dict]) -> dict:
    s = {}
    for k in (0, 1):
        ttft = [r["turns"][k]["ttft_s"] for r in runs]
        s[f"turn{k + 1}"] = {
            "ttft_median_s": statistics.median(ttft), "ttft_mean_s": statistics.fmean(ttft),
            "prompt_tokens": sum(r["turns"][k]["prompt_tokens"] for r in runs),
            "cached_tokens": sum(r["turns"][k]["cached_tokens"] for r in runs),
        }
    s["conversation_latency_mean_s"] = statistics.fmean(r["latency_s"] for r in runs)
    return s


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace, questions: int) -> None:
    """Before the model loads (a usage error, exit 2): the counts in range (at most MT-Bench's `questions`: more
    ran fewer than asked while the progress counted to the number given; 0 failed on an empty median after the
    run), and --out a file path in a writable folder (it was opened only after the whole run)."""
    from dflash_trt.cli.common import check_out_folder
    from dflash_trt.errors import DFlashError

    for name, low, high in (("num_prompts", 1, questions), ("max_tokens", 1, None), ("threads", 1, None),
                            ("burst", 0, questions), ("repeats", 1, None), ("document", 0, None)):
        value = getattr(args, name)
        if value < low or (high is not None and value > high):
            ap.error(f"--{name.replace('_', '-')} must be >= {low}" + (f" and <= {high} (MT-Bench's questions)" if high
                                                                      else "") + f", got {value}")
    if args.document and args.num_prompts < 2:  # the first question fills the cache: the figures are the others'
        ap.error(f"--document needs --num-prompts >= 2 (the first question fills the cache), got {args.num_prompts}")
    if args.out is not None:
        out = Path(args.out)
        if out.is_dir():
            ap.error(f"--out {out} is a folder; give the path of the JSON file to write (e.g. {out / 'prefix_cache.json'})")
        try:
            check_out_folder("--out", str(out.parent))
        except DFlashError as e:
            ap.error(str(e).replace(f"--out {out.parent}", f"--out {out}: its folder {out.parent}", 1))


def write_out(out: str, result: dict) -> None:
    """`result` as JSON in the file `out` (its folders created if missing), written atomically."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(out), result, indent=1)


def finish(args: argparse.Namespace, result: dict, identical: bool) -> None:
    """The run's end: `result` with the run's settings and machine written to --out (when given); a non-zero exit
    when the outputs differ with the prefix cache."""
    if args.out:
        result.update(max_tokens=args.max_tokens, threads=args.threads, mode=args.mode,
                      machine={"processor": platform.processor() or platform.machine(), "torch": torch.__version__})
        write_out(args.out, result)
        print(f"wrote {args.out}")
    if not identical:
        raise SystemExit("outputs differ with the prefix cache")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mode", choices=["dflash", "ar"], default="dflash")
    ap.add_argument("--burst", type=int, default=0, metavar="N",
                    help="instead: N requests with one few-shot system prompt arriving together (one batch)")
    ap.add_argument("--repeats", type=int, default=3, help="--burst: batches per setting")
    ap.add_argument("--document", type=int, default=0, metavar="T",
                    help="instead: --num-prompts questions about one document of at least T tokens (its shared prefix)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    questions = [q["turns"] for q in mt_bench_questions()]
    check_args(ap, args, len(questions))
    torch.set_num_threads(args.threads)
    pipe = load_pipeline()
    eng = pipe.engine
    if args.burst:
        conversation(pipe, questions[-1], 16, args.mode)  # warm-up
        b = burst(pipe, [q[0] for q in questions[: args.burst]], args.max_tokens, args.mode, args.repeats)
        ttft, lat = b["ttft_median_s"], b["latency_median_s"]
        print(f"{b['requests']} requests together, prompts of {min(b['prompt_tokens'])}-{max(b['prompt_tokens'])} "
              f"tokens, reused per request with the cache: {b['runs']['on'][0]['cached_tokens']}")
        print(f"batch time to first token, median: {ttft['off'] * 1e3:.0f} ms without a prefix cache, "
              f"{ttft['on'] * 1e3:.0f} ms with one: {ttft['off'] / ttft['on']:.2f}x")
        print(f"batch latency, median: {lat['off']:.2f} s vs {lat['on']:.2f} s: {lat['off'] / lat['on']:.2f}x")
        print(f"outputs identical with and without the cache: {b['identical']}")
        b["workload"] = "burst"
        finish(args, b, b["identical"])
        return
    if args.document:
        doc_tokens, prompts = document_prompts(pipe, args.document, args.num_prompts)
        warm = encode_prompt(pipe.tokenizer, [{"role": "user", "content": questions[-1][0]}])
        pipe.generate([warm], SamplingParams(max_tokens=16), mode=args.mode)  # warm-up
        d = document(pipe, prompts, args.max_tokens, args.mode)
        ttft, mean = d["ttft_median_s"], d["ttft_mean_s"]
        print(f"\n{len(prompts)} questions about one {doc_tokens}-token document (prompts of "
              f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens); questions 2-{len(prompts)}:")
        print(f"time to first token, median: {ttft['off'] * 1e3:.0f} ms without a prefix cache, "
              f"{ttft['on'] * 1e3:.0f} ms with one: {ttft['off'] / ttft['on']:.2f}x; mean {mean['off'] * 1e3:.0f} vs "
              f"{mean['on'] * 1e3:.0f} ms: {mean['off'] / mean['on']:.2f}x")
        print(f"outputs identical with and without the cache: {d['identical']}")
        d.update(workload="document questions", document_tokens=doc_tokens, num_prompts=len(prompts),
                 ratios_off_over_on={"ttft_median": ttft["off"] / ttft["on"], "ttft_mean": mean["off"] / mean["on"]})
        finish(args, d, d["identical"])
        return
    cache = PrefixCache(1 << 30)
    # warm-up: a conversation not measured, each setting (the cached one's entries are dropped after)
    for setting in (None, cache):
        eng.prefix_cache = setting
        conversation(pipe, questions[-1], 16, args.mode)
    cache.clear()
    runs = {"off": [], "on": []}
    for i, turns in enumerate(questions[: args.num_prompts]):
        for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
            eng.prefix_cache = cache if name == "on" else None
            runs[name].append(conversation(pipe, turns, args.max_tokens, args.mode))
        print(f"conversation {i + 1}/{args.num_prompts}: turn 2 reused {runs['on'][-1]['turns'][1]['cached_tokens']} "
              f"of {runs['on'][-1]['turns'][1]['prompt_tokens']} prompt tokens", flush=True)
    eng.prefix_cache = None
    # what the cache holds at the end: the radix tree shares each common prefix (the system prompt) once; kept as
    # whole sequences, each would hold its own copy
    per_token = cache.nbytes / cache.held_tokens
    memory = {"sequences": len(cache), "tree_tokens": cache.held_tokens, "tree_bytes": cache.nbytes,
              "whole_sequence_tokens": sum(len(s) for s in cache.sequences())}
    memory["whole_sequence_bytes"] = round(memory["whole_sequence_tokens"] * per_token)
    identical = all(a["turns"][k]["token_ids"] == b["turns"][k]["token_ids"]
                    for a, b in zip(runs["off"], runs["on"]) for k in (0, 1))
    off, on = summary(runs["off"]), summary(runs["on"])
    ratios = {f"turn{k}_ttft_median": off[f"turn{k}"]["ttft_median_s"] / on[f"turn{k}"]["ttft_median_s"] for k in (1, 2)}
    ratios["conversation_latency_mean"] = off["conversation_latency_mean_s"] / on["conversation_latency_mean_s"]
    rows = [("turn 1 TTFT median (ms)", off["turn1"]["ttft_median_s"] * 1e3, on["turn1"]["ttft_median_s"] * 1e3),
            ("turn 2 TTFT median (ms)", off["turn2"]["ttft_median_s"] * 1e3, on["turn2"]["ttft_median_s"] * 1e3),
            ("turn 2 TTFT mean (ms)", off["turn2"]["ttft_mean_s"] * 1e3, on["turn2"]["ttft_mean_s"] * 1e3),
            ("conversation latency mean (s)", off["conversation_latency_mean_s"], on["conversation_latency_mean_s"])]
    print(f"\n{'':32} {'no cache':>10} {'prefix cache':>13} {'ratio':>7}")
    for name, a, b in rows:
        print(f"{name:32} {a:10.2f} {b:13.2f} {a / b:6.2f}x")
    for k in (1, 2):
        t = on[f"turn{k}"]
        print(f"turn {k}: {t['cached_tokens']} of {t['prompt_tokens']} prompt tokens reused "
              f"({t['cached_tokens'] / t['prompt_tokens']:.0%})")
    print(f"K/V held at the end: {memory['tree_bytes'] / 2**20:.1f} MiB for {memory['sequences']} sequences "
          f"({memory['tree_tokens']} positions) vs {memory['whole_sequence_bytes'] / 2**20:.1f} MiB as whole sequences "
          f"({memory['whole_sequence_tokens']}): {memory['whole_sequence_bytes'] / memory['tree_bytes']:.2f}x")
    print(f"outputs identical with and without the cache: {identical}")
    finish(args, {"workload": "mt-bench two-turn conversations", "num_prompts": args.num_prompts, "off": off, "on": on,
                  "ratios_off_over_on": ratios, "outputs_identical": identical, "prefix_cache_memory": memory,
                  "runs": runs}, identical)


if __name__ == "__main__":
    main()
