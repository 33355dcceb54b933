"""`dflash-trt check`: can this drafter serve this target? Exit 0 (yes) or 1 (no)."""

from __future__ import annotations

import sys

import click


@click.command()
@click.option("--target", required=True, type=click.Path(), help="HF target checkpoint folder.")
@click.option("--drafter", required=True, type=click.Path(), help="DFlash drafter folder (z-lab / ModelOpt format).")
def check(target, drafter):
    """Run every compatibility check; print each problem with its fix. Warnings do not fail the check."""
    from dflash_trt.cli.common import model_folder
    from dflash_trt.compat import ERROR, check_checkpoints

    findings = check_checkpoints(model_folder("--target", target), model_folder("--drafter", drafter, "drafter"))
    for f in findings:
        click.echo(f"{f.level}: {f.message}", err=f.level == ERROR)
    errors = sum(f.level == ERROR for f in findings)
    if errors:
        click.echo(f"check failed: {errors} error(s), {len(findings) - errors} warning(s)", err=True)
        sys.exit(1)
    click.echo(f"ok: the drafter fits the target ({len(findings)} warning(s))")
