"""Strict loading and saving of Hugging Face safetensors checkpoints.

Reads `model.safetensors` or a sharded `model.safetensors.index.json` folder (HF format). Loading is
strict: every key the module needs must be present with the exact shape, and every key in the file
must be used (a converter that silently left keys random produced zero acceptance in a public
project). Errors name the key and the expected shape.

Publishing: a finished output folder (a bundle, an exported or initialised drafter) is written under a
temporary name and moved into place by `publish_folder`, which also gives it ordinary modes
(`share_modes`): `tempfile.mkdtemp` makes 0700 folders and safetensors writes 0600 files, which a
server running as another user (a Triton / trtllm-serve container) could not read.

Where dflash-trt loads or saves with transformers itself (the default model's GGUF conversion, `build`'s export,
`bench`'s HF modes), `no_transformers_bars` keeps transformers' own progress bars ("Loading weights", "Writing
model shards") out of the command's output.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dflash_trt.errors import CheckpointError


def safetensors_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (single file, sharded index, or any *.safetensors).

    Raises:
        CheckpointError: the folder has no safetensors weights, its model.safetensors.index.json is not
            readable JSON, or a shard the index names is missing (`dflash-trt check` and loading give the
            same messages, with the fix).
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
            raise CheckpointError(f"{index}: not a readable index ({exc}); re-save or re-download it") from exc
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{folder}: index names shard(s) that are missing: {', '.join(missing)}; download "
                                  "every shard model.safetensors.index.json names (or re-save the checkpoint)")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{folder}: no *.safetensors weights found; save the model with "
            "`save_pretrained(..., safe_serialization=True)`"
        )
    return files


def weights_fingerprint(folder: str | Path, samples: int = 16, chunk: int = 1 << 16) -> str:
    """A sha256 hex digest that tells a checkpoint's weights apart without reading them all: config.json (its
    parsed content), and per
    safetensors file (`safetensors_files` order) its name, size, header and `samples` chunks of `chunk` bytes at
    evenly spaced offsets of its data. The same folder copied anywhere gives the same digest; a fine-tuned or
    re-initialized model of the same shapes (same header) differs in its sampled bytes. Reads about
    samples * chunk bytes per file (1 MiB by default).

    Raises:
        CheckpointError: as `safetensors_files`; OSError: a file cannot be read.
    """
    import hashlib

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())  # parsed: a reformatted file is the same model
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for file in safetensors_files(folder):
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head + f.read(min(header_len, size)))
            start = 8 + header_len
            span = max(size - start - chunk, 0)
            for i in range(samples):
                f.seek(start + span * i // max(samples - 1, 1))
                h.update(f.read(chunk))
    return h.hexdigest()


def open_safetensors(file: str | Path, device: str | torch.device = "cpu"):
    """`safetensors.safe_open(file, framework="pt", device=device)`: a context manager giving the file's
    reader (keys, shapes via `get_slice`, tensors via `get_tensor`); opening reads only the header.

    Raises:
        CheckpointError: the file is not a readable safetensors file (truncated, corrupt header, another
            format); the message names the file and says to re-save or re-download it, or, for a file of the
            default model that dflash-trt converted into its cache, to delete that folder
            (`dflash_trt.models.default.cached_copy_fix`).
    """
    try:
        return safe_open(str(file), framework="pt", device=str(device))
    except Exception as exc:  # safetensors raises its own SafetensorError for a corrupt header
        from dflash_trt.models.default import cached_copy_fix

        fix = cached_copy_fix(file) or "re-save or re-download it"
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc}); {fix}") from exc


def read_tensors(folder: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                 keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder as {name: tensor}, cast to `dtype` (floating tensors only); with
    `keys`, only those of them the folder has (the others are not read).

    Raises:
        CheckpointError: no safetensors weights, or a file that is not readable (`open_safetensors`).
    """
    out: dict[str, torch.Tensor] = {}
    wanted = None if keys is None else set(keys)
    for file in safetensors_files(folder):
        with open_safetensors(file, device) as f:
            for key in f.keys():
                if wanted is not None and key not in wanted:
                    continue
                t = f.get_tensor(key)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                out[key] = t
    return out


def check_finite(tensors: dict[str, torch.Tensor], what: str, folder: str | Path) -> None:
    """Refuse a checkpoint whose floating-point tensors hold a NaN or an infinity (a diverged training run, a
    broken conversion): such a model would compute garbage without failing.

    Raises:
        CheckpointError: naming the first keys that hold one and what to do.
    """
    bad = sorted(k for k, t in tensors.items()
                 if t.is_floating_point() and not bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all()))
    if bad:
        shown = ", ".join(repr(k) for k in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise CheckpointError(f"{what} checkpoint {folder}: {shown} {'holds' if len(bad) == 1 else 'hold'} NaN or "
                              f"infinite values; its weights are corrupt (a diverged training run or a broken "
                              f"conversion): retrain or re-export the {what}, or use another one")


#: parameter-name parts of a mixture-of-experts MLP (Qwen3-MoE's experts and router, gpt-oss's)
_MOE_PARTS = (".mlp.experts.", ".mlp.gate.", ".mlp.router.")


def moe_layout_hint(keys: Iterable[str]) -> str:
    """The config.json fields to check when any of `keys` (missing, unexpected or misshapen weights) belongs to a
    mixture-of-experts MLP or to a dense MLP where experts might be ("" otherwise): which layers are sparse and
    how many experts they have come from config.json, not from the weights."""
    keys = list(keys)
    if not any(part in k for k in keys for part in _MOE_PARTS):
        return ""
    return ("; for a mixture-of-experts target, config.json's num_experts (or num_local_experts), "
            "moe_intermediate_size, mlp_only_layers and decoder_sparse_step must describe which layers hold "
            "experts and how many: fix them there")


def load_strict(module: nn.Module, tensors: dict[str, torch.Tensor], what: str, folder: str | Path,
                ignore: Iterable[str] = ()) -> None:
    """Assign `tensors` to `module`'s parameters by name, strictly.

    Args:
        module: built with the checkpoint's config (may live on the meta device).
        tensors: {HF key: tensor}. Keys in `ignore` are allowed and skipped (e.g. a tied lm_head).
        what / folder: used in error messages ("target", "drafter").
    Raises:
        CheckpointError: a key is missing, unexpected, or has the wrong shape; the message names the
            key, the expected shape and the checkpoint folder.
    """
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    ignore = set(ignore)
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected and k not in ignore]
    hint = moe_layout_hint([*missing, *unexpected])  # a dense MLP missing where the weights hold experts too
    if missing:
        shown = ", ".join(f"{k} {list(expected[k])}" for k in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{what} checkpoint {folder}: missing key(s) {shown}{more}; the checkpoint does not match "
                              f"its config.json{hint}")
    if unexpected:
        raise CheckpointError(
            f"{what} checkpoint {folder}: unexpected key(s) {', '.join(unexpected[:5])}; "
            "the checkpoint has weights this architecture does not use (wrong model type or config?)"
            + hint
        )
    for k, shape in expected.items():
        if tuple(tensors[k].shape) != shape:
            raise CheckpointError(
                f"{what} checkpoint {folder}: key {k} has shape {list(tensors[k].shape)}, expected {list(shape)}"
                + moe_layout_hint([k])
            )
    module.load_state_dict({k: tensors[k] for k in expected}, strict=True, assign=True)


def save_checkpoint(folder: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write `config.json` and `model.safetensors` into `folder` (created if needed).

    Raises:
        OSError: a file cannot be written (a full disk), naming it; safetensors' own SafetensorError, which names
            no file, becomes this OSError (`dflash_trt.files.naming`).
    """
    from dflash_trt.files import naming

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with naming(folder / "config.json"):
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with naming(folder / "model.safetensors"):
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})


def current_umask() -> int:
    """The process umask, read without changing it where Linux reports it (/proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (the only portable way to read it)
    os.umask(mask)
    return mask


def share_modes(root: str | Path) -> None:
    """Give `root` and everything under it the modes a plain `mkdir` / `open` would give under the umask.

    Folders become 0o777 & ~umask, files 0o666 & ~umask, and files with the owner's execute bit
    (launch.sh, build_engine.sh) 0o777 & ~umask: 0755 / 0644 / 0755 under the usual umask 022.
    Symbolic links and their targets are left alone.
    """
    mask = current_umask()
    root = Path(root)
    paths = [root]
    for folder, dirs, files in os.walk(root):
        paths += [Path(folder, name) for name in dirs + files]
    for p in paths:
        st = p.lstat()
        if stat.S_ISDIR(st.st_mode):
            os.chmod(p, 0o777 & ~mask)
        elif stat.S_ISREG(st.st_mode):
            os.chmod(p, (0o777 if st.st_mode & stat.S_IXUSR else 0o666) & ~mask)


def path_overlap(path: str | Path, other: str | Path) -> str | None:
    """How `path` overlaps folder `other`, both resolved (symlinks followed): "is" (the same folder),
    "is inside", "holds" (`other` is inside `path`), or None when they are apart. Writers that publish
    a folder (`publish_folder`) refuse an output that overlaps one of their inputs: replacing it would
    delete the input, or write into it."""
    p, o = Path(path).resolve(), Path(other).resolve()
    if p == o:
        return "is"
    if o in p.parents:
        return "is inside"
    if p in o.parents:
        return "holds"
    return None


def publish_folder(tmp: str | Path, out: str | Path) -> Path:
    """Move the finished folder `tmp` into place as `out` (a rename: `tmp` must be beside `out`).

    `tmp` first gets ordinary modes (`share_modes`). An existing `out`, a folder or a file, is replaced
    only now (moved aside, then removed once `tmp` is in place; put back if the rename fails), so a
    failure before this call leaves it untouched. Returns `out`.
    """
    tmp, out = Path(tmp), Path(out)
    share_modes(tmp)
    if not (out.exists() or out.is_symlink()):
        tmp.rename(out)
        return out
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)
    return out


@contextmanager
def no_transformers_bars() -> Iterator[None]:
    """Within the block, transformers' progress bars are off: those of `from_pretrained` ("Loading weights"),
    `save_pretrained` ("Writing model shards") and Hugging Face Hub downloads (transformers' switch,
    `transformers.utils.logging.disable_progress_bar`), and the GGUF reader's ("Converting and de-quantizing GGUF
    tensors", which uses tqdm directly: its module's `tqdm` is replaced for the block). They are restored after
    (left off where they were off, e.g. by HF_HUB_DISABLE_PROGRESS_BARS). dflash-trt's own bars (tqdm used
    directly: training, data generation, bench) are unaffected. Not thread-safe (process-wide switches): for a
    command's own loading and saving."""
    import functools
    import sys

    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf = sys.modules.get("transformers.modeling_gguf_pytorch_utils")  # imported by a GGUF load; lazily else
    if gguf is None:
        try:
            import transformers.modeling_gguf_pytorch_utils as gguf
        except ImportError:  # a transformers without it: no GGUF bar to silence
            gguf = None
    gguf_tqdm = getattr(gguf, "tqdm", None)
    if gguf_tqdm is not None:
        gguf.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf.tqdm = gguf_tqdm
        if was_on:
            hf_logging.enable_progress_bar()
