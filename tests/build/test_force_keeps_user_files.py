"""`dflash-trt build --force` replaces a bundle only when it holds nothing but the files its manifest lists
(plus manifest.json itself): a file a user added (notes, a built engine) is never deleted; an --out inside
a bundle and an --out where no folder can be created are refused by the dry run as by the build, in one
line, before any work (`dflash_trt.out_folder`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import run_main


def build_args(pair, out, *extra):
    return ("build", "--target", str(pair[0]), "--drafter", str(pair[1]), "--out", str(out), *extra)


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` (hidden ones included) -> its bytes (None for a folder)."""
    return {p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def refused(code, stdout, err, want):
    """Exit 1, no plan, no progress past the checks, and `want` in the one `error:` line (whitespace-normalized)."""
    line = " ".join(err[err.index("error: "):].split()) if "error: " in err else ""
    return code == 1 and "plan for" not in stdout and "[2/8]" not in err and want in line and "Traceback" not in err


@pytest.fixture
def bundle(tmp_path, tiny_bundle_fp8_tp3):
    out = tmp_path / "eng1"
    shutil.copytree(tiny_bundle_fp8_tp3, out)
    return out


def test_force_keeps_files_the_manifest_does_not_list(tmp_path, tiny_pair, bundle, monkeypatch, capsys):
    """NOTES.txt and an engine folder added to a bundle: `build --force` (dry run or not) is refused, naming
    the first few and how many, and every file stays; without them the bundle is replaced as before."""
    (bundle / "NOTES.txt").write_text("how I served it")
    (bundle / "engine").mkdir()
    for i in range(3):
        (bundle / "engine" / f"rank{i}.engine").write_bytes(b"\0" * (i + 1))
    before = tree(tmp_path)
    for dry in (("--dry-run",), ()):
        code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, bundle, "--force", *dry))
        assert refused(code, stdout, err, (
            f"error: --out {bundle} is a dflash-trt bundle plus 4 files not in its manifest.json or changed since "
            "the build (NOTES.txt, engine/rank0.engine, engine/rank1.engine, ...); --force replaces only a dflash-trt bundle or an empty "
            "folder, so nothing else is lost: pick another --out, or move those files away yourself")), (dry, err)
        assert tree(tmp_path) == before, dry
    shutil.rmtree(bundle / "engine")
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, bundle, "--force", "--dry-run"))
    assert refused(code, stdout, err, "plus 1 file not in its manifest.json or changed since the build (NOTES.txt);"), err
    (bundle / "NOTES.txt").unlink()
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, bundle, "--force", "--dry-run"))
    assert code == 0 and f"replace the existing bundle at {bundle} (--force) with the new one" in stdout, err


def test_a_manifest_json_elsewhere_in_the_bundle_is_a_users_file(tmp_path, tiny_pair, bundle, monkeypatch, capsys):
    """Only the bundle's own manifest.json is unlisted by the build: one in a subfolder is someone's file."""
    (bundle / "trtllm" / "manifest.json").write_text("{}")
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, bundle, "--force", "--dry-run"))
    assert refused(code, stdout, err, "plus 1 file not in its manifest.json or changed since the build "
                                      "(trtllm/manifest.json);"), err


def test_a_file_edited_since_the_build_is_kept(tmp_path, tiny_pair, bundle, monkeypatch, capsys):
    """A tuned serve.yaml (a listed file whose sha256 no longer matches the manifest) is a user's edit: --force
    refuses rather than rebuild over it; restored, the bundle is replaced as before."""
    serve = bundle / "trtllm" / "serve.yaml"
    original = serve.read_bytes()
    serve.write_bytes(original + b"# max_batch_size tuned by hand\n")
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, bundle, "--force", "--dry-run"))
    assert refused(code, stdout, err, "plus 1 file not in its manifest.json or changed since the build "
                                      "(trtllm/serve.yaml (changed));"), err
    serve.write_bytes(original)
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, bundle, "--force", "--dry-run"))
    assert code == 0 and f"replace the existing bundle at {bundle} (--force) with the new one" in stdout, err


def test_an_out_inside_a_bundle_is_refused(tmp_path, tiny_pair, bundle, monkeypatch, capsys):
    """`build --out eng1/sub` with eng1 a bundle (as `bench --out` inside a bundle): refused, --force or not,
    dry run or not, and nothing is written into the bundle."""
    before = tree(tmp_path)
    for out in (bundle / "sub", bundle / "trtllm" / "x" / "y"):
        for extra in ((), ("--force",), ("--dry-run",)):
            code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out, *extra))
            assert refused(code, stdout, err, f"error: --out {out} is inside the dflash-trt bundle {bundle.resolve()}; "
                                              "give a path outside it"), (out, extra, err)
    assert tree(tmp_path) == before


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_an_out_where_no_folder_can_be_made_fails_the_dry_run_too(tmp_path, tiny_pair, monkeypatch, capsys):
    """/proc passes the access-bit check for root, yet mkdir fails there: the dry run printed a plan and exited
    0 while the build failed after step 1; both now fail at the check with one line."""
    lines = []
    for extra in (("--dry-run",), ()):
        code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, "/proc/dflash-x", *extra))
        assert refused(code, stdout, err, "error: --out /proc/dflash-x: cannot write in /proc ("), err
        assert "[Errno" not in err
        lines.append(err[err.index("error: "):])
    assert lines[0] == lines[1]


def test_out_names_the_current_folder(tmp_path, tiny_pair, monkeypatch, capsys):
    """`--out .` (or `--out ""`, an unset $OUT, which is '.' as a path): refused, even with --force into an
    empty current folder; the empty one as empty (it was reported as '.')."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for out, want in ((".", "error: --out . names the current folder, which is never replaced"),
                      ("", "error: --out is empty; give a folder path")):
        code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out, "--force", "--dry-run"))
        assert refused(code, stdout, err, want), err
    assert list(tmp_path.iterdir()) == [here] and not any(here.iterdir())



@pytest.mark.parametrize("name", ["eng1", "eng[v2]"])
def test_engines_built_from_the_replaced_bundle_are_named(tmp_path, tiny_pair, bundle, monkeypatch, capsys, name):
    """build_engine.sh writes BUNDLE.engine beside the bundle: a rebuild at BUNDLE (--force) leaves it as it
    is, built from the old bundle; the dry run and the build say so in a warning and name the script, in one
    line whatever the path's length ('[v2]' stays: it is not markup to the console)."""
    if name != bundle.name:
        bundle = bundle.rename(bundle.with_name(name))
    engines = tmp_path / f"{name}.engine"
    engines.mkdir()
    (engines / "rank0.engine").write_bytes(b"\0")
    want = (f"warning: {engines} holds TensorRT engines built from an earlier bundle at {bundle}; once this build "
            f"is done, rebuild them with {bundle / 'trtllm_checkpoint' / 'build_engine.sh'}")
    for dry in (("--dry-run",), ()):
        code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, bundle, "--force", *dry))
        assert code == 0 and want in err.splitlines(), (dry, err)  # one line: a long path is not broken
        assert (engines / "rank0.engine").read_bytes() == b"\0"
    shutil.rmtree(engines)
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, bundle, "--force", "--dry-run"))
    assert code == 0 and ".engine holds" not in err, err
