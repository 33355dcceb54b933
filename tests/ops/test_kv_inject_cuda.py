"""The fused KV-injection op's CUDA kernel (csrc/kv_inject.cu, `dflash_trt.ops.cuda`).

Here (no GPU): nvcc compiles it for Hopper and Blackwell without register spills, its C entry point
refuses bad arguments before touching a GPU (and so does the guarded one the TensorRT plugin calls), a
failed build is recorded and named, and the options that turn it on refuse a device that is not CUDA. On a
CUDA machine: the kernel against the PyTorch reference in float32 / bfloat16 / float16, nothing else
written, a bad position stops it (the guarded entry point skips it instead), and DFlash with it gives the
target's own greedy output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from dflash_trt.errors import ConfigError
from dflash_trt.ops import cuda as cuda_ops
from tests.conftest import run_main

needs_nvcc = pytest.mark.skipif(cuda_ops.find_nvcc() is None, reason="nvcc is not installed")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")

CUDA_ERROR_INVALID_VALUE = 1


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """The kernel compiled here for sm_90 and sm_100 (H100/H200, B200), loaded with ctypes."""
    if cuda_ops.find_nvcc() is None:
        pytest.skip("nvcc is not installed")
    path = cuda_ops.compile_cuda_library(tmp_path_factory.mktemp("cuda") / "ops.so", ["90", "100"])
    return cuda_ops.open_library(path)


@needs_nvcc
def test_compiles_for_hopper_and_blackwell_without_spills():
    """ptxas's report: each dtype's kernel (float, __half, __nv_bfloat16) built for each architecture,
    with no register spills."""
    flags = cuda_ops.nvcc_flags(["90", "100"])
    proc = subprocess.run([cuda_ops.find_nvcc(), *flags, "-Xptxas", "-v", str(cuda_ops.SOURCE), "-o", os.devnull],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = proc.stderr + proc.stdout
    for arch in ("sm_90", "sm_100"):
        entries = re.findall(rf"Compiling entry function '(\w+)' for '{arch}'", report)
        kernels = [e for e in entries if "kv_inject_kernel" in e]
        assert len(kernels) == 3, (arch, entries)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), spills


@needs_nvcc
def test_no_fused_multiply_add_so_each_product_is_rounded_as_torch_rounds_it(tmp_path):
    """The reference (RMSNorm, then apply_rope) rounds every product and every sum on its own; nvcc contracted the
    float32 kernel's RoPE `a * cos + b * sin` (and the sum of squares) into one fma, a single rounding, so K could
    differ by half an ulp of the larger product, above the result's own ulp where the two cancel. The PTX of each
    dtype's kernel now holds no fma.rn.f32 (the products and sums are __fmul_rn / __fadd_rn)."""
    ptx = tmp_path / "kv_inject.ptx"
    proc = subprocess.run([cuda_ops.find_nvcc(), "-O3", "-std=c++17", "-ptx", "-arch=sm_90", str(cuda_ops.SOURCE),
                           "-o", str(ptx)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    bodies = re.split(r"\.entry ", ptx.read_text())[1:]
    kernels = {re.search(r"kv_inject_kernelI(f|6__half|13__nv_bfloat16)E", b).group(1): b for b in bodies}
    assert sorted(kernels) == ["13__nv_bfloat16", "6__half", "f"], list(kernels)
    for name, body in kernels.items():
        assert "fma.rn.f32" not in body, name
        assert "mul.rn.f32" in body, name


def call(lib, dtype=0, n=1, c=1, layers=1, heads=1, head_dim=64, stream=None):
    return lib.dflash_kv_inject(dtype, None, None, 1e-6, None, None, None, None, None, n, c, layers, 2, heads, 8,
                                head_dim, stream)


def test_entry_point_refuses_bad_arguments_before_the_gpu(library):
    """cudaErrorInvalidValue for what the kernel cannot take; nothing launched for zero tokens."""
    assert call(library, dtype=3) == CUDA_ERROR_INVALID_VALUE  # not float32 / float16 / bfloat16
    assert call(library, head_dim=63) == CUDA_ERROR_INVALID_VALUE  # odd: no RoPE pairs
    assert call(library, head_dim=4096) == CUDA_ERROR_INVALID_VALUE  # over 1024 threads
    assert call(library, layers=0) == CUDA_ERROR_INVALID_VALUE
    assert call(library, heads=70000) == CUDA_ERROR_INVALID_VALUE  # the grid's z limit
    assert call(library, n=1 << 20, c=1 << 12) == CUDA_ERROR_INVALID_VALUE  # 2^32 tokens
    assert call(library, n=0) == 0 and call(library, c=0) == 0
    assert library.dflash_cuda_error_string(CUDA_ERROR_INVALID_VALUE) == b"invalid argument"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: this would launch on null pointers")
def test_entry_point_reports_a_missing_gpu(library):
    """A valid call on a machine without a GPU driver returns CUDA's error, which has a name."""
    for dtype in (0, 1, 2):
        code = call(library, dtype=dtype)
        assert code != 0
        assert library.dflash_cuda_error_string(code).decode() not in ("", "no error")


def guarded_entry_point(lib):
    """`dflash_kv_inject_guarded` (the TensorRT plugin's entry point: out-of-range rows and positions skipped, not
    asserted), typed as `dflash_kv_inject` (`open_library` types only that one)."""
    fn = lib.dflash_kv_inject_guarded
    fn.argtypes, fn.restype = lib.dflash_kv_inject.argtypes, lib.dflash_kv_inject.restype
    return fn


def call_guarded(lib, dtype=0, n=1, c=1, layers=1, heads=1, head_dim=64, stream=None):
    return guarded_entry_point(lib)(dtype, None, None, 1e-6, None, None, None, None, None, n, c, layers, 2, heads, 8,
                                    head_dim, stream)


def test_guarded_entry_point_refuses_bad_arguments_before_the_gpu(library):
    """The same argument checks as `dflash_kv_inject`: cudaErrorInvalidValue, nothing launched for zero tokens."""
    assert call_guarded(library, dtype=3) == CUDA_ERROR_INVALID_VALUE
    assert call_guarded(library, head_dim=63) == CUDA_ERROR_INVALID_VALUE  # odd: no RoPE pairs
    assert call_guarded(library, head_dim=4096) == CUDA_ERROR_INVALID_VALUE
    assert call_guarded(library, layers=0) == CUDA_ERROR_INVALID_VALUE
    assert call_guarded(library, heads=70000) == CUDA_ERROR_INVALID_VALUE
    assert call_guarded(library, n=1 << 20, c=1 << 12) == CUDA_ERROR_INVALID_VALUE
    assert call_guarded(library, n=0) == 0 and call_guarded(library, c=0) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: this would launch on null pointers")
def test_guarded_entry_point_reports_a_missing_gpu(library):
    for dtype in (0, 1, 2):
        code = call_guarded(library, dtype=dtype)
        assert code != 0
        assert library.dflash_cuda_error_string(code).decode() not in ("", "no error")


@needs_nvcc
def test_built_once_into_the_cache(tmp_path, monkeypatch, capsys):
    """The first use builds into <cache>/ops/cuda-<key>/ (no temporary folder left); a later process loads it."""
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path))
    build = cuda_ops._library.__wrapped__  # not the per-process cache
    lib = build("90")
    assert "building the CUDA kernels for sm_90" in capsys.readouterr().err
    assert call(lib, dtype=3) == CUDA_ERROR_INVALID_VALUE
    [folder] = (tmp_path / "ops").iterdir()  # no temporary folder left beside it
    assert folder.name.startswith("cuda-") and (folder / f"{cuda_ops.NAME}.so").is_file()
    build("90")
    assert capsys.readouterr().err == ""  # loaded, not rebuilt


def test_a_failed_build_is_recorded_and_named(tmp_path, monkeypatch):
    """An nvcc that fails: ConfigError with its error line; the next process sees the record and does not
    rebuild; another nvcc (here: the same path rewritten) retries."""
    fake = tmp_path / "cuda" / "bin" / "nvcc"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'kv_inject.cu(1): error: this nvcc is broken' >&2\nexit 2\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    build = cuda_ops._library.__wrapped__  # not the per-process cache
    with pytest.raises(ConfigError, match="failed to build .*this nvcc is broken.*recorded in"):
        build("90")
    records = list((tmp_path / "cache" / "ops").glob("cuda-*.failed"))
    assert len(records) == 1
    assert not [p for p in (tmp_path / "cache" / "ops").iterdir() if p.is_dir()]  # no half-built folder
    with pytest.raises(ConfigError, match=r"failed to build earlier .*this nvcc is broken.*delete .* to retry"):
        build("90")
    fake.write_text(fake.read_text().replace("broken", "still broken") + "\n")  # another compiler (size)
    with pytest.raises(ConfigError, match="failed to build \\(.*still broken"):
        build("90")


def test_bad_archs_and_outputs_are_named_before_compiling(tmp_path):
    for archs in ("90", [90], ["9.0"], [], ["sm_90"], ["\u0669\u0660"], None):
        with pytest.raises(ValueError, match=r"archs must be a list of compute capabilities .*got"):
            cuda_ops.compile_cuda_library(tmp_path / "x.so", archs)
    (tmp_path / "file").write_text("")
    for out, why in ((tmp_path, "is a folder"), (tmp_path / "missing" / "x.so", "does not exist"),
                     (tmp_path / "file" / "x.so", "does not exist|is under a file")):
        with pytest.raises(OSError, match=rf"cannot write the CUDA library to .*: it .*({why})"):
            cuda_ops.compile_cuda_library(out, ["90"])


@needs_nvcc
def test_an_architecture_nvcc_does_not_know_is_named_with_the_list(tmp_path):
    with pytest.raises(RuntimeError, match=r"Unsupported gpu architecture 'compute_35'.*--list-gpu-arch` lists"):
        cuda_ops.compile_cuda_library(tmp_path / "x.so", ["35"])


def test_no_nvcc_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cuda_ops.find_nvcc() is None
    with pytest.raises(ConfigError, match="need nvcc to build"):
        cuda_ops._library.__wrapped__("90")
    with pytest.raises(FileNotFoundError, match="needs nvcc"):
        cuda_ops.compile_cuda_library(tmp_path / "x.so", ["90"])


def test_cuda_kernels_option_needs_a_cuda_device():
    with pytest.raises(ConfigError, match="--cuda-kernels on needs --device cuda"):
        cuda_ops.resolve_cuda_kernels("on", "cpu")
    with pytest.raises(ConfigError, match="cuda_kernels must be on or off, got 'auto'"):
        cuda_ops.resolve_cuda_kernels("auto", "cpu")
    assert cuda_ops.resolve_cuda_kernels("off", "cpu") is False


def test_python_side_names_bad_tensors():
    """The checks `kv_inject_cuda` makes before any pointer reaches the kernel (CPU tensors reach them too)."""
    L, B, H, cap, D = 2, 3, 1, 8, 64
    cache = torch.zeros(2, L, B, H, cap, D)
    good = dict(kv=torch.zeros(1, 2, L * 2 * H * D), k_norm=torch.ones(L, D), eps=1e-6, cos=torch.zeros(1, 2, D),
                sin=torch.zeros(1, 2, D), cache=cache, rows=torch.tensor([0]), positions=torch.tensor([[0, 1]]))
    cases = [("kv", torch.zeros(1, 2, L * 2 * H * D + 1), r"kv must be \[1, 2, 256\]"),
             ("kv", torch.zeros(1, 2, L * 2 * H * D, dtype=torch.bfloat16), "share one dtype"),
             ("cos", torch.zeros(1, 2, D, dtype=torch.float64), "cos must be torch.float32, got torch.float64"),
             ("positions", torch.tensor([[0, 1]], dtype=torch.int32), "positions must be torch.int64, got torch.int32"),
             ("positions", torch.tensor([0, 1]), r"positions must be \[n, c\]"),
             ("k_norm", torch.ones(D, L).t(), "k_norm must be contiguous"),
             ("cache", torch.zeros(3, L, B, H, cap, D), r"cache must be \[2, L, B, H, cap, D\]"),
             ("rows", torch.tensor([0, 1]), r"rows must be \[1\]")]
    for name, value, message in cases:
        with pytest.raises(RuntimeError, match=message):
            cuda_ops.kv_inject_cuda(**{**good, name: value})


def test_python_side_names_the_kernel_limits_and_skips_empty_work(monkeypatch):
    """A head_dim over 2048 or more than 65535 layers / KV heads reached the C entry point, which refused it with
    "the CUDA launch failed: invalid argument", and a call with nothing to write but L, H or D of 0 (a no-op on the
    CPU) failed the same way; a cache with no rows or slots for its tokens was a device-side assertion. Now the limit
    is named before the library is touched, empty work returns at once and an empty cache is an IndexError."""
    def no_library(arch):
        raise AssertionError("the library was reached")

    monkeypatch.setattr(cuda_ops, "_library", no_library)

    def args(L=1, B=1, H=1, cap=4, D=4, n=1, c=1):
        return dict(kv=torch.zeros(n, c, L * 2 * H * D), k_norm=torch.ones(L, D), eps=1e-6, cos=torch.zeros(n, c, D),
                    sin=torch.zeros(n, c, D), cache=torch.zeros(2, L, B, H, cap, D),
                    rows=torch.zeros(n, dtype=torch.long), positions=torch.zeros(n, c, dtype=torch.long))

    for shape in (dict(D=4096), dict(L=65536, D=2), dict(H=65536, D=2)):
        with pytest.raises(RuntimeError, match=r"^kv_inject: the CUDA kernel takes head_dim <= 2048 .*65535 layers "
                                               r"and 65535 KV heads.*inject with the PyTorch path"):
            cuda_ops.kv_inject_cuda(**args(**shape))
    for shape in (dict(L=0), dict(H=0), dict(D=0), dict(n=0), dict(c=0), dict(n=0, B=0, cap=0)):
        assert cuda_ops.kv_inject_cuda(**args(**shape)) is None
    with pytest.raises(IndexError, match=r"^kv_inject: the cache .* has no rows for 1 tokens"):
        cuda_ops.kv_inject_cuda(**args(B=0))
    with pytest.raises(IndexError, match=r"^kv_inject: the cache .* has no slots for 2 tokens"):
        cuda_ops.kv_inject_cuda(**args(cap=0, c=2))


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi", "--max-tokens", "2"], ["serve"],
                                     ["bench", "--num-prompts", "1"]])
def test_cli_refuses_cuda_kernels_on_a_cpu(monkeypatch, capsys, tmp_path, command):
    """One error line, before anything is built or converted (a fresh cache stays empty) or a dataset read."""
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(monkeypatch, capsys, *command, "--cuda-kernels", "on")
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("error: --cuda-kernels on needs --device cuda (got cpu)")
    assert list(tmp_path.iterdir()) == []  # no cache, no bench output


# ---- on a CUDA GPU ------------------------------------------------------------------------------------------

def reference_inject(drafter, kv, cos, sin, cache, rows, positions):
    """What the PyTorch path writes for the same projections `kv` [n, c, L * 2 * H * D]: per layer the
    drafter's own k_norm and apply_rope, then KVCache.write."""
    from dflash_trt.models.layers import apply_rope

    cfg = drafter.config
    n, c, _ = kv.shape
    H, D = cfg.num_key_value_heads, cfg.head_dim
    for i, layer in enumerate(drafter.layers):
        k = kv[..., i * 2 * H * D:(i * 2 + 1) * H * D].view(n, c, H, D)
        v = kv[..., (i * 2 + 1) * H * D:(i + 1) * 2 * H * D].view(n, c, H, D)
        k = apply_rope(layer.self_attn.k_norm(k).transpose(1, 2), cos, sin)
        cache.write(i, rows, positions, k, v.transpose(1, 2))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_writes_what_the_reference_writes(dtype):
    from dflash_trt.models.checkpoints import load_drafter
    from dflash_trt.models.default import default_drafter_path

    drafter = load_drafter(default_drafter_path(), dtype, "cuda")
    drafter.use_fused_injection()
    torch.manual_seed(0)
    n, c, batch, capacity = 3, 7, 4, 64
    features = torch.randn(n, c, drafter.config.fc_in_features, device="cuda") * 2
    positions = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5, 6], [40, 41, 42, 43, 44, 45, 63]],
                             device="cuda")
    rows = torch.tensor([2, 0, 3], device="cuda")
    with torch.inference_mode():
        kv = drafter._kv_all(drafter.fuse(features)).contiguous()
        cos, sin = drafter.rotary(positions)
        want = drafter.new_cache(batch, capacity)
        want.buffer.normal_()
        before = want.buffer.clone()
        got = drafter.new_cache(batch, capacity)
        got.buffer.copy_(before)
        reference_inject(drafter, kv, cos, sin, want, rows, positions)
        torch.ops.dflash_trt.kv_inject(kv, drafter._k_norm_all, drafter.layers[0].self_attn.k_norm.eps,
                                       cos.contiguous(), sin.contiguous(), got.buffer, rows, positions)
        torch.cuda.synchronize()
    assert torch.equal(got.buffer[1], want.buffer[1])  # V copied exactly
    k, k_ref = got.buffer[0].float(), want.buffer[0].float()
    ulp = torch.finfo(dtype).eps * k_ref.abs().clamp_min(1.0)
    assert ((k - k_ref).abs() <= 2 * ulp).all()  # the mean of squares summed in another order
    assert (k != k_ref).float().mean() < 0.05
    untouched = torch.ones_like(before[0], dtype=torch.bool)
    for j, r in enumerate(rows.tolist()):
        untouched[:, r, :, positions[j]] = False
    assert torch.equal(got.buffer[:, untouched], before[:, untouched])


@needs_gpu
def test_a_position_outside_the_cache_stops_the_kernel():
    """A device-side assertion, in a process of its own (it poisons that process's CUDA context)."""
    code = (
        "import torch\n"
        "import dflash_trt.ops\n"
        "L, B, H, cap, D = 1, 1, 1, 8, 64\n"
        "cache = torch.zeros(2, L, B, H, cap, D, device='cuda')\n"
        "kv = torch.zeros(1, 1, 2 * D, device='cuda')\n"
        "cs = torch.zeros(1, 1, D, device='cuda')\n"
        "torch.ops.dflash_trt.kv_inject(kv, torch.ones(L, D, device='cuda'), 1e-6, cs, cs, cache,\n"
        "                               torch.tensor([0], device='cuda'), torch.tensor([[8]], device='cuda'))\n"
        "torch.cuda.synchronize()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "device-side assert" in proc.stderr or "position outside the cache" in proc.stderr, proc.stderr[-2000:]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_guarded_entry_point_skips_rows_and_positions_outside_the_cache(library, dtype):
    """`dflash_kv_inject_guarded`: a token whose row or position is outside the cache writes nothing (and raises no
    device-side assertion); the others are written exactly as `dflash_kv_inject` writes them, one token at a time."""
    torch.manual_seed(0)
    L, B, H, cap, D = 2, 2, 2, 8, 64
    n, c = 3, 3
    kv = torch.randn(n, c, L * 2 * H * D, device="cuda").to(dtype)
    k_norm = (torch.rand(L, D, device="cuda") + 0.5).to(dtype)
    cos, sin = torch.randn(n, c, D, device="cuda"), torch.randn(n, c, D, device="cuda")
    rows = torch.tensor([1, B, 0], device="cuda")  # sequence 1's row is outside the cache
    positions = torch.tensor([[0, cap, 3], [1, 2, 3], [-1, 7, 5]], device="cuda")
    before = torch.randn(2, L, B, H, cap, D, device="cuda").to(dtype)
    code, stream = cuda_ops.DTYPE_CODES[dtype], torch.cuda.current_stream().cuda_stream
    got = before.clone()
    assert guarded_entry_point(library)(code, kv.data_ptr(), k_norm.data_ptr(), 1e-6, cos.data_ptr(), sin.data_ptr(),
                                        got.data_ptr(), rows.data_ptr(), positions.data_ptr(), n, c, L, B, H, cap, D,
                                        stream) == 0
    want, written = before.clone(), torch.zeros_like(before[0], dtype=torch.bool)
    for i in range(n * c):  # the in-range tokens, each alone through the asserting entry point
        row, pos = rows[i // c].item(), positions.view(-1)[i].item()
        if not (0 <= row < B and 0 <= pos < cap):
            continue
        written[:, row, :, pos] = True
        assert library.dflash_kv_inject(
            code, kv.data_ptr() + i * kv.stride(1) * kv.element_size(), k_norm.data_ptr(), 1e-6,
            cos.data_ptr() + i * D * 4, sin.data_ptr() + i * D * 4, want.data_ptr(),
            rows.data_ptr() + (i // c) * 8, positions.data_ptr() + i * 8, 1, 1, L, B, H, cap, D, stream) == 0
    torch.cuda.synchronize()  # raises if a device-side assertion fired
    assert int(written.sum()) == 4 * L * H * D  # tokens (0, 0), (0, 2), (2, 1), (2, 2)
    assert torch.equal(got, want)
    assert not torch.equal(got[:, written], before[:, written])  # the in-range tokens were written
    assert torch.equal(got[:, ~written], before[:, ~written])  # nothing else, the skipped tokens' slots included


@needs_gpu
def test_dflash_with_the_kernel_keeps_the_target_output():
    from dflash_trt.api import load_pipeline
    from dflash_trt.runtime.sampling import SamplingParams

    prompts = ["def fibonacci(n):", "The three primary colors are", "Write a haiku about the sea."]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    fused = load_pipeline(device="cuda", cuda_kernels="on")
    assert fused.engine.proposer.drafter._kv_all is not None
    plain = load_pipeline(device="cuda")
    ids = [fused.encode(p) for p in prompts]
    ar = plain.engine.generate(ids, params, "ar")
    with_kernel = fused.engine.generate(ids, params, "dflash")
    without = plain.engine.generate(ids, params, "dflash")
    for a, f, p in zip(ar, with_kernel, without):
        assert f.token_ids == a.token_ids == p.token_ids
    tau = sum(r.metrics.acceptance_length for r in with_kernel) / len(with_kernel)
    assert tau > 1.2
