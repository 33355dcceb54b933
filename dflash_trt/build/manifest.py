"""`manifest.json`: what a bundle holds, how it was made, and the sha256 of every file in it.

Written last by `dflash-trt build`; read and verified by `load_manifest` before the runtime loads a
bundle (`dflash-trt generate --bundle`). Verification fails with a `BundleError` naming the file
when a listed file is missing or its sha256 differs (`load_bundle`: a file it loads; the others only warn), when the manifest comes from a newer schema
than this dflash-trt understands, and when it was edited into something the build does not write (not an
object, `files` or a model path missing or malformed: `malformed`). Files added to a bundle after the build are not
checked, except in the folders `load_bundle` loads (the target, drafter and tokenizer folders): their loaders read
every file there (any `*.safetensors`, tokenizer and config files), so a file the manifest does not list is an error.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dflash_trt.errors import BundleError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
KIND = "dflash-trt-bundle"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_table(root: Path) -> dict[str, dict]:
    """{relative posix path: {"sha256", "bytes"}} of every file under `root` except the manifest."""
    table = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST_NAME:
            table[p.relative_to(root).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return table


def tool_versions() -> dict[str, str | None]:
    """Versions of the tools that shaped a bundle (None when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("dflash-trt", "torch", "transformers", "safetensors", "nvidia-modelopt", "tensorrt_llm"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    if out["dflash-trt"] is None:
        from dflash_trt import __version__

        out["dflash-trt"] = __version__
    return out


def write_manifest(root: Path, fields: dict) -> dict:
    """Write `root/manifest.json` = {schema_version, kind, **fields, files: sha256 table}; return it."""
    manifest = {"schema_version": SCHEMA_VERSION, "kind": KIND, **fields, "files": file_table(root)}
    (root / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_manifest(bundle: str | Path, verify: bool = True) -> dict:
    """Read a bundle's manifest and (by default) verify every listed file.

    Raises:
        BundleError: an empty path, a file, no bundle / manifest, invalid JSON, not a JSON object, newer schema, a
            malformed `files` table, a missing file, or a sha256 mismatch.
    """
    if not str(bundle).strip():  # Path("") is the current folder
        raise BundleError("the bundle path is empty; give the folder `dflash-trt build --out` wrote (e.g. "
                          "engines/my-bundle)")
    root = Path(bundle)
    path = root / MANIFEST_NAME
    if root.exists() and not root.is_dir():
        raise BundleError(f"{root} is a file, not a bundle folder; give the folder `dflash-trt build --out` wrote")
    if not root.is_dir():
        raise BundleError(f"{root}: no such bundle folder; build one with `dflash-trt build --out {root}`")
    if not path.is_file():
        try:
            cfg = json.loads((root / "config.json").read_text())
            arch = cfg.get("architectures") or ()
            drafter = "DFlashDraftModel" in arch or "dflash_config" in cfg or "speculators_model_type" in cfg
            kind = "drafter" if drafter else "target"
        except (OSError, ValueError, AttributeError, TypeError):  # no config.json: a plain folder
            kind = None
        if kind is not None:
            raise BundleError(f"{root} is a model folder (a {kind}), not a dflash-trt bundle: give it as --{kind} "
                              f"(a bundle is the folder `dflash-trt build --out` wrote)")
        raise BundleError(f"{root}: no {MANIFEST_NAME}; this is not a finished dflash-trt bundle (rebuild it)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path}: not valid JSON ({exc}); rebuild the bundle") from exc
    if not isinstance(manifest, dict):
        raise malformed(root, f"a JSON {_json_kind(manifest)}, not an object")
    version = manifest.get("schema_version")
    if manifest.get("kind") != KIND or not isinstance(version, int):
        raise BundleError(f"{path}: not a dflash-trt bundle manifest (kind/schema_version missing)")
    if version > SCHEMA_VERSION:
        raise BundleError(
            f"{path}: manifest schema {version} is newer than this dflash-trt understands ({SCHEMA_VERSION}); "
            "upgrade dflash-trt (pip install -U dflash-trt) or rebuild the bundle with this version"
        )
    if verify:
        verify_files(root, manifest)
    return manifest


def _json_kind(value) -> str:
    """How JSON names the type of a decoded value: "array", "string", "number", "object", ..."""
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean", dict: "object"}.get(
        type(value), "null")


def malformed(root: Path, what: str) -> BundleError:
    """The error for a bundle manifest that is JSON but not what `dflash-trt build` writes (edited by hand)."""
    return BundleError(f"{Path(root) / MANIFEST_NAME}: {what}; rebuild the bundle (dflash-trt build --out NEW_FOLDER)")


def bundle_folder(root: str | Path, manifest: dict, key: str) -> Path:
    """`root` / the folder the manifest records at the dotted `key` (e.g. "models.target.path").

    Raises:
        BundleError: that entry is missing, not a string, or not a relative path inside the bundle.
    """
    value = manifest
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if not isinstance(value, str) or not value.strip() or Path(value).is_absolute() or ".." in Path(value).parts:
        got = "missing" if value is None else f"{json.dumps(value)[:60]}"
        raise malformed(root, f"{key} is {got}, not a folder path inside the bundle")
    return Path(root) / value


def enclosing_bundle(path: str | Path) -> Path | None:
    """The dflash-trt bundle that `path` (existing or not) is, or lies inside: the nearest folder at or
    above it (symlinks resolved) holding a bundle manifest (of any schema version); None when there is none."""
    resolved = Path(path).resolve()
    for folder in (resolved, *resolved.parents):
        try:
            if json.loads((folder / MANIFEST_NAME).read_text()).get("kind") == KIND:
                return folder
        except (OSError, ValueError, AttributeError):  # no manifest, unreadable, not JSON, not an object
            continue
    return None


def verified_bundle(bundle: str | Path) -> tuple[dict, Path, Path, Path, list[str]]:
    """A bundle's manifest and the folders dflash-trt loads from it, their files verified (`verify_files`).

    Returns:
        (manifest, target folder, drafter folder, tokenizer folder, the files added since the build outside what is
        loaded, as `verify_files` names them).
    Raises:
        BundleError: as `load_manifest`, `bundle_folder` and `verify_files`.
    """
    manifest = load_manifest(bundle, verify=False)  # before Path(): an empty path is not the current folder
    root = Path(bundle)
    target = bundle_folder(root, manifest, "models.target.path")
    drafter = bundle_folder(root, manifest, "models.drafter.path")
    tokenizer = bundle_folder(root, manifest, "tokenizer.path")
    unloaded = verify_files(root, manifest, loaded=[target, drafter, tokenizer])
    return manifest, target, drafter, tokenizer, unloaded


def verify_files(root: Path, manifest: dict, loaded: list[Path] | None = None) -> list[str]:
    """Check that every file listed in the manifest exists with its recorded sha256.

    `loaded`: the folders under `root` whose files the caller loads (`dflash_trt.api.load_bundle`: the target,
    drafter and tokenizer folders); problems there raise, those of other files (a tuned trtllm/serve.yaml) are
    returned ("altered trtllm/serve.yaml", "missing ...") for a warning. A file directly in a `loaded` folder that
    the manifest does not list raises too: the loaders read every file there (an added `*.safetensors` overrides
    the verified weights, an added tokenizer file changes the tokenizer); hidden files other than `*.safetensors`
    (.DS_Store), which none reads, are left alone. None: every listed file raises.

    Raises:
        BundleError: listing every missing or altered file (in `loaded`) and every unlisted file in `loaded`;
            `files` missing or not {path: {sha256, ...}}.
    """
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(e, dict) and isinstance(e.get("sha256"), str)
                                              for e in files.values()):
        got = "missing" if files is None else f"a JSON {_json_kind(files)}"
        raise malformed(root, f"files is {got}, not a table of {{path: {{sha256, bytes}}}}")
    strict = None if loaded is None else [Path(f).relative_to(root).as_posix() for f in loaded]
    problems, others = [], []
    for rel, entry in files.items():
        p = root / rel
        mine = strict is None or any(rel.startswith(f"{folder}/") for folder in strict)
        if not p.is_file():
            (problems if mine else others).append(f"missing file {rel}" if mine else f"missing {rel}")
        elif sha256_file(p) != entry["sha256"]:
            (problems if mine else others).append(
                f"altered file {rel} (sha256 {sha256_file(p)[:12]}... != manifest {entry['sha256'][:12]}...)" if mine
                else f"altered {rel}")
    for folder in dict.fromkeys(loaded or ()):  # the target folder is also the tokenizer's: once
        for p in sorted(folder.iterdir()) if folder.is_dir() else ():
            rel = p.relative_to(root).as_posix()
            hidden = p.name.startswith(".") and not p.name.endswith(".safetensors")  # .DS_Store; the weights' glob
            if p.is_file() and rel not in files and not hidden:  # reads hidden *.safetensors too
                problems.append(f"unlisted file {rel} (added since the build; dflash-trt would load it)")
    if problems:
        added = [x for x in problems if x.startswith("unlisted")]
        edited = [x for x in problems if x.startswith("altered")]
        fix = ", ".join((["restore the files"] if len(added) < len(problems) else [])
                        + (["remove the unlisted files"] if added else []))
        kept = " and ".join((["edited"] if edited else []) + (["added"] if added else []))
        raise BundleError(f"bundle {root} failed verification: " + "; ".join(problems)
                          + f". {fix[0].upper()}{fix[1:]}, or rebuild: `dflash-trt build --out NEW_FOLDER`"
                          + (f" (`build --force` over this bundle keeps {kept} files: move them away first)"
                             if kept else ""))
    return others
