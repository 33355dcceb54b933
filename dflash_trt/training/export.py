"""Export a trained drafter: z-lab checkpoint folder + training.json + loss-curve PNG.

The folder is written under a temporary name beside `out` and renamed at the end, so an
interrupted export never leaves a folder that looks complete. Weights are the z-lab / ModelOpt
format (z-lab/dflash's config.json and model.safetensors, as ModelOpt's export writes it), loadable strictly by `dflash_trt.models.checkpoints.load_drafter`.

Vocabulary: a drafter trained over a reduced draft vocabulary is exported WITH `d2t` (int64 offsets,
EAGLE-3 / vLLM `speculators` convention) and `draft_vocab_size` in config.json; our runtime loads
it and drafts over those lm_head rows only. TensorRT-LLM's and SGLang's DFlash loaders and vLLM's
z-lab `dflash` loader expect the full vocabulary (the z-lab format has no `d2t`): `full_vocab_copy`
writes that variant (same weights, the full target lm_head at inference).

    python -m dflash_trt.training.export SRC DST [--force]   # full-vocabulary copy of a drafter folder
    python -m dflash_trt.training.export SRC DST --format speculators --target T   # vLLM speculators format
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
from pathlib import Path

import torch

from dflash_trt.config import DrafterConfig
from dflash_trt.files import staging_folder
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.loading import publish_folder, save_checkpoint
from dflash_trt.models.speculators import read_zlab
from dflash_trt.out_folder import DRAFTER, DRAFTER_FILES, publish_out, write_target
from dflash_trt.text import count


def versions() -> dict:
    """Versions of what produced a drafter (recorded in training.json)."""
    import transformers

    import dflash_trt

    return {"dflash_trt": getattr(dflash_trt, "__version__", "0.1.0"), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def plot_loss(history: list[dict], path: str | Path, title: str = "DFlash drafter training",
              val_history: list[dict] | None = None) -> None:
    """Write a PNG of loss (and the training-time acceptance estimate) against step; with
    `val_history` (trainer `TrainState.val_history`) also the held-out acceptance per checkpoint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    marker = "o" if len(steps) < 2 else None  # a single logged step is a point: a line alone would not show it
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [h["loss"] for h in history], label="loss", color="tab:blue", marker=marker)
    ax.plot(steps, [h["hard_ce"] for h in history], label="hard CE", color="tab:cyan", alpha=0.6, marker=marker)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("decay-weighted cross-entropy")
    ax2 = ax.twinx()
    ax2.plot(steps, [1 + h["accepted"] for h in history], label="train anchor mean", color="tab:orange", marker=marker)
    if val_history:
        ax2.plot([v["step"] for v in val_history], [v["acceptance_length"] for v in val_history], marker="o",
                 label="held-out tau (teacher-forced decode)", color="tab:red")
    ax2.set_ylabel("acceptance length")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sample_counts(info: dict) -> str:
    """'N target-written samples', or 'N - V training + V held-out target-written samples' when
    training.json has a `validation` of V held-out samples (they are in data.samples, never trained on)."""
    total = info.get("data", {}).get("samples")
    held = info.get("validation", {}).get("samples")
    if not held or total is None:
        return f"{total} target-written samples"
    return f"{total - held} training + {held} held-out target-written samples"


def bundle_readme(cfg: DrafterConfig, info: dict, speculators: bool = False) -> str:
    """README.md of an exported drafter: what it is and which loaders accept it (`speculators`: the folder is
    in the vLLM speculators format, `dflash_trt.models.speculators`)."""
    reduced = cfg.draft_vocab_size is not None
    if not cfg.trained:  # e.g. the full-vocabulary copy of a `dflash-trt init-drafter` drafter
        origin = "UNTRAINED: random weights (`dflash-trt init-drafter`); few drafts are accepted."
    elif info.get("steps") is None:  # no training.json: not trained here
        origin = "Trained elsewhere (no training.json)."
    else:
        origin = (f"Trained by `dflash-trt train-drafter` ({info.get('steps')} steps on {sample_counts(info)}; see "
                  "training.json, loss.png and acceptance.* when present).")
        if info.get("finished") is False:
            origin += (f" UNFINISHED: the run stopped at step {info.get('steps')} of its {info.get('total_steps')}-step "
                       "schedule (a time limit or --max-steps); `train-drafter ... --resume` trains on.")
    lines = [
        "# DFlash drafter",
        "",
        f"{cfg.num_hidden_layers} layer(s), block size {cfg.block_size}, hidden {cfg.hidden_size}, target layers "
        f"{list(cfg.target_layer_ids)}, mask token id {cfg.mask_token_id}. {origin}",
        "",
    ]
    exported = info.get("exported_step")
    if exported is not None and exported != info.get("steps"):
        best = info.get("validation", {}).get("best_acceptance_length")
        tau = f" ({best:.3f})" if isinstance(best, (int, float)) else ""
        lines += [f"The weights are those of step {exported} of {info.get('steps')}, the best held-out tau{tau} "
                  "(`--keep-best`)" + (": the weights training started from (`--init`), which no later checkpoint beat."
                                       if exported == 0 else "."), ""]
    lines += [
        "## Vocabulary and loaders",
        "",
    ]
    if speculators:
        vocab = (f"a reduced draft vocabulary of {cfg.draft_vocab_size} target tokens (`d2t`, `t2d`, and "
                 "`lm_head.weight`: the target's lm_head rows at the draft ids)" if reduced else "the full target vocabulary")
        lines += [
            f"vLLM `speculators` format (`speculators_model_type: \"dflash\"`), over {vocab}.",
            "",
            "- dflash-trt (this package) and vLLM (`vllm serve TARGET --speculative-config '{\"model\": \"THIS_FOLDER\"}'`; "
            "not tested here, vLLM does not run on the machine that made it) load it.",
            "- TensorRT-LLM (`DFlashDecodingConfig`) and SGLang read the z-lab format over the full vocabulary: write it "
            "with `python -m dflash_trt.training.export THIS_FOLDER OUT_FOLDER`.",
        ]
    elif reduced:
        lines += [
            f"This export predicts over a REDUCED draft vocabulary of {cfg.draft_vocab_size} target tokens: "
            "config.json has `draft_vocab_size` and model.safetensors has `d2t` (int64 offsets, target id = "
            "draft id + d2t[draft id], the EAGLE-3 / vLLM `speculators` convention).",
            "",
            "- dflash-trt (this package): loads it and drafts over those lm_head rows only.",
            "- TensorRT-LLM (`DFlashDecodingConfig`), SGLang (`--speculative-algorithm DFLASH`) and vLLM's `dflash` "
            "method expect z-lab-format drafters over the FULL target vocabulary; the z-lab format has no `d2t`, so "
            "do not give them this folder (not tested here: TensorRT-LLM cannot be installed on the machine that "
            "made it). For them, write the full-vocabulary variant (same weights, no `d2t`):",
            "  `python -m dflash_trt.training.export THIS_FOLDER OUT_FOLDER` (an existing OUT_FOLDER needs `--force`; "
            "a file there is never replaced).",
        ]
    else:
        lines += ["Full target vocabulary, z-lab / ModelOpt format (`DFlashDraftModel`): loadable by dflash-trt, "
                  "TensorRT-LLM's DFlash loader, SGLang and vLLM's `dflash` method."]
    return "\n".join(lines) + "\n"


def export_drafter(drafter: DFlashDrafter, out: str | Path, training_info: dict, history: list[dict],
                   dtype: torch.dtype = torch.float32, extra_files: dict[str, str | bytes] | None = None,
                   replace: bool | None = None) -> Path:
    """Write `drafter` to `out` atomically (temp folder + rename). `replace` None: an existing `out` is replaced;
    True / False (train-drafter's --out): `out` is checked again first (`dflash_trt.out_folder.publish_out`:
    what may be replaced, with --force or not), and where it changed while this ran so that it may not be
    replaced, it is left as it is and the drafter written to OUT.new instead (ConfigError naming both).

    Contents: config.json (trained; `draft_vocab_size` when reduced), model.safetensors (floating
    weights in `dtype`; `d2t` int64 when reduced), training.json (`training_info` + versions),
    loss.png (when `history` is not empty; with the held-out acceptance of `training_info["validation"]
    ["history"]` when there is one), README.md (which loaders accept it), plus `extra_files`
    {name: text or bytes}.
    Folders get mode 0o777 & ~umask, files 0o666 & ~umask (`publish_folder`).
    Returns the final path.
    """
    out = write_target(out)  # a link to a drafter folder: that folder is replaced, the link stays
    with staging_folder(out, "tmp") as tmp:  # removed, with the parents of `out` it made, if this fails
        cfg = drafter.config.replace(trained=True)
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v).cpu().contiguous()
                   for k, v in drafter.state_dict().items()}
        hf = cfg.to_hf_dict()
        hf["torch_dtype"] = str(dtype).replace("torch.", "")
        save_checkpoint(tmp, hf, tensors)
        info = dict(training_info, versions=versions())
        (tmp / "training.json").write_text(json.dumps(info, indent=2) + "\n")
        if history:
            plot_loss(history, tmp / "loss.png", val_history=(training_info.get("validation") or {}).get("history"))
        (tmp / "README.md").write_text(bundle_readme(cfg, info))
        for name, content in (extra_files or {}).items():
            target = tmp / name
            target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
        if replace is None:
            publish_folder(tmp, out)  # readable modes (mkdtemp makes 0700, safetensors 0600), then the rename
        else:
            publish_out(tmp, "--out", out, DRAFTER, replace, "train-drafter's export", "trained drafter")
    return out


def _check_copy_paths(src: Path, dst: str | Path, force: bool) -> None:
    """Refuse a `full_vocab_copy` destination that would lose data or fail at the end, before anything is
    read or written: `dst` equal to `src`, inside it or holding it (always: publishing `dst` would replace
    `src` or write into it), then `dflash_trt.out_folder.check_out` (as init-drafter and train-drafter check
    --out): empty, '.' or '..', inside a bundle, under a file, not writable, existing without `force`, and
    with `force` anything but an empty folder or a DFlash drafter folder holding only what dflash-trt writes.

    Raises:
        ConfigError: naming the path and the fix.
    """
    from dflash_trt.errors import ConfigError

    from dflash_trt.models.loading import path_overlap
    from dflash_trt.out_folder import DRAFTER, check_out

    where = path_overlap(dst, src) if str(dst).strip() else None
    if where is not None:
        raise ConfigError(f"DST {dst} {where} SRC {src}; write the copy to a folder outside the source drafter "
                          "(--force does not change this)")
    check_out("DST", dst, DRAFTER, force)


def copied_files(src: Path) -> list[str]:
    """The files of drafter folder `src` that `full_vocab_copy` copies: those dflash-trt writes in a drafter
    folder (`out_folder.DRAFTER_FILES`, so the copy is one --force may replace later) but the weights, the
    config and README.md (written anew) and acceptance.* (measured on the reduced vocabulary: the full one
    drafts differently, argmax over more tokens). Anything else in `src` is not copied (`left_out_files`)."""
    rewritten = {"config.json", "model.safetensors", "README.md"}
    return sorted(n for n in DRAFTER_FILES - rewritten if not n.startswith("acceptance.") and (src / n).is_file())


def left_out_files(src: Path) -> list[str]:
    """What `full_vocab_copy` does not copy from `src` because dflash-trt does not write it there: names of
    other files and of folders (with a trailing '/'), sorted."""
    return sorted(p.name + ("/" if p.is_dir() else "") for p in src.iterdir() if p.name not in DRAFTER_FILES)


def full_vocab_copy(src: str | Path, dst: str | Path, force: bool = False, target: str | Path | None = None) -> Path:
    """Write the full-vocabulary variant of drafter folder `src` to `dst` (no `d2t`, no
    `draft_vocab_size`): the z-lab format every DFlash loader accepts. A `src` in the vLLM `speculators`
    format is converted (`dflash_trt.models.speculators.read_zlab`: its `t2d` and copies of the target's
    weights are dropped). Of the other files, those of
    `copied_files` are copied (not acceptance.*, measured with the reduced vocabulary: measure the copy
    with `python -m dflash_trt.training.evaluate --drafter DST`; not a user's own files: `left_out_files`).

    Written beside `dst` and moved into place with ordinary modes (`publish_folder`). An existing
    `dst` is replaced only with `force`, only when it is an empty folder or a drafter folder holding only
    what dflash-trt writes there, and only once the copy is written. With `target`, the pair is checked
    first (`check_pair`): a speculators `src`'s copies of its target's weights are dropped here, so this is
    the last point where a drafter trained for another target shows. Returns `dst`.

    Raises:
        CheckpointError / ConfigError: `src` is not a drafter folder (missing, a file, no dflash_config,
            no weights); `dst` is, holds or lies inside `src`, or fails `dflash_trt.out_folder.check_out`
            (empty, '.' or '..', inside a bundle, under a file, not writable, existing without `force`, with
            `force` a file or a folder holding anything else; nothing is written then); or fails it again once
            the copy is written (`dst` changed meanwhile: left as it is, the copy kept as DST.new,
            `dflash_trt.out_folder.publish_out`).
        IncompatibleModelsError: with `target`, a pair that does not fit (`check_pair`).
    """
    from dflash_trt.cli.common import model_folder
    from dflash_trt.errors import ConfigError

    src = Path(src)
    try:
        cfg = DrafterConfig.from_pretrained(model_folder("SRC", str(src), "drafter"), flag="SRC")
    except ConfigError as e:  # e.g. a target's folder: name the path
        raise ConfigError(f"SRC {src}: {e}") from None
    _check_copy_paths(src, dst, force)  # before Path(dst): an empty DST is not '.'
    dst = write_target(dst)  # a link to a drafter folder: that folder is replaced, the link stays
    hf, tensors, copies = read_zlab(src)  # a speculators-format SRC becomes z-lab, its target copies dropped:
    if target is not None:                # checked first against `target`, when given
        check_pair(src, cfg, tensors, copies, target)
    tensors.pop("d2t", None)
    hf.pop("draft_vocab_size", None)
    with staging_folder(dst, "tmp") as tmp:  # removed, with the parents of DST it made, if this fails
        save_checkpoint(tmp, hf, tensors)
        for name in copied_files(src):
            shutil.copy2(src / name, tmp / name)
        info = json.loads((src / "training.json").read_text()) if (src / "training.json").is_file() else {}
        (tmp / "README.md").write_text(bundle_readme(cfg.replace(draft_vocab_size=None), info))
        publish_out(tmp, "DST", dst, DRAFTER, force, "the export", "new drafter")  # DST checked again
    assert cfg.draft_vocab_size is None or "d2t" not in tensors
    return dst


def _target_embed_head(target: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding and lm_head weights [V, H] of a target folder (the lm_head is the embedding when the two are
    tied), read alone.

    Raises:
        CheckpointError: the folder's safetensors have no `model.embed_tokens.weight`.
    """
    from dflash_trt.errors import CheckpointError
    from dflash_trt.models.loading import read_tensors

    found = read_tensors(target, keys=("lm_head.weight", "model.embed_tokens.weight"))
    if "model.embed_tokens.weight" not in found:
        raise CheckpointError(f"--target {target}: no model.embed_tokens.weight in its safetensors; give a Hugging Face "
                              "Llama / Qwen3 checkpoint folder")
    embed = found["model.embed_tokens.weight"]
    return embed, found.get("lm_head.weight", embed)


def check_pair(src: Path, cfg: DrafterConfig, tensors: dict[str, torch.Tensor], copies, target: str | Path
               ) -> tuple[Path, torch.Tensor]:
    """Check that drafter `src` (its config, z-lab tensors and `TargetCopies` from `read_zlab`) fits `target`,
    as `dflash-trt check` does: the configs (`compatibility_problems`) and a speculators drafter's copies of
    its target's weights. Returns (the target's absolute path, its lm_head weight [V, H]).

    Raises:
        CheckpointError / ConfigError: `target` is not a target folder.
        IncompatibleModelsError: the drafter does not fit it, or was trained with another target.
    """
    from dflash_trt.cli.common import model_folder
    from dflash_trt.compat import compatibility_problems
    from dflash_trt.config import TargetConfig
    from dflash_trt.errors import IncompatibleModelsError
    from dflash_trt.training.vocab import draft_to_target

    target = Path(model_folder("--target", str(target), "target")).resolve()
    problems = compatibility_problems(TargetConfig.from_pretrained(target, flag="--target"), cfg)
    if problems:
        raise IncompatibleModelsError(f"--target {target} does not fit SRC {src}: " + "; ".join(problems))
    embed, head = _target_embed_head(target)
    copies.check(embed, head, None if cfg.draft_vocab_size is None else draft_to_target(tensors["d2t"]))
    return target, head


def speculators_copy(src: str | Path, dst: str | Path, target: str | Path | None = None, verifier: str | None = None,
                     force: bool = False) -> Path:
    """Write drafter folder `src` (either format) to `dst` in the vLLM `speculators` format
    (`dflash_trt.models.speculators.speculators_checkpoint`): what `vllm serve TARGET --speculative-config
    '{"model": DST}'` reads, with its reduced draft vocabulary kept (`d2t`, `t2d` and `lm_head.weight`, the
    target's lm_head rows at the draft ids, which is why a reduced-vocabulary `src` needs `target`).
    config.json names `verifier` as the target (default: `target`'s absolute path; null without either, as
    speculators reads it: no verifier to load). With `target`, the pair is checked first (`dflash-trt
    check`'s compatibility checks, and a speculators SRC's copies of its target's weights against
    `target`'s). training.json and loss.png are copied and README.md written; the other rules (paths, `force`, publishing) are `full_vocab_copy`'s.

    Raises:
        CheckpointError / ConfigError: as `full_vocab_copy`; a reduced-vocabulary `src` without `target`.
        IncompatibleModelsError: a `target` the drafter does not fit (vocabulary, hidden size, layers), or not
            the one a speculators `src` was trained with (`TargetCopies.check`).
    """
    from dflash_trt.cli.common import model_folder
    from dflash_trt.config import read_config_json
    from dflash_trt.errors import ConfigError
    from dflash_trt.models.speculators import speculators_checkpoint

    src = Path(src)
    try:
        cfg = DrafterConfig.from_pretrained(model_folder("SRC", str(src), "drafter"), flag="SRC")
    except ConfigError as e:
        raise ConfigError(f"SRC {src}: {e}") from None
    if cfg.draft_vocab_size is not None and target is None:
        raise ConfigError(f"SRC {src} drafts over a reduced vocabulary ({cfg.draft_vocab_size} tokens): the speculators "
                          "format stores the target's lm_head rows at its draft ids; give the target with --target")
    _check_copy_paths(src, dst, force)
    zlab, tensors, copies = read_zlab(src)
    head, arch = None, []
    if target is not None:
        target, head = check_pair(src, cfg, tensors, copies, target)
        arch = list(read_config_json(target).get("architectures") or [])
    out_cfg, out_tensors = speculators_checkpoint(zlab, tensors, head, verifier or (str(target) if target else None),
                                                  arch)
    dst = write_target(dst)
    with staging_folder(dst, "tmp") as tmp:  # removed, with the parents of DST it made, if this fails
        save_checkpoint(tmp, out_cfg, out_tensors)
        for name in ("training.json", "loss.png"):
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        info = json.loads((src / "training.json").read_text()) if (src / "training.json").is_file() else {}
        (tmp / "README.md").write_text(bundle_readme(cfg, info, speculators=True))
        publish_out(tmp, "DST", dst, DRAFTER, force, "the export", "new drafter")  # DST checked again
    return dst


def dropped_target_copies(src: Path) -> list[str]:
    """The keys of the copies of its target's weights (`TARGET_COPIES`) a speculators-format drafter folder `src`
    holds: what a z-lab copy drops (sorted; [] for a z-lab folder). Reads the config and those tensors only."""
    from dflash_trt.config import read_config_json
    from dflash_trt.models.loading import read_tensors
    from dflash_trt.models.speculators import TARGET_COPIES, is_speculators

    if not is_speculators(read_config_json(src)):
        return []
    return sorted(read_tensors(src, keys=TARGET_COPIES))


def main(argv: list[str] | None = None) -> None:
    """`python -m dflash_trt.training.export SRC DST [--format zlab|speculators] [--target T] [--verifier NAME]
    [--force]`: a usage error exits 2, a bad SRC, DST or --target (`full_vocab_copy`'s / `speculators_copy`'s
    errors) prints one `error: ...` line and exits 1."""
    import argparse

    from dflash_trt.errors import DFlashError

    ap = argparse.ArgumentParser(
        prog="python -m dflash_trt.training.export",
        description="Rewrite a drafter folder (z-lab or vLLM speculators format) for another loader. --format zlab "
                    "(default): the full-vocabulary z-lab copy (no d2t, no draft_vocab_size) that TensorRT-LLM's, "
                    "SGLang's and vLLM's z-lab DFlash loaders expect; training.json, loss.png and the evaluation cache "
                    "are copied, acceptance.* (measured on the reduced vocabulary) and files dflash-trt does not write "
                    "in a drafter folder are not. --format speculators: the vLLM speculators format, which keeps a "
                    "reduced draft vocabulary (give --target then: its lm_head rows are stored).")
    ap.add_argument("src", metavar="SRC", help="drafter folder (e.g. written by dflash-trt train-drafter)")
    ap.add_argument("dst", metavar="DST", help="output folder (created; must not be SRC, inside it or hold it)")
    ap.add_argument("--format", choices=("zlab", "speculators"), default="zlab", help="what to write (default zlab)")
    ap.add_argument("--target", help="the drafter's target folder: the pair is checked first (configs, and a "
                                     "speculators SRC's copies of its target's weights); --format speculators needs "
                                     "it for a reduced draft vocabulary and names it as the verifier unless "
                                     "--verifier is given")
    ap.add_argument("--verifier", help="--format speculators: the target's name in config.json "
                                       "(speculators_config.verifier.name_or_path, e.g. a Hugging Face repo id)")
    ap.add_argument("--force", action="store_true",
                    help="replace an existing DST folder (once the copy is written): a DFlash drafter folder holding "
                         "only what dflash-trt writes there, or an empty folder; anything else is never replaced")
    args = ap.parse_args(argv)
    if args.format == "zlab" and args.verifier:
        ap.error("--verifier is for --format speculators")
    try:
        if args.format == "speculators":
            out = speculators_copy(args.src, args.dst, args.target, args.verifier, force=args.force)
        else:
            out = full_vocab_copy(args.src, args.dst, force=args.force, target=args.target)
    except (DFlashError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"interrupted; DST {args.dst} is left as it was", file=sys.stderr)
        sys.exit(130)
    if args.format == "speculators":
        print(f"wrote the speculators-format copy of {args.src} to {out}")
        return
    print(f"wrote the full-vocabulary copy of {args.src} to {out}")
    dropped = [] if args.target else dropped_target_copies(Path(args.src))
    if dropped:
        print(f"note: SRC's copies of its target's weights ({', '.join(dropped)}) were dropped unchecked, and the "
              "z-lab copy cannot show a mismatched pair later; rerun with --target TARGET to check the pair first",
              file=sys.stderr)
    left = left_out_files(Path(args.src))
    if left:
        shown = ", ".join(left[:5]) + (", ..." if len(left) > 5 else "")
        print(f"not copied, as dflash-trt does not write them in a drafter folder ({count(len(left), 'entry', 'entries')}): "
              f"{shown}; copy what you need yourself", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover - thin CLI
    main()
