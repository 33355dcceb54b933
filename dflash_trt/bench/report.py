"""Benchmark results -> a Markdown table and PNG plots (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

#: what a bench writes into its --out folder
OUTPUT_NAMES = ("results.md", "tau_histogram.png", "acceptance_by_position.png", "speedup.png", "results.json")


def _fmt(x, spec="{:.2f}"):
    return "-" if x is None else spec.format(x)


def markdown_table(results: dict) -> str:
    """One row per dataset x mode: tau, acceptance rate, drafts verified per step, tok/s, speedups, TTFT,
    identical-to-ar; after a `--profile` run also a table of ms per output token by decode-loop phase."""
    cfg = results.get("config", {})
    sampling = bool(cfg.get("temperature"))  # every request samples: chains cut at the sampled-draft confidence
    confidence = cfg.get("sampled_draft_confidence") if sampling else cfg.get("draft_confidence")
    confidence = cfg.get("draft_confidence") if confidence is None else confidence
    drafting = (f"drafter `{cfg.get('drafter')}`, block size {cfg.get('block_size')}, max draft len "
                f"{cfg.get('max_draft_len')}, draft confidence {confidence}"
                + (f", draft tree top-{cfg['tree_topk']}" if (cfg.get("tree_topk") or 1) > 1 and not sampling else "")
                + (f", prompt lookup {cfg['prompt_lookup']} token{'' if cfg['prompt_lookup'] == 1 else 's'}"
                   if cfg.get("prompt_lookup") else "")
                + (f", max concurrency {cfg.get('max_concurrency') or 'none'}" if "max_concurrency" in cfg else "")
                if cfg.get("block_size") is not None else "no drafter (no dflash mode)")
    threads = results.get("machine", {}).get("threads")
    counts = {ds: entry.get("prompts", cfg.get("num_prompts")) for ds, entry in results["datasets"].items()}
    if len(set(counts.values())) <= 1:
        prompts = next(iter(counts.values()), cfg.get("num_prompts"))
        prompts = f"{prompts} prompt{'' if prompts == 1 else 's'} per dataset"
    else:  # a JSONL with fewer prompts than --num-prompts
        prompts = "prompts per dataset: " + ", ".join(f"{ds} {n}" for ds, n in counts.items())
    lines = [
        f"Target `{cfg.get('target')}`, {drafting}, "
        f"temperature {cfg.get('temperature')}, max tokens {cfg.get('max_tokens')}, {prompts}, "
        f"batch size {cfg.get('batch_size', 1)}, "
        f"{results.get('machine', {}).get('dtype')}, {threads} thread{'' if threads == 1 else 's'}. "
        f"Peak RSS {results.get('peak_rss_mb', 0):.0f} MB."
        + _cpu_line(results)
        + (" Sampling: 'identical to ar' counts equal samples, not a parity check." if sampling else ""),
        "",
        "| dataset | mode | tau | acceptance rate | drafts / step | tok/s | speedup vs ar | speedup vs hf | mean TTFT (ms) "
        "| identical to ar |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ds, entry in results["datasets"].items():
        for mode, m in entry["modes"].items():
            ttft = None if m["mean_ttft_s"] is None else m["mean_ttft_s"] * 1000
            same = "-" if m["identical_to_ar"] is None else f"{m['identical_to_ar']}/{m['prompts']}"  # no ar: "-"
            lines.append(
                f"| {ds} | {mode} | {_fmt(m['acceptance_length'])} | {_fmt(m['acceptance_rate'])} | "
                f"{_fmt(m.get('drafts_per_step'), '{:.1f}')} | {m['tokens_per_s']:.1f} | "
                f"{_fmt(entry.get('speedup_vs_ar', {}).get(mode), '{:.2f}x')} | "
                f"{_fmt(entry.get('speedup_vs_hf', {}).get(mode), '{:.2f}x')} | {_fmt(ttft, '{:.0f}')} | "
                f"{same} |"
            )
    return "\n".join(lines + _breakdown_table(results)) + "\n"


def _breakdown_table(results: dict) -> list[str]:
    """Where the time goes (`bench --profile`): ms per output token by decode-loop phase, per dataset x
    mode that was timed; [] when nothing was."""
    from dflash_trt.runtime.profile import PHASES

    rows = [(ds, mode, m["time_breakdown"]) for ds, entry in results["datasets"].items()
            for mode, m in entry["modes"].items() if m.get("time_breakdown")]
    if not rows:
        return []
    note = ""
    if results.get("config", {}).get("device", "cpu") != "cpu":
        note = (" Profiled on a GPU: every phase boundary synchronized the device, so the tok/s and speedups above "
                "are slower than an unprofiled run's.")
    lines = ["", "Where the time goes: ms per output token by phase of the decode loop (share of the mode's time)."
             + note, "",
             "| dataset | mode | batch steps | " + " | ".join(p.replace("_", " ") for p in PHASES) + " | total |",
             "|---|---|---|" + "---|" * (len(PHASES) + 1)]
    for ds, mode, b in rows:
        ms = b.get("ms_per_token")
        if not ms:  # no output tokens: nothing per token to show
            lines.append(f"| {ds} | {mode} | {b['steps']} | " + " | ".join("-" for _ in PHASES) + " | - |")
            continue
        cells = [f"{ms[p]:.1f} ({100 * b['share'][p]:.0f}%)" for p in PHASES]
        lines.append(f"| {ds} | {mode} | {b['steps']} | " + " | ".join(cells) + f" | {sum(ms.values()):.1f} |")
    return lines


def _cpu_line(results: dict) -> str:
    """" CPU: <model> (<isa> kernels)." from the machine record, or "" for a record without a model
    name (results.json files written before session 18)."""
    machine = results.get("machine", {})
    if not machine.get("cpu_model"):
        return ""
    used = results.get("config", {}).get("cpu_kernels_used")
    kernels = f", {machine['kernel_isa'].upper()} kernels" if used and machine.get("kernel_isa") else (
        ", torch's linears" if used is False else "")
    return f" CPU: {machine['cpu_model']}{kernels}."


def _save(fig, path: Path) -> Path:
    """Write a matplotlib figure as a PNG (100 dpi) and close it."""
    import matplotlib.pyplot as plt

    from dflash_trt.files import naming

    fig.tight_layout()
    try:
        with naming(path):
            fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def _legend_or_note(ax, note: str) -> None:
    """A legend when the plot has labelled data, else `note` in the middle of the axes (an empty
    plot, e.g. a run without the dflash mode, says why instead of warning about missing labels)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    else:
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes)


def plots(results: dict, out_dir: Path) -> list[Path]:
    """tau histogram, acceptance by block position (dflash), speedup per dataset. Returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    dsets = results["datasets"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for ds, e in dsets.items():
        taus = e["modes"].get("dflash", {}).get("tau_per_prompt") or []
        if taus:
            ax.hist(taus, bins=20, alpha=0.6, label=ds)
    ax.set_xlabel("acceptance length tau per prompt (dflash)")
    ax.set_ylabel("prompts")
    _legend_or_note(ax, "no dflash mode in this run")
    paths.append(_save(fig, out_dir / "tau_histogram.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for ds, e in dsets.items():
        acc = e["modes"].get("dflash", {}).get("acceptance_by_position") or []
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=ds)
    ax.set_xlabel("draft position in block")
    ax.set_ylabel("fraction of verify steps accepted")
    ax.set_ylim(0, 1)
    _legend_or_note(ax, "no dflash mode in this run")
    paths.append(_save(fig, out_dir / "acceptance_by_position.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(dsets)
    baseline = any("speedup_vs_ar" in e for e in dsets.values())
    modes = [m for m in next(iter(dsets.values()))["modes"] if m != "ar"] if dsets and baseline else []
    width = 0.8 / max(len(modes), 1)
    for j, mode in enumerate(modes):
        vals = [dsets[ds].get("speedup_vs_ar", {}).get(mode, 0) for ds in names]
        ax.bar([i + j * width for i in range(len(names))], vals, width, label=mode)
    if modes:
        ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel("speedup vs ar (tokens/s ratio)")
    _legend_or_note(ax, "only ar in this run: nothing to compare" if baseline else
                    "no ar mode in this run: no speedup to plot (add ar to --modes)")
    paths.append(_save(fig, out_dir / "speedup.png"))
    return paths


def write_outputs(results: dict, out_dir: Path) -> str:
    """Write results.md, the three plots and results.json (`OUTPUT_NAMES`) into `out_dir` (created if
    missing) as one set (`dflash_trt.files.files_as_one_set`: written in a temporary folder inside it, then renamed
    into place, results.json last), so an interruption while writing leaves an earlier run's files whole rather than
    mixed with this run's. Returns the Markdown table.

    Raises:
        OSError: `out_dir` cannot be created or written (a full disk), naming the file in `out_dir` that failed;
            nothing of this run is left there, not even `out_dir` when this call created it.
    """
    from dflash_trt.files import files_as_one_set, naming, write_json_atomic

    with files_as_one_set(out_dir, OUTPUT_NAMES, prefix=".bench-") as tmp:  # results.json last
        table = markdown_table(results)
        with naming(tmp / "results.md"):
            (tmp / "results.md").write_text(table)
        plots(results, tmp)
        write_json_atomic(tmp / "results.json", results)
    return table
