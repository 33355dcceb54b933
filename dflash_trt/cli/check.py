"""`dflash-trt check`: can this drafter serve this target? Exit 0 (yes) or 1 (no)."""

from __future__ import annotations

import sys

import click

from dflash_trt.text import count


@click.command()
@click.option("--target", type=click.Path(), default=None,
              help="HF target checkpoint folder (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--drafter", type=click.Path(), default=None,
              help="DFlash drafter folder, z-lab / ModelOpt or vLLM speculators format (default: the project's "
                   "drafter).")
@click.option("--bundle", type=click.Path(), default=None,
              help="A `dflash-trt build` bundle: its files verified against its manifest (as generate and serve "
                   "verify them), then its target and drafter checked; replaces --target/--drafter.")
def check(target, drafter, bundle):
    """Run every compatibility check (configs, both models' weights read from their safetensors headers, the
    drafter's weight values, tokenizers); print each problem with its fix. Warnings do not fail the check; a
    passing check names the target and drafter folders it checked (and, with --bundle, that its files were
    verified)."""
    from dflash_trt.cli.common import model_folder
    from dflash_trt.compat import ERROR, check_checkpoints
    from dflash_trt.errors import ConfigError
    from dflash_trt.models.default import default_drafter_path, default_target_path, drafter_required

    bundle_notes: list[str] = []
    if bundle is not None:
        if target is not None or drafter is not None:
            raise click.UsageError("--bundle already holds the target and drafter; drop --target/--drafter")
        target, drafter, bundle_notes = _bundle_models(bundle)
    target = model_folder("--target", target)  # a target that is not there first: no drafter would help
    why = drafter_required(target, drafter, alternative=None)
    if why is not None:
        raise ConfigError(why)
    drafter = model_folder("--drafter", drafter, "drafter")
    target, drafter = target or default_target_path(), drafter or default_drafter_path()
    findings = check_checkpoints(target, drafter)
    for note in bundle_notes:
        click.echo(f"warning: {note}", err=True)
    for f in findings:  # diagnostics on stderr, as every command prints its warnings; the verdict on stdout
        click.echo(f"{f.level}: {f.message}", err=True)
    errors = sum(f.level == ERROR for f in findings)
    if errors:
        click.echo(f"check failed: {count(errors, 'error')}, {count(len(findings) - errors, 'warning')}", err=True)
        sys.exit(1)
    verified = (f"; bundle {bundle}: its target, drafter and tokenizer files match its manifest (sha256)"
                if bundle is not None else "")
    click.echo(f"ok: the drafter fits the target ({count(len(findings), 'warning')}): target {target}, "
               f"drafter {drafter}{verified}")


def _bundle_models(bundle: str) -> tuple[str, str, list[str]]:
    """(target folder, drafter folder, notes on files added since the build that nothing loads) of a bundle whose
    loaded files match its manifest.

    Raises:
        BundleError: a missing bundle or manifest, or a file of the folders it loads missing, altered or added
            (`dflash_trt.build.manifest.verify_files`).
    """
    from dflash_trt.build.manifest import verified_bundle

    _, target, drafter, _, unloaded = verified_bundle(bundle)
    notes = [f"bundle {bundle}: {', '.join(unloaded)} since the build; nothing loads "
             f"{'this file' if len(unloaded) == 1 else 'these files'}"] if unloaded else []
    return str(target), str(drafter), notes
