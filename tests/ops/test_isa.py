"""Which build of the CPU op library a CPU gets (dflash_trt.ops.cpu_isa): AVX-512, AVX2 with F16C, or
none with a reason that names what is missing."""

import pytest
import torch

import dflash_trt.ops as ops


@pytest.fixture
def cpu(monkeypatch):
    """Set torch's reported capability and the /proc/cpuinfo flags; cpu_isa's cache is cleared around."""

    def fake(capability: str, flags: set[str]):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(ops, "_cpu_flags", lambda: flags)
        ops.cpu_isa.cache_clear()

    yield fake
    ops.cpu_isa.cache_clear()


@pytest.mark.parametrize("capability,flags,isa", [
    ("AVX512", {"avx512f", "f16c"}, "avx512"),
    ("AVX2", {"avx2", "fma", "f16c"}, "avx2"),
    ("AVX2", {"avx2", "fma"}, None),  # no F16C: the float16 scales cannot be converted
    ("DEFAULT", {"sse4_2"}, None),
])
def test_isa_by_capability_and_flags(cpu, capability, flags, isa):
    cpu(capability, flags)
    assert ops.cpu_isa() == isa
    if isa is not None:
        assert ops.ISA_CFLAGS[isa][1] == ("-mavx512f" if isa == "avx512" else "-mavx2")


def test_no_isa_names_what_is_missing(cpu, monkeypatch):
    monkeypatch.setattr(ops, "_load_cpu_library", lambda: pytest.fail("must not build without a usable ISA"))
    cpu("AVX2", {"avx2", "fma"})
    assert ops.cpu_kernels_unavailable() == (
        "the CPU kernels need AVX-512, or AVX2 with FMA and F16C (torch reports AVX2 on this CPU)")


def test_build_key_depends_on_the_isa(cpu):
    cpu("AVX512", set())
    k512 = ops._build_key()
    cpu("AVX2", {"f16c"})
    assert ops._build_key() != k512  # an AVX-512 build is never loaded on an AVX2 CPU (shared cache folder)



def test_no_compiler_is_named_before_building(monkeypatch, tmp_path):
    """Without a C++ compiler the reason says so in one line (torch's builder printed a long warning and
    then 'ninja: build stopped'); nothing is built or left in the cache."""
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    ops._load_cpu_library.cache_clear()
    try:
        assert ops._load_cpu_library() == ("building the CPU kernels needs a C++ compiler, and `no-such-c++-compiler` "
                                           "is not on PATH: install g++ (e.g. apt install g++) or set CXX")
    finally:
        ops._load_cpu_library.cache_clear()
    assert not (tmp_path / "cache" / "ops").exists() or not any((tmp_path / "cache" / "ops").iterdir())
