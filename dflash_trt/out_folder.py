"""Checks on the output folder of a command that writes one folder and, with --force, replaces what is there:
`dflash-trt build` (a bundle), `dflash-trt init-drafter`, `dflash-trt train-drafter` and
`python -m dflash_trt.training.export` (a DFlash drafter folder).

These commands write their folder under a temporary name beside --out and rename it into place at the end
(`dflash_trt.models.loading.publish_folder`), removing what was there only then. `check_out` runs before
any work (data generation and training take hours, a build's quantization minutes) and refuses, with one
line naming the path and the fix, whatever would fail at the end or lose data:

- an empty --out (an unset shell variable), one naming the current folder or a folder above it ('.', '..',
  "$PWD"), one starting with an unexpanded '~', or a symbolic link to nothing (a link to a folder is followed:
  `write_target`);
- an --out inside a dflash-trt bundle (the bundle's manifest.json would not list it, and its next
  `build --force` would refuse the bundle) or inside a DFlash drafter folder (its next --force would
  refuse it, holding files dflash-trt does not write there); one inside another model folder (a config.json
  naming a model_type or architectures: a target's folder travels, and is uploaded, as a whole) is warned of;
- an existing --out without --force; with --force, anything but an empty folder or a folder of the
  command's own kind (`OutputKind`) holding only the files dflash-trt writes there: a file a user added
  is never deleted;
- a parent of --out that is a file, or a nearest existing folder in which no folder can be created
  (found by creating and removing an empty, uniquely named one: permission bits say nothing for root,
  nor of /proc or a read-only mount).

The same check runs again just before the rename (`publish_out`): what is at --out may have changed while the
command ran (a user's file put there, another run with the same --out that finished first); where it now
refuses, --out is left as it is and the finished folder is kept as `OUT.new`, which the error names.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import ConfigError
from dflash_trt.text import count

#: how many of the unexpected files a refusal names
SHOWN_FILES = 3


@dataclass(frozen=True)
class OutputKind:
    """What a command writes at its output folder, so what its --force may replace."""

    name: str  # "a dflash-trt bundle": how messages name it
    example: str  # an output folder name the messages suggest
    #: folder -> (description of a folder that is not of this kind, or None) and the files under it that the
    #: command does not write (relative POSIX paths, sorted)
    inspect: Callable[[Path], tuple[str | None, list[str]]]
    unexpected: str  # how the unexpected files are described: "not in its manifest.json"


def unexpected_files(folder: Path, expected: Callable[[str], bool]) -> list[str]:
    """The files under `folder` (links included, never followed; an unreadable folder and an empty folder count
    as one entry, "NAME/": dflash-trt writes no empty folder) whose path relative to `folder` (POSIX)
    `expected` rejects, sorted."""
    found: list[str] = []

    def unreadable(exc: OSError) -> None:
        found.append(Path(exc.filename or folder).relative_to(folder).as_posix() + "/")

    for here, dirs, files in os.walk(folder, onerror=unreadable):
        if not dirs and not files and here != str(folder):
            found.append(Path(here).relative_to(folder).as_posix() + "/")
        for name in files + [d for d in dirs if os.path.islink(os.path.join(here, d))]:
            rel = Path(here, name).relative_to(folder).as_posix()
            if not expected(rel):
                found.append(rel)
    return sorted(found)


def _inspect_bundle(folder: Path) -> tuple[str | None, list[str]]:
    """A bundle is a folder with a bundle manifest.json; the build writes every other file it holds into the
    manifest (`dflash_trt.build.manifest.file_table`) with its sha256. Unexpected: files it does not list,
    and listed files whose content changed since the build (a tuned serve.yaml: "NAME (changed)")."""
    from dflash_trt.build.manifest import MANIFEST_NAME, load_manifest, sha256_file
    from dflash_trt.errors import BundleError

    try:
        manifest = load_manifest(folder, verify=False)
    except BundleError:
        return "a folder that is not a dflash-trt bundle (no bundle manifest.json)", []
    listed = manifest.get("files")
    listed = listed if isinstance(listed, dict) else {}
    changed = [f"{rel} (changed)" for rel, entry in sorted(listed.items())
               if (folder / rel).is_file() and not (folder / rel).is_symlink() and isinstance(entry, dict)
               and sha256_file(folder / rel) != entry.get("sha256")]
    return None, unexpected_files(folder, lambda rel: rel == MANIFEST_NAME or rel in listed or _bytecode(rel)) + changed


def _bytecode(rel: str) -> bool:
    """A Python bytecode cache (`__pycache__/*.pyc`), e.g. of the bundle's triton/dflash/1/model.py, written by
    the Triton Python backend that imported it: regenerated from the listed source, never a user's file."""
    p = Path(rel)
    return p.parent.name == "__pycache__" and p.suffix == ".pyc"


#: what dflash-trt writes into a drafter folder: the checkpoint (`save_checkpoint`), training.json, loss.png
#: and README.md (`training.export`), hf_quant_config.json (an FP8 drafter, `build.drafter_quant`),
#: acceptance.* and the cache of `python -m dflash_trt.training.evaluate --out` (eval_cache.json)
DRAFTER_FILES = frozenset({"config.json", "model.safetensors", "training.json", "loss.png", "README.md",
                           "hf_quant_config.json", "acceptance.json", "acceptance.md", "acceptance.png",
                           "eval_cache.json"})


def _inspect_drafter(folder: Path) -> tuple[str | None, list[str]]:
    """A drafter folder has a config.json whose architectures name DFlashDraftModel, or a speculators-format
    DFlash config (`speculators_model_type: "dflash"`, whatever its architectures)."""
    import json

    try:
        cfg = json.loads((folder / "config.json").read_text())
        arch = cfg.get("architectures") or ()
        speculators = cfg.get("speculators_model_type") == "dflash"
    except (OSError, ValueError, AttributeError):  # none, unreadable, not JSON, not an object
        arch, speculators = (), False
    if not speculators and (not isinstance(arch, (list, tuple)) or "DFlashDraftModel" not in arch):
        return "a folder that is not a DFlash drafter folder (no config.json of a DFlashDraftModel)", []
    return None, unexpected_files(folder, DRAFTER_FILES.__contains__)


BUNDLE = OutputKind("a dflash-trt bundle", "engines/my-bundle", _inspect_bundle,
                    "not in its manifest.json or changed since the build")
DRAFTER = OutputKind("a DFlash drafter folder", "my-drafter", _inspect_drafter, "that dflash-trt does not write there")


def _existing(out: Path, kind: OutputKind) -> tuple[str | None, list[str]]:
    """(`existing_out`'s answer, the unexpected files of a folder of `kind`)."""
    if not (out.exists() or out.is_symlink()):
        return None, []
    if not out.is_dir():
        return f"a file, not {kind.name}", []
    foreign, extra = kind.inspect(out)
    if foreign is not None:
        return foreign, []
    if extra:
        shown = ", ".join(extra[:SHOWN_FILES]) + (", ..." if len(extra) > SHOWN_FILES else "")
        return f"{kind.name} plus {count(len(extra), 'file')} {kind.unexpected} ({shown})", extra
    return kind.name, []


def existing_out(out: str | Path, kind: OutputKind) -> str | None:
    """What --force would replace at `out`: None when nothing is there, `kind.name` for a folder of that kind
    holding only what dflash-trt writes there, else a description of what is there (a file, a folder not of
    that kind, a folder of that kind plus other files: how many and the first few)."""
    return _existing(Path(out), kind)[0]


def out_path(flag: str, out: str, kind: OutputKind) -> Path:
    """`out` as given on the command line, as a Path (Path("") is '.': an empty value, e.g. an unset shell
    variable, must be refused before it becomes one).

    Raises:
        ConfigError: `out` is empty or only spaces.
    """
    if not str(out).strip():
        raise ConfigError(f"{flag} is empty; give a folder path (e.g. {flag} {kind.example})")
    return Path(out)


def _check_place(flag: str, out: str | Path, kind: OutputKind) -> Path:
    """`out` not empty, not naming '.' or '..' (or '/'), not inside a dflash-trt bundle or a DFlash drafter folder;
    returns it as a Path.

    Raises:
        ConfigError: one line naming `flag`, the path and the fix.
    """
    from dflash_trt.build.manifest import enclosing_bundle

    path = out_path(flag, str(out), kind)
    if str(out).startswith("~"):
        raise ConfigError(f"{flag} {out}: '~' is not expanded here (a shell leaves it as is inside quotes), so this "
                          f"would make a folder named '~'; spell the path out (e.g. {flag} {os.path.expanduser(out)})")
    cwd = Path.cwd().resolve()
    if path.name in ("", "..") or path.resolve() == cwd or path.resolve() in cwd.parents:
        here = path.resolve() == cwd  # '.', '..', '/', 'a/..', "$PWD": the current folder or one that holds it
        above = path.resolve() in cwd.parents
        what = "the current folder" if here else "a folder above the current one" if above else \
            f"{path.resolve()} through '..'"
        raise ConfigError(f"{flag} {out} names {what}, which is never replaced; give the name of a new folder "
                          f"(e.g. {flag} {kind.example})")
    bundle = enclosing_bundle(path)
    if bundle is not None and bundle != path.resolve():
        raise ConfigError(f"{flag} {out} is inside the dflash-trt bundle {bundle}; give a path outside it (a "
                          "bundle holds only what its manifest.json lists)")
    drafter = next((f for f in path.resolve().parents if _inspect_drafter(f)[0] is None), None)
    if drafter is not None:
        raise ConfigError(f"{flag} {out} is inside the DFlash drafter folder {drafter}; give a path outside it (a "
                          "drafter folder holds only what dflash-trt writes there, or --force could no longer "
                          "replace it)")
    model = next((f for f in path.resolve().parents if _is_model_folder(f)), None)
    if model is not None:  # allowed (a drafter kept beside its target's files is a layout some choose)
        warn_inside_model(flag, out, model)
    return path


_WARNED: set[tuple[str, str]] = set()  # (flag, resolved path) warned of in this process (commands check twice)


def warn_inside_model(flag: str, out: str | Path, model: Path) -> None:
    """One stderr line, once per process: `out` lies inside the model folder `model` (not a dflash-trt folder:
    allowed), which is copied, uploaded and loaded as a whole."""
    key = (flag, str(Path(out).resolve()))
    if key in _WARNED:
        return
    _WARNED.add(key)
    print(f"warning: {flag} {out} is inside the model folder {model}; the new folder travels with that model's files "
          "(copies, uploads); give a path outside it to keep them apart", file=sys.stderr, flush=True)


def check_outside_models(flag: str, path: str | Path) -> None:
    """For a folder that is not a model (bench's results, train-drafter's work dir): refuse `path` when it is or
    lies inside a DFlash drafter folder (which holds only what dflash-trt writes there); warn when it lies inside
    another model folder (`warn_inside_model`).

    Raises:
        ConfigError: naming the drafter folder and the fix.
    """
    p = Path(path).resolve()
    for f in (p, *p.parents):
        if _inspect_drafter(f)[0] is None:
            where = "is" if f == p else "is inside"
            raise ConfigError(f"{flag} {path} {where} the DFlash drafter folder {f}; give a path outside it (a drafter "
                              "folder holds only what dflash-trt writes there)")
        if _is_model_folder(f):
            warn_inside_model(flag, path, f)
            return


def _is_model_folder(folder: Path) -> bool:
    """A Hugging Face model folder: a config.json object naming a model_type or architectures."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and ("model_type" in cfg or "architectures" in cfg)


def _parent_to_create(flag: str, path: Path) -> Path | None:
    """`check_writable` on the parent of `path`; the parent when it is missing (writing `path` creates it)."""
    return None if check_writable(flag, path, path.parent) == path.parent else path.parent


def check_out_path(flag: str, out: str | Path, kind: OutputKind) -> Path | None:
    """The checks of `check_out` that do not depend on what is at `out` (for a run that writes nothing there
    yet, e.g. `train-drafter --data-only`): not empty, not '.' or '..', not inside a dflash-trt bundle, its
    parent folders folders (or missing) and the nearest existing one writable (`check_writable`). Returns
    the missing parent folder that writing `out` creates (None when the parent exists).

    Raises:
        ConfigError: one line naming `flag`, the path and the fix.
    """
    return _parent_to_create(flag, _check_place(flag, out, kind))


def check_writable(flag: str, shown: str | Path, folder: Path) -> Path:
    """That `folder` is, or can be created as, a folder this process can write in: returns the nearest
    existing folder at or above it, after creating and removing a uniquely named empty folder there (nothing
    is left behind; the access bits alone say yes for root where mkdir fails, e.g. in /proc). `shown` is
    the path the messages name after `flag`.

    Raises:
        ConfigError: a file where a folder is needed, or no folder can be created in the nearest existing one.
    """
    nearest = folder
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        fix = ("give a folder path (it is created if missing)" if nearest == Path(shown) else
               "give a path whose parent folders are folders (or can be created)")
        raise ConfigError(f"{flag} {shown}: {nearest} is a file, not a folder; {fix}")
    reason = None
    if not os.access(nearest, os.W_OK | os.X_OK):
        reason = "permission denied"
    else:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".dflash-trt-write-check-", dir=nearest))
        except OSError as exc:
            reason = {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
                      errno.EROFS: "read-only file system"}.get(exc.errno, f"creating a folder there fails: "
                                                                          f"{exc.strerror}")
    if reason is not None:
        raise ConfigError(f"{flag} {shown}: cannot write in {nearest} ({reason}); give a path in a folder you can "
                          "write to")
    return nearest


def write_target(out: str | Path) -> Path:
    """Where a command writes its output folder `out`: `out` itself or, when `out` is a symbolic link, the
    folder it points to (replaced there, so the link stays and points to the new output, as `dflash-trt
    build` does; replacing the link itself would leave the folder it names unchanged)."""
    path = Path(out)
    return path.resolve() if path.is_symlink() else path


def check_out(flag: str, out: str | Path, kind: OutputKind, replace: bool, exists_message: str | None = None) -> Path | None:
    """Every check on an output folder (see the module docstring), before any work. `replace`: the command may
    replace what is at `out` (--force, or a resumed run re-exporting its own drafter); it then replaces only
    an empty folder or a folder of `kind` holding nothing else. `exists_message`: the refusal of an existing
    `out` without `replace` (default: one naming `flag` and --force). Returns the missing parent folder that
    writing `out` creates (None when the parent exists).

    Raises:
        ConfigError: one line naming `flag`, the path and the fix: the errors of `check_out_path`; `out` exists
            and not `replace`; with `replace`, it is a file, a non-empty folder not of `kind`, or one of `kind`
            holding other files (counted, the first few named).
    """
    path = _check_place(flag, out, kind)
    if path.is_symlink() and not path.exists():
        raise ConfigError(f"{flag} {out} is a symbolic link to {os.readlink(path)}, which does not exist; give a folder "
                          "path (or fix the link)")
    path = write_target(path)
    if path.exists():
        if not path.is_dir():  # never replaced, --force or not: say so now, not after the user adds --force
            raise ConfigError(f"{flag} {out} is {_existing(path, kind)[0]}; --force replaces only {kind.name} or an "
                              f"empty folder, so nothing else is lost: pick another {flag}, or move it away yourself")
        if not replace:
            if _is_empty(path):  # nothing to lose: say so, the generic message reads as if something were
                raise ConfigError(f"{flag} {out} already exists, an empty folder; pass --force to write into it (nothing "
                                  f"is there to lose), or pick another {flag}")
            raise ConfigError(exists_message or f"{flag} {out} already exists; pick another {flag}, or pass --force to "
                                                f"replace it (--force replaces {kind.name} or an empty folder only, once "
                                                "the new one is written)")
        existing, extra = _existing(path, kind)
        empty = path.is_dir() and not any(path.iterdir())
        if existing != kind.name and not empty:
            what = "those files" if extra else "it"
            raise ConfigError(f"{flag} {out} is {existing}; --force replaces only {kind.name} or an empty folder, so "
                              f"nothing else is lost: pick another {flag}, or move {what} away yourself")
    return _parent_to_create(flag, path)


def _is_empty(folder: Path) -> bool:
    """Whether `folder` holds nothing (False where it cannot be listed)."""
    try:
        return not any(folder.iterdir())
    except OSError:
        return False


def free_sibling(path: Path, suffix: str) -> Path:
    """`path` with `suffix` added to its name (`NAME.new`), or `NAME.new-2`, `-3`, ... when that exists."""
    candidate, n = path.with_name(path.name + suffix), 1
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{path.name}{suffix}-{n}")
    return candidate


def publish_out(tmp: str | Path, flag: str, out: str | Path, kind: OutputKind, replace: bool, ran: str,
                product: str) -> Path:
    """Move the finished folder `tmp` (written beside `out`) into place at `out` once `check_out` passes again:
    what is at `out` may have changed while the command ran (a user's file put there, another run with the same
    `out` that finished first), and only what `check_out(..., replace)` allows is ever replaced. When it no
    longer passes, `out` is left as it is and `tmp` is kept under a free sibling name (`NAME.new`, `NAME.new-2`,
    ...) that the error names. `ran` names the command in the message ("the build"), `product` what it wrote
    ("complete bundle"). Returns the path written (`write_target(out)`).

    Raises:
        ConfigError: `out` changed so that it may not be replaced: what is there now, where the finished folder is.
    """
    from dflash_trt.models.loading import publish_folder

    try:
        check_out(flag, out, kind, replace)
    except ConfigError as exc:
        aside = publish_folder(tmp, free_sibling(write_target(out), ".new"))  # finished: keep it, visibly
        now = existing_out(out, kind)
        why = (f"{flag} {out} changed while {ran} ran: it is now {now}, which "
               + (f"--force does not replace (only {kind.name} of its own files, or an empty folder)" if replace
                  else "is not replaced without --force") if now else str(exc))
        raise ConfigError(f"{why}; it is left as it is, and the {product} is at {aside} (move it where you want "
                          "it)") from exc
    return publish_folder(tmp, write_target(out))
