"""`dflash-trt build`: quantize, shard and package a target + drafter into a deployable bundle.

Progress is one `[i/N] step` line per step (`dflash_trt.build.pipeline.step_titles`; `--dry-run` numbers
its plan the same way). Ctrl-C exits 130, SIGTERM (kill, timeout, docker stop, Slurm) 143, with one line
saying where the build stopped and that nothing was written to --out (the bundle is built in a temporary
folder beside it, renamed at the end; that folder is removed).
stdout carries only the result line (or the --dry-run plan); progress, warnings and ModelOpt's own
messages go to stderr.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
from pathlib import Path

import click

from dflash_trt.cli.common import lower_word


@click.command()
@click.option("--target", type=click.Path(), default=None, help="HF target folder (default: embedded SmolLM2-135M-Instruct).")
@click.option("--drafter", type=click.Path(), default=None, help="DFlash drafter folder (default: the project's drafter).")
@click.option("--out", required=True, type=click.Path(), help="Bundle folder to create, e.g. engines/smollm2-fp8.")
@click.option("--quant", type=click.Choice(["none", "fp8", "nvfp4"], case_sensitive=False), default="none", show_default=True,
              help="Target quantization (ModelOpt FP8_DEFAULT_CFG / NVFP4_DEFAULT_CFG).")
@click.option("--drafter-quant", type=click.Choice(["none", "fp8"], case_sensitive=False), default="none", show_default=True,
              help="fp8: an FP8 drafter (ModelOpt, calibrated while drafting) in runtime/drafter for dflash-trt; "
                   "trtllm/drafter stays unquantized (TensorRT-LLM's DFlash loader reads no FP8 drafter).")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"], case_sensitive=False), default="auto", show_default=True,
              help="fp8: calibrated FP8 K/V scales (ModelOpt FP8_KV_CFG) and kv_cache_config.dtype fp8 for "
                   "TensorRT-LLM; auto: the model's dtype. dflash-trt's own runtime keeps its KV cache in the model "
                   "dtype either way.")
@click.option("--tp-size", type=click.IntRange(1, 64), default=1, show_default=True, help="Tensor-parallel ranks.")
@click.option("--calib-prompts", type=click.Path(), default=None,
              help='JSONL of {"prompt": ...} or {"messages": [...]} lines for calibration (default: built-in corpus; '
                   'never eval sets).')
@click.option("--calib-size", type=click.IntRange(1, 4096), default=32, show_default=True,
              help="Calibration prompts (each cut to its first 256 tokens); a --calib-prompts file holding fewer "
                   "is used whole, with a warning.")
@click.option("--max-batch-size", type=click.IntRange(1, 4096), default=8, show_default=True,
              help="max_batch_size in serve.yaml and the trtllm-build command.")
@click.option("--device", default="cpu", show_default=True, callback=lower_word,
              help="Where calibration and quantization run: cpu, cuda or cuda:N (the target loads there in float32).")
@click.option("--force", is_flag=True, help="Replace an existing bundle (or an empty folder) at --out, only once the new one is "
              "complete; anything else there is refused.")
@click.option("--dry-run", is_flag=True, help="Run the checks (--calib-prompts included) and print the plan; write nothing.")
def build(target, drafter, out, quant, drafter_quant, kv_cache_dtype, tp_size, calib_prompts, calib_size,
          max_batch_size, device, force, dry_run):
    """Build a bundle for TensorRT-LLM (trtllm-serve, LLM API, trtllm-build) and the dflash-trt runtime."""
    from rich.console import Console
    from rich.markup import escape

    from dflash_trt.build.pipeline import BuildInterrupted, BuildOptions, run_build, summary_table
    from dflash_trt.build.pipeline import dry_run as check_and_plan
    from dflash_trt.cli.common import model_folder
    from dflash_trt.errors import ConfigError
    from dflash_trt.interrupts import exit_stopped
    from dflash_trt.models.default import default_drafter_path, default_target_path, drafter_required
    from dflash_trt.out_folder import BUNDLE, out_path

    target, drafter = model_folder("--target", target), model_folder("--drafter", drafter, "drafter")
    why = drafter_required(target, drafter, alternative=None)  # (a --target that is not there is named first)
    if why is not None:
        raise ConfigError(why)
    console = Console(stderr=True)
    opts = BuildOptions(
        target=Path(target) if target else default_target_path(),
        drafter=Path(drafter) if drafter else default_drafter_path(),
        out=out_path("--out", out, BUNDLE), quant=quant, drafter_quant=drafter_quant, kv_cache_dtype=kv_cache_dtype, tp_size=tp_size,
        calib_prompts=Path(calib_prompts) if calib_prompts else None, calib_size=calib_size,
        max_batch_size=max_batch_size, force=force, device=device)
    if dry_run:  # every check of the build (--out and --calib-prompts included), nothing written
        lines = check_and_plan(opts, warn=lambda w: console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False,
                                                                   soft_wrap=True))
        click.echo(f"plan for {opts.out} (dry run, nothing written):")
        for line in lines:
            click.echo(f"  {line}")
        return
    try:  # ModelOpt prints its own lines ("Inserted N quantizers", "current rank: ..."): stdout keeps the result only
        with contextlib.redirect_stdout(sys.stderr):  # SIGTERM raises Terminated: the CLI group's
            # soft_wrap: a long path stays whole (copy-paste, grep); markup off: '[...]' in a path is text
            report = run_build(opts, log=lambda line: console.print(line, highlight=False, soft_wrap=True, markup=False))
    except KeyboardInterrupt as exc:  # Ctrl-C / SIGTERM: one line, exit 130 / 143 (128 + the signal, as a shell says)
        exit_stopped(exc, lambda how, e=exc: str(e) if isinstance(e, BuildInterrupted) else
                     f"build {how}; nothing was written to {opts.out}")
    console.print(summary_table(report))
    q = shlex.quote(str(report.out))  # the commands copy-paste even with spaces in the path
    click.echo(f"bundle written to {report.out}; run it with: dflash-trt generate --bundle {q} --chat '...'; "
               f"serve it with: {shlex.quote(str(report.out / 'trtllm' / 'launch.sh'))}")
