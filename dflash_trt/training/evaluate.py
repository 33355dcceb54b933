"""Acceptance length (tau) and greedy parity of drafters on held-out prompts.

    python -m dflash_trt.training.evaluate --drafter DIR [--drafter DIR2 ...] [--untrained]
        [--num-prompts 40] [--max-tokens 128] [--block-size 16] [--out DIR] [--teacher-forced]

For each set (HumanEval fixed subset, MT-Bench first turns; `evalsets`), in float32, temperature 0:
the autoregressive outputs (mode "ar", cached in --out so several drafters share them), then each
drafter's DFlash outputs. tau = decoded tokens / verify steps summed over the set's requests (the
first token comes from prefill and is not counted); parity = DFlash output == AR output, per
prompt. `--untrained` adds a randomly initialised drafter (seed 0) of the first drafter's shape,
the figure a trained drafter must beat. Writes acceptance.json, acceptance.md and acceptance.png.
Drafters are named by their folder (with parent folders where two share a name: a/drafter,
b/drafter); a folder given twice is measured once, with a warning.
Each prompt is one user turn of the target's chat template; a target without one (a base model) gets
the plain text, with a warning, and the report names the format used. It is not refused (as
`generate --chat` is): train-drafter trains such a target's drafter on plain text, and that is the
drafter's tau to measure.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.training.evalsets import humaneval_subset, mtbench_subset


def set_tau(results) -> float:
    """Aggregate tau of a list of GenerationResults: sum(decoded tokens) / sum(verify steps)."""
    decoded = sum(max(0, r.metrics.completion_tokens - 1) for r in results)
    steps = sum(r.metrics.verify_steps for r in results)
    return decoded / steps if steps else 0.0


def per_position_rate(results) -> list[float]:
    """Fraction of verify steps in which draft position j + 1 was accepted, j = 0..B-2."""
    steps = sum(r.metrics.verify_steps for r in results)
    width = max((len(r.metrics.accepted_per_position) for r in results), default=0)
    totals = [0] * width
    for r in results:
        for j, c in enumerate(r.metrics.accepted_per_position):
            totals[j] += c
    return [t / steps if steps else 0.0 for t in totals]


def drafter_labels(paths: list[str]) -> list[str]:
    """The report's name of each drafter folder: its folder name, or as many of its last path parts as
    tell it from the others' (a/drafter and b/drafter: "a/drafter", "b/drafter"). `paths` name distinct
    folders (`main` drops repeats first)."""
    parts = [Path(os.path.abspath(p)).parts for p in paths]
    labels = []
    for mine in parts:
        k = 1
        while k < len(mine) and any(o != mine and o[-k:] == mine[-k:] for o in parts):
            k += 1
        labels.append(Path(*mine[-k:]).as_posix())
    return labels


def _note(on: bool, text: str) -> None:
    if on:
        print(f"evaluate: {text}", file=sys.stderr, flush=True)


def _decode(engine: Engine, ids: list[list[int]], params, mode: str, batch_size: int, label: str,
            progress: bool) -> list:
    """`engine.generate` of the prompts `ids`, batch_size at a time, with a tqdm bar of the tokens decoded (on a
    terminal, when `progress`; up to max_tokens per prompt: it ends short of its total when outputs stop early)."""
    from tqdm import tqdm

    results = []
    with tqdm(total=len(ids) * params.max_tokens, desc=f"evaluate: {label}", unit="tok", leave=False,
              disable=None if progress else True) as bar:
        for i in range(0, len(ids), batch_size):
            results += engine.generate(ids[i : i + batch_size], params, mode=mode,
                                       on_tokens=lambda _k, toks, *_: bar.update(len(toks)))
    return results


def teacher_forced(target, drafter, prompts: list[list[int]], outputs: list[list[int]],
                   block_size: int | None = None) -> dict:
    """The trainer's held-out figures (`trainer.validate`) on given responses, with float32 target
    features computed by the target (what decoding has): the teacher-forced tau (the decode walk;
    equal to the decoded tau on the target's own greedy outputs) and the mean over every anchor.

    Args:
        prompts: per request, the prompt token ids; outputs: per request, the response token ids
            (e.g. the autoregressive outputs).
    Returns:
        {"tau": float, "anchor_mean": float, "blocks": int}.
    """
    from dflash_trt.training.pipeline import make_train_data
    from dflash_trt.training.trainer import TrainConfig, validate

    samples = [{"tokens": torch.tensor(p + o, dtype=torch.int32), "prompt_len": len(p)} for p, o in zip(prompts, outputs)]
    ids = drafter.draft_token_ids()
    cfg = TrainConfig(block_size=block_size or drafter.config.block_size, anchors_per_seq=64, seqs_per_step=4,
                      soft_weight=0.0, max_seq_len=max(len(s["tokens"]) for s in samples))
    data = make_train_data(samples, (), tuple(drafter.config.target_layer_ids), target,
                           ids.cpu() if ids is not None else None, soft_labels=False, max_seq_len=cfg.max_seq_len)
    v = validate(drafter, data, list(range(len(samples))), cfg)
    return {"tau": round(v["acceptance_length"], 4), "anchor_mean": round(v["anchor_mean"], 4), "blocks": v["blocks"]}


def read_cache(path: Path | None) -> dict:
    """The evaluate cache in `path` ({} when there is none): a JSON object of {key: AR outputs or a
    drafter's results} (each an object with "outputs" or "tau").

    Raises:
        ConfigError: `path` is not such a cache (not JSON, or another JSON file): it is never replaced,
            so a file given as --cache by mistake is kept; the message names it and the fix.
    """
    if path is None or not path.exists():
        return {}
    try:
        cache = json.loads(path.read_text())
        problem = None if isinstance(cache, dict) else "not a JSON object"
        if problem is None and not all(isinstance(v, dict) and ("outputs" in v or "tau" in v) for v in cache.values()):
            problem = "a JSON object without evaluate's entries"
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        problem = f"not valid JSON ({e})"
    except OSError as e:  # a folder, unreadable
        problem = f"not readable ({e})"
    if problem is None:
        return cache
    raise ConfigError(f"the cache {path} is not an evaluate cache ({problem}), so it is not replaced; give another "
                      "--cache file (or --out folder), or remove that file if it is a cache you no longer need")


#: report["prompt_format"] of a target without a chat template (`encode_prompt` then tokenizes the text as is)
PLAIN_PROMPTS = "plain text: the target has no chat template"


def prompt_format(tokenizer) -> str:
    """How `encode_prompt` feeds the prompt texts: "chat template" (each as one user turn), or
    PLAIN_PROMPTS when the tokenizer has none (as train-drafter trains such a target's drafter)."""
    return "chat template" if getattr(tokenizer, "chat_template", None) else PLAIN_PROMPTS


def evaluate(target, tokenizer, stops, drafters: dict[str, object], sets: dict[str, list[str]],
             max_tokens: int = 128, block_size: int | None = None, ar_cache: Path | None = None,
             batch_size: int = 40, drafter_keys: dict[str, str] | None = None, progress: bool = False,
             with_teacher_forced: bool = False, target_key: str | None = None) -> dict:
    """tau and parity of each drafter (name -> DFlashDrafter) on each prompt set (name -> texts).

    `ar_cache` (a JSON file) keeps the AR outputs and, for drafters with an entry in
    `drafter_keys` (name -> a key that changes with the weights), their results, so a later run
    with more drafters only decodes what is new. `target_key` (a key that changes with the target's weights and
    the device: `main` gives `weights_fingerprint` and --device) is part of every cache key, so another target
    sharing the tokenizer (a fine-tuned one) decodes its own references instead of reusing the first target's. It is rewritten atomically after each decode (an
    interrupted run leaves the last whole version); a file that is not an evaluate cache is refused
    (`read_cache`: ConfigError), never replaced. `progress` prints one stderr line per decode (a set's AR
    reference, each drafter) as it finishes, and on a terminal a bar while it runs: a run takes minutes per set
    on a CPU.

    `with_teacher_forced` adds each drafter's `teacher_forced` figures on the AR outputs (the
    trainer's validation metric beside the decoded tau; not cached).

    Returns {"prompt_format": `prompt_format`, "sets": {set: {"prompts": n, "ar_tokens": ..., "drafters": {name: {"tau", "parity",
    "parity_count", "per_position", "seconds"[, "teacher_forced"]}}}}}.
    """
    from dflash_trt.training.prompts import encode_prompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    from dflash_trt.files import write_json_atomic

    cache = read_cache(ar_cache)
    report: dict = {"max_tokens": max_tokens, "dtype": "float32", "temperature": 0.0,
                    "prompt_format": prompt_format(tokenizer), "sets": {}}
    for set_name, texts in sets.items():
        ids = [encode_prompt(tokenizer, t) for t in texts]
        key = f"{set_name}:{len(ids)}:{max_tokens}:{hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}"
        if target_key:  # the drafters' keys extend this one: every cached result is the target's
            key += f":{target_key}"
        if key not in cache:
            t0 = time.perf_counter()
            outs = [r.token_ids for r in _decode(Engine(target, None, stops), ids, params, "ar", batch_size,
                                                 f"{set_name}: autoregressive reference", progress)]
            cache[key] = {"outputs": outs, "seconds": time.perf_counter() - t0}
            _note(progress, f"{set_name}: autoregressive reference, {len(ids)} prompts, {cache[key]['seconds']:.0f} s")
            if ar_cache is not None:
                write_json_atomic(ar_cache, cache, indent=None)
        ar = cache[key]["outputs"]
        entry = {"prompts": len(ids), "ar_tokens": sum(len(o) for o in ar), "ar_seconds": cache[key]["seconds"],
                 "drafters": {}}
        for name, drafter in drafters.items():
            dkey = f"{key}:{(drafter_keys or {}).get(name)}:{block_size}"
            if (drafter_keys or {}).get(name) and dkey in cache:
                entry["drafters"][name] = dict(cache[dkey])
            else:
                t0 = time.perf_counter()
                results = _decode(Engine(target, DFlashProposer(drafter, target, block_size), stops), ids, params,
                                  "dflash", batch_size, f"{set_name}: {name}", progress)
                same = [r.token_ids == o for r, o in zip(results, ar)]
                d = entry["drafters"][name] = {
                    "tau": round(set_tau(results), 4), "parity": all(same), "parity_count": f"{sum(same)}/{len(same)}",
                    "per_position": [round(x, 4) for x in per_position_rate(results)],
                    "seconds": round(time.perf_counter() - t0, 1)}
                _note(progress, f"{set_name}: {name}: tau {d['tau']:.3f}, parity {d['parity_count']}, {d['seconds']:.0f} s")
                if (drafter_keys or {}).get(name) and ar_cache is not None:
                    cache[dkey] = dict(d)
                    write_json_atomic(ar_cache, cache, indent=None)
            if with_teacher_forced:  # not cached: it needs no decoding
                entry["drafters"][name]["teacher_forced"] = teacher_forced(target, drafter, ids, ar, block_size)
        report["sets"][set_name] = entry
    return report


#: what `write_report` writes into --out, acceptance.json last (`files_as_one_set`)
REPORT_NAMES = ("acceptance.md", "acceptance.png", "acceptance.json")


def write_report(report: dict, out: Path) -> None:
    """acceptance.json, acceptance.md (a table) and acceptance.png (per-position acceptance) in `out` (created if
    missing), as one set (`dflash_trt.files.files_as_one_set`): Ctrl-C or SIGTERM while they are written (the plot
    takes ~1 s) leaves an earlier run's report whole, never this run's JSON beside the earlier run's plot."""
    from dflash_trt.files import files_as_one_set

    with files_as_one_set(out, REPORT_NAMES, prefix=".evaluate-") as tmp:
        _write_report_files(report, tmp)


def _write_report_files(report: dict, out: Path) -> None:
    """`write_report`'s files, written in the (temporary) folder `out`."""
    from dflash_trt.files import write_json_atomic

    write_json_atomic(out / "acceptance.json", report)
    tf = any("teacher_forced" in d for e in report["sets"].values() for d in e["drafters"].values())
    fmt = report.get("prompt_format", "chat template")  # reports from before the field: always the template
    lines = [f"Block size {report.get('block_size')}, temperature 0, float32 on {report.get('device', 'cpu')}, "
             f"max {report['max_tokens']} new tokens.",
             (f"Prompts ({fmt}): a fixed subset of HumanEval (every len/n-th task, wrapped as "
              "'Complete the following Python function.' + the code) and of MT-Bench first turns (every len/n-th "
              "question)." if not report.get("sets_file") else
              f"Prompts ({fmt}): the sets of `{report['sets_file']}` ({', '.join(report['sets'])}).")
             + " tau = decoded tokens / verify steps; parity = DFlash output == autoregressive output.",
             "Measured by: `" + (report.get("command") or (
                 "python -m dflash_trt.training.evaluate --drafter D [--drafter D2] "
                 + (f"--sets-file {report['sets_file']}" if report.get("sets_file") else
                    f"--num-prompts {min(e['prompts'] for e in report['sets'].values())}")
                 + f" --max-tokens {report['max_tokens']} "
                 f"--device {report.get('device', 'cpu')} --out D{' --teacher-forced' if tf else ''}")) + "`.",
             ]
    if tf:
        lines.append("Teacher-forced (`--teacher-forced`): the trainer's validation figures on the AR outputs, "
                     "float32 target features: tau = the verify steps greedy decoding takes when each block "
                     "accepts its leading correct drafts; anchor mean = 1 + mean leading correct drafts over every "
                     "anchor (what the trainer's 'accepted' estimates; larger than tau).")
    lines += ["", "| set | prompts | drafter | tau | greedy parity |" + (" teacher-forced tau | anchor mean |" if tf else ""),
              "|---|---|---|---|---|" + ("---|---|" if tf else "")]
    for s, e in report["sets"].items():
        for name, d in e["drafters"].items():
            t = d.get("teacher_forced")
            extra = (f" {t['tau']:.3f} | {t['anchor_mean']:.3f} |" if t else " | |") if tf else ""
            lines.append(f"| {s} | {e['prompts']} | {name} | {d['tau']:.3f} | {d['parity_count']} |{extra}")
    (out / "acceptance.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report["sets"]), figsize=(6 * len(report["sets"]), 3.5), squeeze=False)
    for ax, (s, e) in zip(axes[0], report["sets"].items()):
        for name, d in e["drafters"].items():
            ax.plot(range(1, len(d["per_position"]) + 1), d["per_position"], marker="o",
                    label=f"{name} (tau {d['tau']:.2f})")
        ax.set_title(f"{s}: {e['prompts']} prompts")
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted fraction of verify steps")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=100)
    plt.close(fig)


def load_sets(path: str | Path) -> dict[str, list[str]]:
    """Prompt sets from a JSON file: {"set name": ["prompt text", ...], ...} (what --dump-sets writes).

    Raises:
        DFlashError: the file is missing or not JSON, or not an object of non-empty lists of
            non-empty strings (the message names the file and the first problem).
    """
    f = Path(path)
    try:
        sets = json.loads(f.read_text())
    except FileNotFoundError:
        raise DFlashError(f"--sets-file {f}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"--sets-file {f}: not valid JSON ({e})") from None
    shape = '{"set name": ["prompt", ...], ...}'
    if not isinstance(sets, dict) or not sets:
        raise DFlashError(f"--sets-file {f}: expected a non-empty JSON object {shape}, got {type(sets).__name__}"
                          + (" {}" if isinstance(sets, dict) else ""))
    for name, texts in sets.items():
        if not isinstance(texts, list) or not texts:
            raise DFlashError(f"--sets-file {f}: set {name!r} must be a non-empty list of prompt strings {shape}")
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
        if bad:
            raise DFlashError(f"--sets-file {f}: set {name!r} item {bad[0]} is not a non-empty string: {texts[bad[0]]!r}")
    return sets


#: the smallest value each integer option takes (checked before anything loads: a usage error, exit 2)
_MINIMUM = {"num_prompts": 1, "max_tokens": 1, "block_size": 2, "threads": 1}


def main(argv: list[str] | None = None) -> dict:
    """The command line (see the module docstring). Values out of range (`_MINIMUM`) and a bad
    --sets-file are usage errors (exit 2); what the package refuses (a missing or non-drafter
    --drafter, a --device it does not run on, a drafter that does not fit the target...) prints one
    `error: ...` line and exits 1; Ctrl-C exits 130 and SIGTERM 143, each with one line. Returns the report ({} with --dump-sets)."""
    ap = argparse.ArgumentParser(prog="python -m dflash_trt.training.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", action="append", default=[], help="drafter folder (repeatable; default: the packaged one)")
    ap.add_argument("--untrained", action="store_true", help="also measure a random drafter of the same shape")
    ap.add_argument("--num-prompts", type=int, default=40,
                    help="prompts per set of the HumanEval / MT-Bench subsets (not used with --sets-file; default: "
                         "%(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="most new tokens per prompt, >= 1 (default: %(default)s)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="draft block size, 2 to 64: block_size - 1 drafts per verify step (default: each drafter's own)")
    ap.add_argument("--out", default=None, help="report folder (default: print only)")
    ap.add_argument("--cache", default=None, help="JSON cache of AR outputs and drafter results (default: OUT/eval_cache.json)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (float32 either way; TF32 stays off; "
                                                    "default: %(default)s)")
    ap.add_argument("--sets-file", default=None,
                    help='JSON {"set name": [prompt texts]} instead of the HumanEval / MT-Bench subsets '
                         "(e.g. written by --dump-sets on a machine that has the dataset packages)")
    ap.add_argument("--dump-sets", default=None, help="write the prompt sets as JSON to this file and exit")
    ap.add_argument("--teacher-forced", action="store_true",
                    help="also report the trainer's validation figures on the AR outputs (teacher-forced tau, anchor mean)")
    args = ap.parse_args(argv)
    for name, low in _MINIMUM.items():
        value = getattr(args, name)
        if value is not None and value < low:
            ap.error(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    if args.block_size is not None and args.block_size > 64:  # as generate / bench take it
        ap.error(f"--block-size must be <= 64 (as generate and bench take it), got {args.block_size}")
    if args.sets_file:
        try:
            sets = load_sets(args.sets_file)
        except DFlashError as e:
            ap.error(str(e))
    else:
        sets = {"humaneval": humaneval_subset(args.num_prompts), "mtbench": mtbench_subset(args.num_prompts)}
        short = {name: len(texts) for name, texts in sets.items() if len(texts) < args.num_prompts}
        if short:  # the sets hold no more prompts: all of them are used
            print(f"note: --num-prompts {args.num_prompts}: " + ", ".join(f"{name} has {n}" for name, n in short.items())
                  + " prompts, all of them used", file=sys.stderr)
    from dflash_trt.interrupts import stopped_by, terminate_as_interrupt

    try:
        with terminate_as_interrupt():  # SIGTERM (kill, timeout, Slurm) stops as Ctrl-C does
            if args.dump_sets:
                Path(args.dump_sets).write_text(json.dumps(sets, indent=1) + "\n")
                print(f"wrote {', '.join(f'{len(t)} {name}' for name, t in sets.items())} prompts to {args.dump_sets}",
                      file=sys.stderr)
                return {}
            return _run(args, sets, sys.argv[1:] if argv is None else argv)
    except (DFlashError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:
        how, code = stopped_by(e)
        cache = args.cache or (Path(args.out) / "eval_cache.json" if args.out else None)
        print(f"evaluate {how}" + (f"; decodes finished so far are cached in {cache}" if cache else "")
              + (f"; an earlier report in {args.out} is unchanged" if args.out else ""), file=sys.stderr)
        sys.exit(code)


def _run(args: argparse.Namespace, sets: dict[str, list[str]], argv: list[str]) -> dict:
    """`main` after parsing: the checks that need no model (--device, --drafter, --out and --cache paths), the
    drafters, the target (each drafter must fit it), then `evaluate` and the report."""
    from dflash_trt.cli.common import check_out_folder, drop_repeats, model_folder
    from dflash_trt.compat import check_compatible
    from dflash_trt.models.checkpoints import check_device, init_drafter, load_drafter, new_drafter_config
    from dflash_trt.models.default import default_drafter_path
    from dflash_trt.models.loading import safetensors_files, weights_fingerprint
    from dflash_trt.training.pipeline import load_target_and_tokenizer

    torch.set_num_threads(args.threads)
    check_device(args.device)
    model_folder("--target", args.target, "target")
    paths = [model_folder("--drafter", p, "drafter") for p in args.drafter] or [str(default_drafter_path())]
    paths = list(drop_repeats("--drafter", paths, "folder", "it is measured once"))
    if args.out:
        check_out_folder("--out", args.out, ("acceptance.json", "acceptance.md", "acceptance.png", "eval_cache.json"))
    cache = Path(args.cache) if args.cache else (Path(args.out) / "eval_cache.json" if args.out else None)
    read_cache(cache)  # a file that is not a cache: refused before any model loads
    drafters = {}
    for label, p in zip(drafter_labels(paths), paths):  # before the target: a bad --drafter fails fast
        try:
            drafters[label] = load_drafter(p).to(args.device)
        except ConfigError as e:  # e.g. a target's folder: name the flag and the path
            raise ConfigError(f"--drafter {p}: {e}") from None
    keys = {}
    for name, p in zip(drafters, paths):
        digest = hashlib.sha256()
        for weights in safetensors_files(p):
            digest.update(weights.read_bytes())
        keys[name] = digest.hexdigest()[:16]
    path, target, tokenizer, stops = load_target_and_tokenizer(args.target, device=args.device)
    for p, drafter in zip(paths, drafters.values()):
        try:
            check_compatible(target.config, drafter.config)
        except DFlashError as e:
            raise type(e)(f"--drafter {p}: {e}") from None
    for p, drafter in zip(paths, drafters.values()):
        if args.block_size is not None and args.block_size > drafter.config.block_size:  # as generate warns
            print(f"warning: --block-size {args.block_size} is larger than the trained block size "
                  f"{drafter.config.block_size} of --drafter {p}; the extra draft positions are rarely accepted",
                  file=sys.stderr, flush=True)
    if prompt_format(tokenizer) == PLAIN_PROMPTS:  # measured all the same: a base model's drafter trains on plain text
        print(f"warning: the target at {path} has no chat template: the prompts are fed as plain text (as train-drafter "
              "feeds them to such a target); the report says so", file=sys.stderr, flush=True)
    if args.untrained:
        first = next(iter(drafters.values())).config
        cfg = new_drafter_config(target.config, first.num_hidden_layers, first.block_size, first.mask_token_id,
                                 list(first.target_layer_ids))
        with tempfile.TemporaryDirectory() as tmp:
            drafters["untrained (random, seed 0)"] = load_drafter(init_drafter(cfg, Path(tmp) / "d", seed=0)).to(
                args.device)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    report = evaluate(target, tokenizer, stops, drafters, sets, args.max_tokens, args.block_size, cache, drafter_keys=keys,
                      progress=True, with_teacher_forced=args.teacher_forced,
                      target_key=f"{weights_fingerprint(path)[:16]}@{args.device}")
    report["block_size"] = args.block_size or next(iter(drafters.values())).config.block_size
    report["drafters"] = dict(itertools.zip_longest(drafters, paths))  # --untrained's has no folder: None
    report["device"] = args.device
    if args.sets_file:
        report["sets_file"] = Path(args.sets_file).name
    report["command"] = "python -m dflash_trt.training.evaluate " + shlex.join(argv)
    print(json.dumps({s: {n: {"tau": d["tau"], "parity": d["parity_count"],
                              **({"teacher_forced": d["teacher_forced"]} if "teacher_forced" in d else {})}
                          for n, d in e["drafters"].items()}
                      for s, e in report["sets"].items()}, indent=2))
    if out:
        write_report(report, out)
    return report


if __name__ == "__main__":
    main()
