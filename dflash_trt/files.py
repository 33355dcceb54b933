"""Atomic, durable file writes, shared by every command that records results (bench, train-drafter's
data cache and checkpoints, the drafter evaluation): a reader never sees a half-written file, and a
file reported written survives a power loss. Reading them back (`read_json`, `read_torch`), a file damaged
some other way (a partial copy between machines, a disk fault) is an error naming it and the fix."""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

#: the errno values of a full disk: no space left on the device, or the user's disk quota used up
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def os_error(exc: BaseException, filename: str | Path | None = None) -> OSError | None:
    """The operating system's error behind a failed write `exc`: `exc` itself when it is an OSError; for
    safetensors' SafetensorError, which keeps it only in its text ("I/O error: No space left on device (os error
    28)"), a new OSError of that errno; None for anything else (not a file system error). `filename`, when
    given, becomes the answer's filename where it has none (a failed write() or close() names no file), so its
    message says which file."""
    if isinstance(exc, OSError):
        err = exc
    else:
        found = re.search(r"\(os error (\d+)\)", str(exc)) if type(exc).__name__ == "SafetensorError" else None
        if found is None:
            return None
        code = int(found.group(1))
        err = OSError(code, os.strerror(code))
    if err.filename is None and filename is not None:
        err.filename = str(filename)
    return err


def cannot_write(what: str, exc: OSError, fix: str) -> str:
    """The one-line message of a failed write: "cannot write {what} ({the error}); {fix}", with "free space
    there, or " before `fix` when the disk is full (`DISK_FULL`). `what` names the path ("the drafter to --out
    d", a file)."""
    if exc.errno in DISK_FULL:
        fix = f"free space there, or {fix}"
    return f"cannot write {what} ({exc.strerror or exc}); {fix}"


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Run the block; an OSError raised in it without a file name (a failed write() or close() on a full disk)
    gets `path` as its filename, and a SafetensorError of the file system becomes that OSError (`os_error`).

    Raises:
        OSError: the block's, naming a file.
    """
    try:
        yield
    except Exception as exc:
        err = os_error(exc, path)
        if err is None or err is exc:
            raise
        raise err from None


def make_folders(folder: str | Path) -> list[Path]:
    """Create `folder` and its missing parents; returns the folders created, deepest first (for `remove_empty`).

    Raises:
        OSError: one cannot be created (those created before it are removed again).
    """
    folder = Path(folder)
    missing = [f for f in (folder, *folder.parents) if not f.exists()]
    try:
        for f in reversed(missing):
            f.mkdir()
    except OSError:
        remove_empty(missing)
        raise
    return missing


def remove_empty(folders: list[Path]) -> None:
    """Remove `folders` (deepest first: those `make_folders` created for a run that failed) while they are
    empty; the first that is not (another run wrote into it) and those above it stay."""
    for folder in folders:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            break


@contextmanager
def staging_folder(out: str | Path, tag: str) -> Iterator[Path]:
    """A new empty folder beside the output folder `out` (`.NAME.TAG-RANDOM`, mode 0700 as `tempfile.mkdtemp`
    makes it; `out`'s missing parents created first) for a command to write its output into and move into place
    (`dflash_trt.models.loading.publish_folder`) before the block ends. Leaving the block, the folder is removed
    if it is still there; when the block fails (an error, Ctrl-C), so are the parents of `out` it created, while
    they are empty (`remove_empty`): a failed run leaves no trace.

    Raises:
        OSError: a parent of `out` or the folder cannot be created (nothing is left of them).
    """
    out = Path(out)
    made = make_folders(out.parent)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{tag}-", dir=out.parent))
    except BaseException:
        remove_empty(made)
        raise
    ok = False
    try:
        yield tmp
        ok = True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if not ok:
            remove_empty(made)


@contextmanager
def atomic_write(path: Path, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside `path` (same folder, named `.NAME.PID.RANDOM.tmp`: unique, so two
    processes writing one file, or "a.json" and "a.pt" in one folder, never share it; created with the
    usual permissions, 0666 less the umask) for the caller to write; on a clean exit it is flushed, fsynced, closed, renamed over `path`, and the folder is fsynced (so the
    rename itself is on disk). An exception in the block (Ctrl-C, a full disk, a failed encoding)
    leaves the previous `path` as it was and no temporary file behind.

    Args:
        mode: "wb" (bytes) or "w" (text).
    Raises:
        OSError: the folder is not writable, the disk is full, or an fsync fails (before the rename:
            the previous file is kept), naming `path` (not the temporary file). A folder whose file system
            cannot fsync a directory (EINVAL, ENOTSUP) is not an error.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, mode.replace("w", "x")) as f:  # "x": never an existing file
            yield f
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename in (None, str(tmp)):  # a full disk: say which file
            exc.filename = str(path)
        raise
    _fsync_dir(path.parent)


@contextmanager
def files_as_one_set(folder: Path, names: tuple[str, ...], prefix: str = ".results-") -> Iterator[Path]:
    """A temporary folder inside `folder` (created if missing) for the caller to write the files `names` in; on a
    clean exit each is renamed into `folder` in the order given (the last one last: the file a reader looks for
    first), so an interruption while writing (plots take ~1 s) leaves an earlier run's files whole rather than
    mixed with this run's. The temporary folder is removed either way, and so are the folders created for it
    when the set is not written (nothing of this run is left behind). Used by bench's results and evaluate's
    report.

    Raises:
        OSError: `folder` cannot be created or written (nothing of this set is left there); one raised by the
            block for a file in the temporary folder names that file in `folder` instead (where it was going);
            FileNotFoundError: the block wrote no file of one of `names`.
    """
    folder = Path(folder)
    created = make_folders(folder)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=folder))
        try:
            yield tmp
            for name in names:
                (tmp / name).replace(folder / name)
        except OSError as exc:
            if exc.filename is not None and Path(exc.filename).parent == tmp:
                exc.filename = str(folder / Path(exc.filename).name)
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        remove_empty(created)
        raise


LOCK_FILE = ".lock"


@contextmanager
def folder_lock(folder: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on `folder` (created if missing) while the block runs: a second process asking for it
    meanwhile fails at once instead of writing the same files (two train-drafter runs given one --out or
    --work-dir, whose data shards and checkpoints would interleave). The lock is an `fcntl.flock` on
    `folder/.lock`, which records the holder's process id; the operating system releases it when the holder exits,
    however it ends (a crash, kill -9), so a stale lock file never blocks a later run.

    Args:
        folder: the folder to hold.
        what: what holds it, for the error ("drafter training").
    Raises:
        ConfigError: another process holds it (named with its process id, and the fix: wait for it, or give
            another folder). OSError: the lock file cannot be written (a full disk), naming it.
    """
    import fcntl

    from dflash_trt.errors import ConfigError

    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / LOCK_FILE, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise ConfigError(f"{folder} is in use by another {what} (process {holder}): two runs writing it would mix "
                              "their files; wait for that one to end, or give this run another folder "
                              "(train-drafter: --out or --work-dir)") from None
        with naming(folder / LOCK_FILE):  # a full disk: the error names the file
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
        yield
    finally:
        handle.close()  # releases the lock


def _fsync_dir(folder: Path) -> None:
    """fsync `folder` (a rename in it is durable once this returns); a no-op where directories cannot
    be opened (Windows)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: dict, indent: int | None = 2) -> None:
    """Write `obj` as JSON through `atomic_write`: an interrupted write (Ctrl-C, a full disk) leaves
    the previous file whole, never a truncated one, and no temporary file behind.

    Raises:
        OSError: the folder is not writable or the disk is full (the previous file is kept).
        TypeError: `obj` holds a value JSON cannot encode (nothing is written).
    """
    text = json.dumps(obj, indent=indent) + "\n"
    with atomic_write(path, "w") as f:
        f.write(text)


def read_json(path: Path, fix: str):
    """The JSON value in `path`.

    Raises:
        DFlashError: the file is not UTF-8 JSON (damaged: a partial copy, a disk fault), naming it and `fix`.
    """
    from dflash_trt.errors import DFlashError

    try:
        return json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DFlashError(f"{path} is damaged (not JSON: {exc}); {fix}") from None


def read_torch(path: Path, fix: str, **kwargs):
    """`torch.load(path, **kwargs)`.

    Raises:
        DFlashError: the file cannot be read as a torch file (cut short, empty, overwritten), naming it and `fix`.
    """
    import pickle

    import torch

    from dflash_trt.errors import DFlashError

    try:
        return torch.load(path, **kwargs)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except (OSError, RuntimeError, EOFError, ValueError, KeyError, pickle.UnpicklingError) as exc:  # a cut zip: EINVAL
        why = (str(exc).splitlines() or [""])[0][:200] or type(exc).__name__  # an empty file: EOFError('')
        raise DFlashError(f"{path} is damaged and cannot be read ({why}); {fix}") from None
