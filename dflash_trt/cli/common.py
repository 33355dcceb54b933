"""Checks shared by the subcommands: option values that must name a folder or a file.

Each check runs before anything loads and names the option, the problem and the fix.
"""

from __future__ import annotations

from pathlib import Path

from dflash_trt.errors import CheckpointError, ConfigError


def model_folder(option: str, path: str | None, what: str = "model") -> str | None:
    """`path` unchanged when it is None (the embedded default) or an existing folder.

    Raises:
        CheckpointError: `path` is a file (e.g. its config.json) or does not exist; the message names `option`.
    """
    if path is None:
        return None
    p = Path(path)
    if p.is_file():
        raise CheckpointError(f"{option} {path} is a file; give the {what} folder (the one holding config.json)")
    if not p.exists():
        raise CheckpointError(f"{option} {path}: no such folder; give the {what} folder (the one holding config.json)")
    return path


def jsonl_file(option: str, path: str | None) -> str | None:
    """`path` unchanged unless it is a folder.

    Raises:
        ConfigError: `path` is a folder, not a JSONL file.
    """
    if path is not None and Path(path).is_dir():
        raise ConfigError(f'{option} {path} is a directory; give a JSONL file (one {{"prompt": ...}} or '
                          '{"messages": [...]} object per line)')
    return path
