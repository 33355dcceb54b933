"""dflash-trt's C++ op library (torch custom ops, namespace `torch.ops.dflash_trt`): `packed_linear` and
`pack_q4_1` / `pack_q8_0` (csrc/packed_linear.cpp, csrc/pack_gguf.cpp; `dflash_trt.ops.packed_linear`) and
the fused KV injection `kv_inject` (`DFlashDrafter.use_fused_injection`), whose schema and kernels are
registered here at import: for CPU tensors `_kv_inject_cpu`, which loads the CPU library (building it on
first use) and calls its `kv_inject_cpu` (csrc/kv_inject.cpp), so the op runs before `require_cpu_kernels()`
too, or raises a ConfigError saying why it cannot; for CUDA tensors its CUDA kernel (csrc/kv_inject.cu,
`dflash_trt.ops.cuda`, built with nvcc on first use), which needs no CPU library.

Built from `dflash_trt/ops/csrc/*.cpp` on first use with `torch.utils.cpp_extension` (needs a C++
compiler and the `ninja` package; ~15 s once), for the CPU's instruction set (`cpu_isa`: AVX-512, or
AVX2 with FMA and F16C; the kernels of both give the same bits), into a temporary folder renamed at
the end to `<cache>/ops/<key>/` (`dflash_trt.models.default.cache_dir`; key: a hash of the sources,
flags, torch and Python versions), so an interrupted build leaves nothing that a later process would
load or wait on. Later processes load the built library directly.

A build that fails (a compiler error, a broken toolchain) is recorded in `<cache>/ops/<key>.failed`
(JSON, written atomically: the one-line reason, the compiler and the time), so later processes give
the reason at once instead of recompiling ~15 s to fail again; the record holds for the same compiler
only (the `CXX` name, the file it resolves to, its size and modification time), so installing or
switching a compiler retries by itself, and deleting the file retries too. A successful build removes
the record. A missing `ninja` or compiler is checked before building and never recorded, nor is an
interrupted build (Ctrl-C). See `dflash_trt.ops.packed_linear`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("packed_linear.cpp", "pack_gguf.cpp", "kv_inject.cpp")
#: compiler flags of each instruction set the kernels are written for (csrc/packed_linear.cpp's sections)
ISA_CFLAGS = {
    "avx512": ("-O3", "-mavx512f", "-mfma", "-fopenmp"),
    "avx2": ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"),
}
NAME = "dflash_trt_cpu_ops"


def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo (Linux), stripped; None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return None


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo; empty where that cannot be read."""
    return set((_cpuinfo("flags") or "").split())


def cpu_model_name() -> str | None:
    """The CPU's model name from /proc/cpuinfo (e.g. "AMD EPYC"), for benchmark records; None off Linux."""
    return _cpuinfo("model name")


@functools.cache
def cpu_isa() -> str | None:
    """The instruction set the CPU kernels are built for here: "avx512" (torch's capability AVX512),
    "avx2" (torch's AVX2, which implies FMA, and the F16C half-float conversions), or None."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":
        return "avx512"
    if cap == "AVX2" and "f16c" in _cpu_flags():
        return "avx2"
    return None


def cpu_kernels_unavailable() -> str | None:
    """None when the CPU op library can run here, else why not (a sentence naming what is missing).

    Checks the ISA first (`cpu_isa`), then builds or loads the library once per process.
    """
    if cpu_isa() is None:
        cap = torch.backends.cpu.get_cpu_capability()
        return f"the CPU kernels need AVX-512, or AVX2 with FMA and F16C (torch reports {cap} on this CPU)"
    return _load_cpu_library()


def require_cpu_kernels() -> None:
    """Build/load the CPU op library, or raise ConfigError saying why it cannot run here."""
    why = cpu_kernels_unavailable()
    if why is not None:
        from dflash_trt.errors import ConfigError

        raise ConfigError(f"{why}; run with --cpu-kernels off (torch's linears)")


def _build_key() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(ISA_CFLAGS[cpu_isa()]).encode() + torch.__version__.encode() + sys.version.encode())
    return h.hexdigest()[:16]


def _compiler_identity(compiler: str) -> dict:
    """What a failure record holds of the compiler (`CXX`): its name, the file it resolves to on PATH,
    that file's size and modification time; another compiler, or a reinstalled one, differs."""
    path = shutil.which(compiler)
    ident = {"cxx": compiler, "path": None, "size": None, "mtime_ns": None}
    if path is not None:
        real = os.path.realpath(path)
        ident["path"] = real
        try:
            st = os.stat(real)
            ident["size"], ident["mtime_ns"] = st.st_size, st.st_mtime_ns
        except OSError:
            pass
    return ident


def _failure_reason(exc: Exception) -> str:
    """One line saying why the build failed: the compiler's first `error:` line (torch's message holds
    the whole ninja log, whose last line is only 'ninja: build stopped'), else the message's last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first_error = next((line for line in lines if re.search(r"\berror:", line)), None)
    line = first_error or (lines[-1] if lines else "")
    if len(line) > 300:
        line = line[:297] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _read_failure(record: Path, compiler: dict) -> str | None:
    """The reason of an earlier failed build recorded in `record` for this same compiler; None where there
    is no record, it cannot be read, or it was made with another compiler (then the build is retried)."""
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("compiler") != compiler or not isinstance(data.get("reason"), str):
        return None
    return data["reason"]


def _write_failure(record: Path, reason: str, compiler: dict) -> None:
    """Record a failed build in `record` (`dflash_trt.files.write_json_atomic`); a cache that cannot be
    written only means the next process tries again, so errors are ignored."""
    from dflash_trt.files import write_json_atomic

    data = {"reason": reason, "compiler": compiler, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        write_json_atomic(record, data)
    except OSError:
        pass


@functools.cache
def _load_cpu_library() -> str | None:
    from dflash_trt.models.default import cache_dir

    final = cache_dir() / "ops" / _build_key()
    lib = final / f"{NAME}.so"
    if lib.is_file():
        torch.ops.load_library(str(lib))
        return None
    try:
        import ninja  # noqa: F401  (torch's builder runs the ninja binary this package provides)
    except ImportError:
        return "building the CPU kernels needs the `ninja` package: pip install ninja"
    compiler = os.environ.get("CXX", "c++")  # what torch's builder runs
    if shutil.which(compiler) is None:
        return (f"building the CPU kernels needs a C++ compiler, and `{compiler}` is not on PATH: install g++ "
                "(e.g. apt install g++) or set CXX")
    record = final.with_name(final.name + ".failed")
    identity = _compiler_identity(compiler)
    earlier = _read_failure(record, identity)
    if earlier is not None:
        return f"the CPU kernels failed to build earlier with `{compiler}` ({earlier}); delete {record} to retry"
    from torch.utils.cpp_extension import load

    def build(tmp: Path) -> None:
        print("dflash-trt: building the CPU kernels (once: ~15 s on an idle machine, minutes on a busy one)...",
              file=sys.stderr, flush=True)
        load(name=NAME, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=list(ISA_CFLAGS[cpu_isa()]),
             build_directory=str(tmp), is_python_module=False, verbose=False)

    return build_once(final, record, identity, "CPU kernels", build)


#: build failures of the machine, not the toolchain (a full disk, no memory, a killed compiler): not recorded
TRANSIENT = re.compile(r"No space left on device|Cannot allocate memory|out of memory|Killed signal|"
                       r"Resource temporarily unavailable|Disk quota exceeded")


def build_once(final: Path, record: Path, compiler: dict, what: str, build) -> str | None:
    """Run `build(tmp)` in a new temporary folder of the cache and rename it to `final` at the end (another
    process may have finished first: its folder is kept), so an interrupted build leaves nothing a later
    process would load. Returns None on success (and removes a stale failure `record`), else one line
    saying why: the cache cannot be written, or the build raised: a compiler error or a broken toolchain
    is then recorded in `record` for this `compiler` (`_write_failure`); a failure of the machine (an
    OSError such as a full disk, no memory, a compiler killed: `TRANSIENT`) is not, so the next run
    retries. Ctrl-C is not a failure to record: the partial build is removed and it propagates. `what`
    names the library."""
    from dflash_trt.errors import DFlashError
    from dflash_trt.models.default import cache_temp_dir

    try:
        tmp = cache_temp_dir("ops", f".{final.name}.")
    except DFlashError as exc:
        return f"the {what} cannot be built: {exc}"
    try:
        build(tmp)
    except Exception as exc:  # noqa: BLE001  (reported, not raised)
        shutil.rmtree(tmp, ignore_errors=True)
        reason = _failure_reason(exc)
        if isinstance(exc, (OSError, MemoryError)) or TRANSIENT.search(str(exc)):
            return (f"the {what} failed to build ({reason}); not recorded (a failure of the machine, not the "
                    "compiler): fix that and rerun")
        _write_failure(record, reason, compiler)
        return f"the {what} failed to build ({reason}); recorded in {record} (delete it to retry)"
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        record.unlink(missing_ok=True)  # a stale record of an earlier failure (e.g. with another compiler)
    except OSError:
        pass
    return None


#: the op library's Python side: `kv_inject`'s schema and its kernels for CPU and CUDA tensors
_LIBRARY = torch.library.Library("dflash_trt", "FRAGMENT")
_LIBRARY.define("kv_inject(Tensor kv, Tensor k_norm, float eps, Tensor cos, Tensor sin, Tensor(a!) cache, "
                "Tensor rows, Tensor positions) -> ()")


def check_kv_inject_args(kv, k_norm, cos, sin, cache, rows, positions, dtypes) -> tuple[int, ...]:
    """Check `kv_inject`'s tensors as its kernels take them, before anything is read or written: one device
    (the cache's), contiguous, kv, k_norm and cache of one dtype of `dtypes`, cos / sin float32, rows /
    positions int64, and the shapes of csrc/kv_inject.cpp's header. Returns (n, c, L, B, H, cap, D).
    Used by the CUDA kernel (`dflash_trt.ops.cuda.kv_inject_cuda`) and the op's fake kernel (meta
    tensors, torch.compile); the CPU kernel makes the same checks in C++. Rows and positions are
    values, checked by the kernels.

    Raises:
        RuntimeError: "kv_inject: " and the argument that is wrong (its device, layout, dtype or shape).
    """
    tensors = {"kv": kv, "k_norm": k_norm, "cos": cos, "sin": sin, "cache": cache, "rows": rows,
               "positions": positions}
    dev = cache.device
    for name, t in tensors.items():
        if t.device != dev:
            raise RuntimeError(f"kv_inject: {name} is on {t.device}, the cache on {dev}: every tensor must be on "
                               "the same device")
        if not t.is_contiguous():
            how = "it is written in place: allocate it so" if name == "cache" else "call .contiguous() on it"
            raise RuntimeError(f"kv_inject: {name} must be contiguous ({how}), got strides {list(t.stride())} for "
                               f"sizes {list(t.shape)}")
    if cache.dtype not in dtypes or kv.dtype != cache.dtype or k_norm.dtype != cache.dtype:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise RuntimeError(f"kv_inject: kv, k_norm and cache must share one dtype of {names}, got {kv.dtype}, "
                           f"{k_norm.dtype} and {cache.dtype}")
    for name, t, dtype in (("cos", cos, torch.float32), ("sin", sin, torch.float32), ("rows", rows, torch.int64),
                           ("positions", positions, torch.int64)):
        if t.dtype != dtype:
            raise RuntimeError(f"kv_inject: {name} must be {dtype}, got {t.dtype}")
    if cache.dim() != 6 or cache.shape[0] != 2:
        raise RuntimeError(f"kv_inject: cache must be [2, L, B, H, cap, D], got {list(cache.shape)}")
    _, L, B, H, cap, D = cache.shape
    if D % 2:
        raise RuntimeError(f"kv_inject: head_dim must be even for RoPE, got {D}")
    if positions.dim() != 2:
        raise RuntimeError(f"kv_inject: positions must be [n, c], got {list(positions.shape)}")
    n, c = positions.shape
    expect = {"kv": (kv, [n, c, L * 2 * H * D]), "k_norm": (k_norm, [L, D]), "cos": (cos, [n, c, D]),
              "sin": (sin, [n, c, D]), "rows": (rows, [n])}
    for name, (t, shape) in expect.items():
        if list(t.shape) != shape:
            raise RuntimeError(f"kv_inject: {name} must be {shape}, got {list(t.shape)}")
    return n, c, L, B, H, cap, D


def _kv_inject_cpu(kv, k_norm, eps, cos, sin, cache, rows, positions) -> None:
    """`torch.ops.dflash_trt.kv_inject` on CPU tensors: the CPU op library's `kv_inject_cpu`
    (csrc/kv_inject.cpp; arguments, shapes and errors there), loaded first (`cpu_kernels_unavailable`:
    built once, ~15 s), so a call before `require_cpu_kernels()` runs as one after it.

    Raises:
        ConfigError: the CPU kernels cannot run here (the reason, `require_cpu_kernels` and the fix).
    """
    why = cpu_kernels_unavailable()
    if why is not None:
        from dflash_trt.errors import ConfigError

        raise ConfigError(f"torch.ops.dflash_trt.kv_inject has no CPU kernel here: {why} (dflash_trt.ops."
                          "require_cpu_kernels() says the same); inject with the PyTorch path instead: a DFlashDrafter "
                          "without use_fused_injection(), as --cpu-kernels off runs")
    torch.ops.dflash_trt.kv_inject_cpu(kv, k_norm, eps, cos, sin, cache, rows, positions)


def _kv_inject_cuda(kv, k_norm, eps, cos, sin, cache, rows, positions) -> None:
    from dflash_trt.ops.cuda import kv_inject_cuda

    kv_inject_cuda(kv, k_norm, eps, cos, sin, cache, rows, positions)


_LIBRARY.impl("kv_inject", _kv_inject_cpu, "CPU")
_LIBRARY.impl("kv_inject", _kv_inject_cuda, "CUDA")


@torch.library.register_fake("dflash_trt::kv_inject", lib=_LIBRARY)
def _kv_inject_fake(kv, k_norm, eps, cos, sin, cache, rows, positions) -> None:
    """The op on meta / fake tensors (shape checks without data, torch.compile's tracing): the argument checks
    of the kernel that would run (`check_kv_inject_args`): fake CPU tensors (FakeTensorMode) float32 only, as
    csrc/kv_inject.cpp; CUDA and meta tensors the CUDA kernel's dtypes, the most. Writes nothing, as there is
    nothing to write."""
    from dflash_trt.ops.cuda import DTYPE_CODES

    dtypes = (torch.float32,) if cache.device.type == "cpu" else tuple(DTYPE_CODES)
    check_kv_inject_args(kv, k_norm, cos, sin, cache, rows, positions, dtypes)
