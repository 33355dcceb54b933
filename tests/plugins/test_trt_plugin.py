"""The TensorRT plugin DFlashKVInject (plugins/kv_inject): the fused KV injection's CUDA kernel behind TensorRT 10's
IPluginV3 interface.

Needs TensorRT's headers (not its libraries): $TENSORRT_INCLUDE_DIR; skipped, naming TENSORRT_INCLUDE_DIR, where it
is not set or holds no NvInferRuntime.h, and where nvcc is missing. Here (no GPU): the library compiles
without warnings from its own code, exports no symbol of its own besides the entry points IPluginRegistry::loadLibrary
looks up, and a host harness (plugins/kv_inject/test_plugin_host.cpp) drives every plugin method TensorRT's builder
and runtime call, except a kernel launch. On a CUDA machine the harness also runs enqueue against a float32 reference
and checks that out-of-range rows and positions are skipped. Never run under TensorRT.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dflash_trt.ops import cuda as cuda_ops

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "plugins" / "kv_inject"
PLUGIN_SOURCE = PLUGIN_DIR / "DFlashKVInjectPlugin.cpp"
HARNESS_SOURCE = PLUGIN_DIR / "test_plugin_host.cpp"
KERNEL_SOURCE = REPO / "dflash_trt" / "ops" / "csrc" / "kv_inject.cu"


def tensorrt_include_dir() -> Path | None:
    """The folder with TensorRT's NvInferRuntime.h, $TENSORRT_INCLUDE_DIR; None if it is not set or has none."""
    if not os.environ.get("TENSORRT_INCLUDE_DIR"):
        return None
    folder = Path(os.environ["TENSORRT_INCLUDE_DIR"])
    return folder if (folder / "NvInferRuntime.h").is_file() else None


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], check=False, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The plugin library (sm_90) and the host harness, each built with one nvcc call; the nvcc logs."""
    include = tensorrt_include_dir()
    if include is None:
        pytest.skip("no TensorRT headers: set TENSORRT_INCLUDE_DIR to the folder with TensorRT 10's NvInferRuntime.h")
    nvcc = cuda_ops.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    out = tmp_path_factory.mktemp("trt_plugin")
    lib, harness = out / "libdflash_kv_inject_plugin.so", out / "test_plugin_host"
    # -isystem: warnings inside TensorRT's headers (its deprecated interfaces) are not the plugin's
    flags = ["-std=c++17", "-O2", "-isystem", include, "-Xcompiler", "-Wall,-Wextra"]
    lib_build = run([nvcc, *flags, "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-arch", "sm_90",
                     PLUGIN_SOURCE, KERNEL_SOURCE, "-o", lib])
    assert lib_build.returncode == 0, lib_build.stderr
    harness_build = run([nvcc, *flags, HARNESS_SOURCE, "-o", harness, "-ldl"])
    assert harness_build.returncode == 0, harness_build.stderr
    return lib, harness, lib_build.stderr + lib_build.stdout, harness_build.stderr + harness_build.stdout


def test_plugin_and_harness_compile_without_warnings(built):
    """-Wall -Wextra report nothing in the plugin, the kernel or the harness (TensorRT's headers aside)."""
    _, _, lib_log, harness_log = built
    ours = ("DFlashKVInjectPlugin.cpp", "kv_inject.cu", "test_plugin_host.cpp")
    warnings = [ln for ln in (lib_log + harness_log).splitlines() if "warning" in ln and any(f in ln for f in ours)]
    assert not warnings, warnings


def test_library_exports_only_the_loadlibrary_entry_points(built):
    """getCreators and setLoggerFinder are the library's only defined dynamic symbols of its own (besides the
    linker's and libstdc++'s weak template instances, all starting with an underscore)."""
    lib = built[0]
    if shutil.which("nm") is None:
        pytest.skip("nm is not installed")
    proc = run(["nm", "-D", "--defined-only", lib])
    assert proc.returncode == 0, proc.stderr
    names = {ln.split()[-1] for ln in proc.stdout.splitlines() if ln.strip()}
    assert {"getCreators", "setLoggerFinder"} <= names
    assert not {n for n in names if not n.startswith("_")} - {"getCreators", "setLoggerFinder"}, names


def test_host_harness_drives_every_method_but_a_launch(built):
    """The harness's checks all pass: creator and fields (eps, alias_cache), types, formats, aliasing, shapes,
    serialisation, clone, attachToContext (and a clone of the attached plugin) and enqueue's paths that end before the
    GPU (without a GPU: its CUDA failures reported as kFAILED_EXECUTION)."""
    lib, harness, _, _ = built
    proc = run([harness, lib])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("ALL OK"), lines[-5:]
    checks = ["exports getCreators and setLoggerFinder", "creator name / version / namespace",
              "getFieldNames lists eps (kFLOAT32) and alias_cache (kINT32)",
              "no eps field: refused, 'missing field eps'", "eps as kFLOAT64: refused, names the type wanted",
              "alias_cache 2: refused, named", "alias_cache as kFLOAT32: refused, names the type wanted",
              "alias_cache with two values: refused, named",
              "the build capability is IPluginV3OneBuildV2 (aliasing)", "getNbOutputs() == 1",
              "no alias_cache: alias_cache 0, output 0 not aliased (getAliasedInput -1)",
              "alias_cache 1: output 0 aliases input 4 (the cache)",
              "getOutputDataTypes: output type = cache type, bfloat16",
              "supportsFormatCombination accepts float16", "rejects float16 cos", "rejects int32 rows",
              "rejects a float32 kv with a float16 cache",
              "getOutputShapes: output 0's dimensions are input 4's expressions",
              "configurePlugin: kv's last dimension != L * 2 * H * D, named",
              "configurePlugin: odd head_dim, named",
              "onShapeChange: L = 0, named", "onShapeChange: H = 0, named", "onShapeChange: D = 0, named",
              "onShapeChange: B = 0 with tokens, named", "onShapeChange: cap = 0 with tokens, named",
              "onShapeChange: B = 0 without tokens accepted",
              "getFieldsToSerialize: eps (kFLOAT32) and alias_cache (kINT32), one value each",
              "createPlugin(runtime phase) from the serialised fields keeps eps", "clone keeps eps",
              "createPlugin(runtime phase) from the serialised fields keeps alias_cache 1", "clone keeps alias_cache 1",
              "after attachToContext, problems go to the context's error recorder",
              "a shape problem is reported as kINVALID_ARGUMENT",
              "a clone of an attached plugin reports to the logger, not the recorder",
              "enqueue with a bad shape: nonzero, nothing launched, named",
              "enqueue with H = 0: nonzero, nothing launched, named"]
    if not torch.cuda.is_available():  # the harness runs these only where CUDA has no device
        checks += ["no GPU: the failed cache copy is reported as kFAILED_EXECUTION",
                   "no GPU: the failed launch is reported as kFAILED_EXECUTION"]
    for check in checks:
        assert f"ok {check}" in lines, check
    assert not any(ln.startswith("FAIL") for ln in lines)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_enqueue_on_a_gpu_matches_the_reference(built):
    """enqueue (float32) in place and into a separate output, against the harness's float32 reference; rows and
    positions outside the cache skipped without a device-side assertion."""
    lib, harness, _, _ = built
    proc = run([harness, lib, "--gpu"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok gpu: enqueue in place matches the float32 reference" in proc.stdout
    assert "ok gpu: enqueue into a separate output matches the reference" in proc.stdout
    assert "ok gpu: rows and positions outside the cache are skipped, no device-side assertion" in proc.stdout


def test_cmake_names_tensorrt_include_dir_when_headers_are_missing(tmp_path):
    """Configuring without the headers stops with an error naming TENSORRT_INCLUDE_DIR."""
    nvcc = cuda_ops.find_nvcc()
    if shutil.which("cmake") is None or nvcc is None:
        pytest.skip("cmake or nvcc is not installed")
    proc = run(["cmake", "-S", PLUGIN_DIR, "-B", tmp_path / "build", f"-DCMAKE_CUDA_COMPILER={nvcc}",
                f"-DTENSORRT_INCLUDE_DIR={tmp_path}"])
    assert proc.returncode != 0
    message = " ".join(proc.stderr.split())  # cmake wraps its messages
    assert "TENSORRT_INCLUDE_DIR must name the folder holding TensorRT's NvInferRuntime.h" in message, proc.stderr
