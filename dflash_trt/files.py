"""Atomic file writes, shared by every command that records results (bench, train-drafter's data cache,
the drafter evaluation): a reader never sees a half-written file."""

from __future__ import annotations

import json
from pathlib import Path


def write_json_atomic(path: Path, obj: dict, indent: int | None = 2) -> None:
    """Write `obj` as JSON through a temporary file renamed over `path`: an interrupted write (Ctrl-C,
    a full disk) leaves the previous file whole, never a truncated one, and no temporary file behind.

    Raises:
        OSError: the folder is not writable or the disk is full (the previous file is kept).
        TypeError: `obj` holds a value JSON cannot encode (nothing is written).
    """
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=indent) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
