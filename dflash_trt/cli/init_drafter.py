"""`dflash-trt init-drafter`: write a correctly shaped, randomly initialised drafter."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("init-drafter")
@click.option("--target", "target", default=None, type=click.Path(),
              help="HF target checkpoint folder (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--out", required=True, type=click.Path(), help="Output folder (z-lab / ModelOpt drafter format).")
@click.option("--num-layers", default=1, show_default=True, type=click.IntRange(1, 64), help="Drafter decoder layers.")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(2, 64),
              help="Draft block size: the drafter fills block size - 1 mask positions per pass (max_draft_len = "
                   "block size - 1).")
@click.option("--mask-token-id", type=int, default=None,
              help="Reserved token id used as the mask (default: 16 for the embedded default target, else the last vocab row, or the tokenizer's highest spare special token when that row is text).")
@click.option("--target-layer-ids", default=None, help="Comma-separated target layer ids (default: the z-lab rule, 5 layers; fewer on a "
              "target of under 8 layers).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the drafter's random weights.")
@click.option("--force", is_flag=True,
              help="Replace an existing --out (once the new drafter is written): a DFlash drafter folder holding only "
                   "what dflash-trt writes there, or an empty folder; anything else there is refused.")
def init_drafter(target, out, num_layers, block_size, mask_token_id, target_layer_ids, seed, force):
    """Write an UNTRAINED DFlash drafter for --target (its config says so; default target: the embedded
    SmolLM2-135M-Instruct, converted on first use).

    The folder is written beside --out under a temporary name and moved into place with ordinary
    modes (0755 folder, 0644 files under umask 022), so a server running as another user can read it.
    The default mask id is 16 for the embedded default target, else the last vocab row, or the tokenizer's
    spare special token when that row is text (`dflash_trt.models.mask_token`); a mask id that occurs in text (an ordinary token, BOS / EOS /
    PAD / UNK, a chat-template marker) gets a warning naming a token to use instead.

    \f
    Raises:
        ConfigError: before anything loads, --out is unusable (`dflash_trt.out_folder.check_out`: empty, '.' or
            '..', inside a bundle, under a file, not writable, existing without --force, or with --force not
            an empty folder nor a DFlash drafter folder holding only what dflash-trt writes there); then the
            errors of --target, --target-layer-ids and the drafter's shape (`check_compatible`); at the end,
            --out changed while it ran so that the same check refuses it (another run's drafter, a user's file):
            left as it is, the new drafter kept as OUT.new (`dflash_trt.out_folder.publish_out`); the drafter cannot
            be written (a full disk: --out and the fix; nothing is left there).
    """
    from dflash_trt.api import load_tokenizer
    from dflash_trt.cli.common import check_mask_token_id, model_folder, parse_layer_ids
    from dflash_trt.compat import check_compatible
    from dflash_trt.config import TargetConfig
    from dflash_trt.errors import CheckpointError, ConfigError
    from dflash_trt.files import cannot_write, staging_folder
    from dflash_trt.models.checkpoints import init_drafter as write, new_drafter_config
    from dflash_trt.models.default import (DEFAULT_MASK_TOKEN_ID, DEFAULT_MASK_TOKEN_WHY, default_target_path,
                                           is_default_target)
    from dflash_trt.models.mask_token import default_mask_token, mask_token_warning
    from dflash_trt.out_folder import DRAFTER, check_out, publish_out, write_target

    check_out("--out", out, DRAFTER, force)
    target = model_folder("--target", target) or str(default_target_path())  # as every other command
    tcfg = TargetConfig.from_pretrained(target, flag="--target")
    ids = parse_layer_ids(target_layer_ids, tcfg.num_hidden_layers)
    try:
        tokenizer = load_tokenizer(Path(target))
    except CheckpointError:  # no tokenizer files: the drafter does not need them, so nothing to check
        tokenizer = None
    if is_default_target(target):
        default_id, why = DEFAULT_MASK_TOKEN_ID, DEFAULT_MASK_TOKEN_WHY
    else:
        default_id, why = default_mask_token(tokenizer, tcfg.vocab_size)
    if mask_token_id is None:
        mask_token_id = default_id
        click.echo(f"mask token id {mask_token_id}: {why} (the default; pass --mask-token-id to choose another "
                   "reserved token of the target's tokenizer)", err=True)
    check_mask_token_id(mask_token_id, tcfg.vocab_size, default_id, why)
    cfg = new_drafter_config(tcfg, num_layers, block_size, mask_token_id, ids)
    check_compatible(tcfg, cfg)
    if tokenizer is not None:
        warning = mask_token_warning(tokenizer, cfg.mask_token_id, default_id)
        if warning:
            click.echo(warning, err=True)
    dst = write_target(out)  # a link to a drafter folder: that folder is replaced, the link stays
    try:
        with staging_folder(dst, "init") as tmp:  # a failure leaves no trace: nor the parents of --out it made
            write(cfg, tmp, seed)
            publish_out(tmp, "--out", out, DRAFTER, force, "init-drafter", "new drafter")  # --out checked again
    except OSError as exc:  # a full disk: --out and the fix, not safetensors' message (what was there is kept)
        raise ConfigError(cannot_write(f"the drafter to --out {out}", exc, "give another --out")
                          + f"; nothing was written to {out}") from None
    click.echo(f"wrote untrained drafter ({num_layers} layer{'' if num_layers == 1 else 's'}, block {block_size}, target layers "
               f"{list(cfg.target_layer_ids)}, mask id {cfg.mask_token_id}) to {out}")
