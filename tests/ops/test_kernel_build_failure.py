"""A failed build of the CPU op library is remembered in the cache (`<cache>/ops/<key>.failed`), so later
processes give the reason at once instead of recompiling ~15 s to fail again; another compiler, a
reinstalled one, or deleting the record retries; a successful build removes it; Ctrl-C is not recorded.

The failing builds are real: torch's builder runs ninja with `CXX` set to a script that fails like a
broken toolchain (a second or two, nothing is compiled)."""

import json
import os

import pytest
import torch.utils.cpp_extension

import dflash_trt.ops as ops
from dflash_trt.errors import ConfigError

BROKEN = "g++: fatal error: broken toolchain (test)"


def broken_compiler(folder, extra: str = ""):
    """An executable named g++ (torch's builder accepts the name) in `folder` that gives a version when
    torch asks for one and fails every compile with BROKEN; `extra` changes its size (a 'reinstall')."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "g++"
    path.write_text("#!/bin/sh\n"
                    f"# {extra}\n"
                    'case "$1" in -dumpfullversion) echo 12.2.0; exit 0;; esac\n'
                    f'echo "{BROKEN}" >&2\n'
                    "exit 1\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def build(monkeypatch, tmp_path):
    """A fresh cache and a counter of torch's builder calls; returns a function that runs one 'process'
    (`_load_cpu_library` with its per-process cache cleared) and gives (reason, builder calls so far)."""
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ops, "cpu_isa", lambda: "avx2")  # any CPU: nothing is ever run
    calls = []
    real_load = torch.utils.cpp_extension.load

    def counting_load(*args, **kwargs):
        calls.append(kwargs.get("build_directory"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", counting_load)

    def run():
        ops._load_cpu_library.cache_clear()
        return ops._load_cpu_library(), len(calls)

    yield run
    ops._load_cpu_library.cache_clear()


def record_path(tmp_path):
    return tmp_path / "cache" / "ops" / f"{ops._build_key()}.failed"


def test_failed_build_is_recorded_and_not_retried(build, monkeypatch, tmp_path):
    cxx = broken_compiler(tmp_path / "bin")
    monkeypatch.setenv("CXX", cxx)
    record = record_path(tmp_path)
    why, calls = build()
    assert calls == 1
    assert why == f"the CPU kernels failed to build (RuntimeError: {BROKEN}); recorded in {record} (delete it to retry)"
    data = json.loads(record.read_text())
    assert data["reason"] == f"RuntimeError: {BROKEN}"
    assert data["compiler"]["cxx"] == cxx and data["compiler"]["path"] == os.path.realpath(cxx)
    assert data["time"][:2] == "20"
    assert sorted(p.name for p in record.parent.iterdir()) == [record.name]  # no temporary folder or file left

    why, calls = build()  # a later process: the reason at once, no compile
    assert calls == 1
    assert why == (f"the CPU kernels failed to build earlier with `{cxx}` (RuntimeError: {BROKEN}); "
                   f"delete {record} to retry")
    with pytest.raises(ConfigError, match=r"failed to build earlier .*; run with --cpu-kernels off"):
        ops.require_cpu_kernels()


def test_another_or_reinstalled_compiler_retries(build, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", broken_compiler(tmp_path / "bin"))
    assert build()[1] == 1
    assert build()[1] == 1
    other = broken_compiler(tmp_path / "other")  # switching CXX
    monkeypatch.setenv("CXX", other)
    why, calls = build()
    assert calls == 2 and why.startswith("the CPU kernels failed to build (")
    assert json.loads(record_path(tmp_path).read_text())["compiler"]["cxx"] == other
    assert build()[1] == 2
    broken_compiler(tmp_path / "other", extra="a newer version")  # the same path, reinstalled
    assert build()[1] == 3
    assert build()[1] == 3


def test_a_compiler_found_on_path_is_told_apart_by_where_it_is(build, monkeypatch, tmp_path):
    """CXX=g++ (a name) resolved through PATH: another folder first on PATH is another compiler."""
    broken_compiler(tmp_path / "a")
    broken_compiler(tmp_path / "b", extra="another build")
    monkeypatch.setenv("CXX", "g++")
    monkeypatch.setenv("PATH", f"{tmp_path / 'a'}{os.pathsep}{os.environ['PATH']}")
    assert build()[1] == 1
    assert build()[1] == 1
    monkeypatch.setenv("PATH", f"{tmp_path / 'b'}{os.pathsep}{os.environ['PATH']}")
    assert build()[1] == 2


def test_deleting_the_record_retries(build, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", broken_compiler(tmp_path / "bin"))
    assert build()[1] == 1
    record_path(tmp_path).unlink()
    why, calls = build()
    assert calls == 2 and why.startswith("the CPU kernels failed to build (")
    assert record_path(tmp_path).is_file()


@pytest.mark.parametrize("content", ["not json", "[]", '{"reason": 1}'])
def test_an_unreadable_record_retries(build, monkeypatch, tmp_path, content):
    monkeypatch.setenv("CXX", broken_compiler(tmp_path / "bin"))
    record = record_path(tmp_path)
    record.parent.mkdir(parents=True)
    record.write_text(content)
    assert build()[1] == 1
    assert json.loads(record.read_text())["reason"] == f"RuntimeError: {BROKEN}"


def test_a_successful_build_removes_the_record(build, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", broken_compiler(tmp_path / "bin"))
    assert build()[1] == 1
    record = record_path(tmp_path)
    assert record.is_file()
    # a working compiler installed: the build is retried, and succeeds (a builder that does nothing stands in
    # for the real one, which takes ~15 s); the stale record goes
    monkeypatch.setenv("CXX", broken_compiler(tmp_path / "new"))
    good = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: good.append(kw["build_directory"]))
    assert build()[0] is None and len(good) == 1
    assert not record.exists()
    assert sorted(p.name for p in record.parent.iterdir()) == [record.name.removesuffix(".failed")]


def test_an_interrupted_build_is_not_recorded(build, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", broken_compiler(tmp_path / "bin"))

    def interrupted(**kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.utils.cpp_extension, "load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build()
    ops_dir = tmp_path / "cache" / "ops"
    assert not any(ops_dir.iterdir())  # no record, and the partial build folder is removed


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"),
                                     RuntimeError("Error building extension: c++: fatal error: Killed signal terminated "
                                                  "program cc1plus"),
                                     RuntimeError("a.cpp: fatal error: error writing to /tmp/x.s: No space left on device")])
def test_a_failure_of_the_machine_is_not_recorded(build, monkeypatch, tmp_path, failure):
    """A full disk, or a compiler the kernel killed for memory, is not the compiler's fault: the next run
    builds again once the machine is fixed."""
    monkeypatch.setenv("CXX", broken_compiler(tmp_path / "bin"))

    def failing(**kw):
        raise failure

    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing)
    why, _ = build()
    assert "not recorded (a failure of the machine, not the compiler): fix that and rerun" in why
    assert not record_path(tmp_path).exists()
    ops_dir = tmp_path / "cache" / "ops"
    assert not any(ops_dir.iterdir())  # nor a partial build folder


def test_a_missing_compiler_is_not_recorded_and_wins_over_a_record(build, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", broken_compiler(tmp_path / "bin"))
    assert build()[1] == 1
    monkeypatch.setenv("CXX", str(tmp_path / "nowhere" / "g++"))
    why, calls = build()
    assert calls == 1 and why.startswith("building the CPU kernels needs a C++ compiler")
    assert json.loads(record_path(tmp_path).read_text())["compiler"]["path"] == str(tmp_path / "bin" / "g++")


def test_failure_reason_is_the_first_compiler_error_line():
    log = ("Error building extension 'x': [1/2] c++ -c a.cpp\nFAILED: a.o\n"
           "a.cpp:3:1: error: 'foo' was not declared\nninja: build stopped: subcommand failed.\n")
    assert ops._failure_reason(RuntimeError(log)) == "RuntimeError: a.cpp:3:1: error: 'foo' was not declared"
    assert ops._failure_reason(OSError("disk\nfull")) == "OSError: full"
    assert ops._failure_reason(RuntimeError("")) == "RuntimeError"
    assert len(ops._failure_reason(RuntimeError("error: " + "x" * 1000))) < 320


def test_the_op_says_why_it_cannot_run_when_the_kernels_cannot_be_built(tmp_path):
    """torch.ops.dflash_trt.kv_inject called on CPU tensors where the CPU library cannot be built (here: a fresh
    cache and no compiler): a ConfigError with the reason, require_cpu_kernels() and the PyTorch fallback, not
    torch's "Could not run 'dflash_trt::kv_inject' with arguments from the 'CPU' backend" (a real process, nothing
    patched)."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "import dflash_trt.ops as ops\n"
        "from dflash_trt.errors import ConfigError\n"
        "args = (torch.zeros(1, 1, 16), torch.ones(1, 4), 1e-6, torch.ones(1, 1, 4), torch.zeros(1, 1, 4),\n"
        "        torch.zeros(2, 1, 1, 2, 8, 4), torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))\n"
        "try:\n"
        "    torch.ops.dflash_trt.kv_inject(*args)\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
        "print(ops.cpu_kernels_unavailable())\n")
    env = {**os.environ, "DFLASH_TRT_CACHE": str(tmp_path / "cache"), "CXX": str(tmp_path / "no-such-compiler")}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    message, why = res.stdout.splitlines()
    if ops.cpu_isa() is not None:  # else the reason is the CPU's instruction set
        assert why == (f"building the CPU kernels needs a C++ compiler, and `{tmp_path / 'no-such-compiler'}` is not on "
                       "PATH: install g++ (e.g. apt install g++) or set CXX")
    assert message == (f"torch.ops.dflash_trt.kv_inject has no CPU kernel here: {why} (dflash_trt.ops.require_cpu_kernels() "
                       "says the same); inject with the PyTorch path instead: a DFlashDrafter without "
                       "use_fused_injection(), as --cpu-kernels off runs")
    assert not (tmp_path / "cache" / "ops").exists() or not any((tmp_path / "cache" / "ops").iterdir())
