"""dflash-trt's CUDA op library: the fused KV injection (csrc/kv_inject.cu) behind the torch op
`torch.ops.dflash_trt.kv_inject` for CUDA tensors (its CPU kernel is csrc/kv_inject.cpp).

The kernel is plain CUDA behind a C ABI (`dflash_kv_inject`, no torch headers), compiled with `nvcc` into
a shared library and called through ctypes on torch's current stream; the same entry point is what the
TensorRT plugin DFlashKVInject's enqueue calls (plugins/kv_inject, compiled into its own library). It is built on first use for the GPU's
architecture (`sm_<major><minor>`, plus its PTX), ~10 s, into a temporary folder renamed at the end to
`<cache>/ops/cuda-<key>/` (key: a hash of the source, the nvcc version and the architectures), so an
interrupted build leaves nothing a later process would load. A failed build is recorded beside it
(`<key>.failed`) like the CPU library's (`dflash_trt.ops`), for the same nvcc only.

`compile_cuda_library` compiles for any architectures without a GPU (nvcc only); the test suite does
that on a CPU-only machine and calls the C entry point's argument checks there.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from dflash_trt.ops import CSRC, _compiler_identity, _read_failure, build_once, check_kv_inject_args

SOURCE = CSRC / "kv_inject.cu"
NAME = "dflash_trt_cuda_ops"
#: `dflash_kv_inject`'s dtype codes (csrc/kv_inject.cu)
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: the kernel's limits (csrc/kv_inject.cu's `inject`): one thread per RoPE pair (1024 a block), the grid's y / z
#: (layers, KV heads) and x (tokens)
MAX_HEAD_DIM, MAX_GRID_YZ, MAX_TOKENS = 2048, 65535, 2**31 - 1


def find_nvcc() -> str | None:
    """The nvcc to build with: $CUDA_HOME/bin/nvcc (or $CUDA_PATH's), else `nvcc` on PATH; None if neither."""
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return shutil.which("nvcc")


def nvcc_flags(archs: list[str]) -> list[str]:
    """nvcc's flags for a shared library with SASS for each of `archs` (e.g. ["90", "100"]) and the PTX of
    the newest (so a newer GPU can JIT it)."""
    flags = ["-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17"]
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    newest = max(archs, key=int)
    return flags + ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]


def compile_cuda_library(out: str | Path, archs: list[str], nvcc: str | None = None) -> Path:
    """Compile csrc/kv_inject.cu into the shared library `out` for the GPU architectures `archs`
    (compute capabilities without the dot: "90" for H100/H200, "100" for B200). Needs nvcc, not a GPU.

    Raises:
        ValueError: `archs` is not a non-empty list of digit strings.
        OSError: `out` cannot be written (a folder, a missing or unwritable parent folder): checked first.
        FileNotFoundError: no nvcc (`find_nvcc`).
        RuntimeError: nvcc failed; the message holds its first `error` line and the command.
    """
    if (not isinstance(archs, (list, tuple)) or not archs
            or not all(isinstance(a, str) and a.isascii() and a.isdigit() for a in archs)):
        raise ValueError(f"archs must be a list of compute capabilities without the dot, as strings, e.g. ['90'] "
                         f"(H100/H200) or ['90', '100'], got {archs!r}")
    out = Path(out)
    folder = out.parent
    if out.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        why = ("is a folder" if out.is_dir() else "is in a folder that does not exist" if not folder.exists()
               else "is under a file" if not folder.is_dir() else "is in a folder this process cannot write")
        raise OSError(f"cannot write the CUDA library to {out}: it {why}; give a file path in a writable folder")
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("building the CUDA kernels needs nvcc: install the CUDA toolkit (or its PyPI "
                                "wheels) and put nvcc on PATH, or set CUDA_HOME")
    cmd = [nvcc, *nvcc_flags(list(archs)), str(SOURCE), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        first = next((ln for ln in lines if "error" in ln), lines[-1] if lines else f"exit status {proc.returncode}")
        hint = (f"; `{nvcc} --list-gpu-arch` lists the architectures it compiles for"
                if "Unsupported gpu architecture" in first else "")
        raise RuntimeError(f"nvcc failed: {first[:300]}{hint} (command: {' '.join(cmd)})")
    return out


def open_library(path: str | Path) -> ctypes.CDLL:
    """Load a library `compile_cuda_library` wrote and declare its C entry points' types."""
    lib = ctypes.CDLL(str(path))
    i64 = ctypes.c_int64
    lib.dflash_kv_inject.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     i64, i64, i64, i64, i64, i64, i64, ctypes.c_void_p]
    lib.dflash_kv_inject.restype = ctypes.c_int
    lib.dflash_cuda_error_string.argtypes = [ctypes.c_int]
    lib.dflash_cuda_error_string.restype = ctypes.c_char_p
    return lib


def _nvcc_version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.cache
def _library(arch: str) -> ctypes.CDLL:
    """The CUDA library for architecture `arch`, built once (see the module docstring).

    Raises:
        ConfigError: no nvcc, the cache cannot be written, or the build failed (now or earlier).
    """
    from dflash_trt.errors import ConfigError
    from dflash_trt.models.default import cache_dir

    nvcc = find_nvcc()
    if nvcc is None:
        raise ConfigError("the CUDA kernels need nvcc to build (~10 s, once): install the CUDA toolkit and put "
                          "nvcc on PATH (or set CUDA_HOME), or run without --cuda-kernels")
    key = hashlib.sha256(SOURCE.read_bytes() + _nvcc_version(nvcc).encode() + arch.encode()).hexdigest()[:16]
    final = cache_dir() / "ops" / f"cuda-{key}"
    lib = final / f"{NAME}.so"
    if lib.is_file():
        return open_library(lib)
    record = final.with_name(final.name + ".failed")
    identity = _compiler_identity(nvcc)
    earlier = _read_failure(record, identity)
    if earlier is not None:
        raise ConfigError(f"the CUDA kernels failed to build earlier with {nvcc} ({earlier}); delete {record} to retry")

    def build(tmp: Path) -> None:
        print(f"dflash-trt: building the CUDA kernels for sm_{arch} (once, ~10 s)...", file=sys.stderr, flush=True)
        compile_cuda_library(tmp / f"{NAME}.so", [arch], nvcc)

    why = build_once(final, record, identity, "CUDA kernels", build)
    if why is not None:
        raise ConfigError(why)
    return open_library(lib)


def device_arch(device: torch.device | str) -> str:
    """The compute capability of a CUDA device without the dot ("90" on an H200)."""
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return f"{major}{minor}"


def require_cuda_kernels(device: torch.device | str) -> None:
    """Build/load the CUDA library for `device`'s GPU, or raise ConfigError saying why it cannot run.

    Raises:
        ConfigError: `device` is not a CUDA device, CUDA is not available, or the library cannot be built.
    """
    from dflash_trt.errors import ConfigError

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"the CUDA kernels need a CUDA device (got {device}, CUDA available: "
                          f"{torch.cuda.is_available()}); run without --cuda-kernels")
    _library(device_arch(dev))


def kv_inject_cuda(kv: torch.Tensor, k_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
    """`torch.ops.dflash_trt.kv_inject` on CUDA tensors (registered for the CUDA dispatch key in
    `dflash_trt.ops`): k_norm + RoPE of every drafter layer's context K and the cache write of K and V.

    Args: as the CPU op (csrc/kv_inject.cpp), on one CUDA device, with kv, k_norm and cache in the same
        dtype (float32, float16 or bfloat16): kv [n, c, L * 2 * H * D], k_norm [L, D], cos/sin float32
        [n, c, D], cache [2, L, B, H, cap, D] (written in place), rows int64 [n], positions int64 [n, c].
    Raises:
        RuntimeError: a dtype, device, shape or layout the kernel does not take (names it:
            `dflash_trt.ops.check_kv_inject_args`), a shape over the kernel's limits (`MAX_HEAD_DIM`,
            `MAX_GRID_YZ` layers or KV heads, `MAX_TOKENS`; named), or a CUDA launch error. A call with
            nothing to write (no tokens, or L, H or D of 0) returns at once, as the CPU kernel does.
        IndexError: tokens for a cache with no rows or no slots. Another row or position outside the cache
            is a device-side assertion (asynchronous, as in torch's own indexing).
        ConfigError: the library cannot be built here.
    """
    n, c, L, B, H, cap, D = check_kv_inject_args(kv, k_norm, cos, sin, cache, rows, positions,
                                                  tuple(DTYPE_CODES))
    if n * c == 0 or L * H * D == 0:
        return  # nothing to write, as in the CPU kernel (the C entry point refuses L, H or D of 0)
    if D > MAX_HEAD_DIM or L > MAX_GRID_YZ or H > MAX_GRID_YZ or n * c > MAX_TOKENS:
        raise RuntimeError(f"kv_inject: the CUDA kernel takes head_dim <= {MAX_HEAD_DIM} (one thread per RoPE pair), "
                           f"at most {MAX_GRID_YZ} layers and {MAX_GRID_YZ} KV heads and at most {MAX_TOKENS} tokens "
                           f"(its grid's limits), got head_dim {D}, {L} layers, {H} KV heads and {n * c} tokens: "
                           "inject with the PyTorch path instead (without --cuda-kernels)")
    if B == 0 or cap == 0:  # every row or position is outside the cache: named here, not a device-side assertion
        raise IndexError(f"kv_inject: the cache [2, L, B, H, cap, D] = {list(cache.shape)} has no "
                         f"{'rows' if B == 0 else 'slots'} for {n * c} tokens")
    dev = cache.device
    lib = _library(device_arch(dev))
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev).cuda_stream
        code = lib.dflash_kv_inject(DTYPE_CODES[cache.dtype], kv.data_ptr(), k_norm.data_ptr(), float(eps),
                                    cos.data_ptr(), sin.data_ptr(), cache.data_ptr(), rows.data_ptr(),
                                    positions.data_ptr(), n, c, L, B, H, cap, D, stream)
    if code != 0:
        raise RuntimeError(f"kv_inject: the CUDA launch failed: {lib.dflash_cuda_error_string(code).decode()} "
                           f"(head_dim {D}, {L} layers, {H} KV heads, {n * c} tokens)")


def resolve_cuda_kernels(mode: str, device: str) -> bool:
    """Whether the drafter injects its context K/V with the CUDA kernel: `mode` "on" (then `device` must be
    a CUDA device, and CUDA available) or "off" (the PyTorch path). Cheap: the loaders call it first, and
    `require_cuda_kernels` (the build) later, before any weights load. Off by default until a GPU run has
    measured it against the PyTorch path (build_scripts/gpu_check_kv_inject.sh).

    Raises:
        ConfigError: an unknown mode, or "on" where the kernel cannot run (names why).
    """
    from dflash_trt.errors import ConfigError

    if mode not in ("on", "off"):
        raise ConfigError(f"cuda_kernels must be on or off, got {mode!r}")
    if mode == "off":
        return False
    if torch.device(device).type != "cuda":
        raise ConfigError(f"--cuda-kernels on needs --device cuda (got {device}); on a CPU the fused injection is "
                          "part of --cpu-kernels")
    if not torch.cuda.is_available():
        raise ConfigError(f"--cuda-kernels on needs a CUDA GPU, and torch sees none (device {device}); run without "
                          "--cuda-kernels")
    return True
