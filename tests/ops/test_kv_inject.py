"""The fused KV-injection op (csrc/kv_inject.cpp) against the PyTorch reference (DFlashDrafter.context_kv +
KVCache.write) on the shipped drafter: same cache contents, same drafts end to end, clear errors."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.ops import cpu_kernels_unavailable

pytestmark = pytest.mark.skipif(cpu_kernels_unavailable() is not None, reason=str(cpu_kernels_unavailable()))


@pytest.fixture(scope="module")
def drafters():
    """(reference drafter, fused drafter): the default drafter loaded twice in float32, both with packed
    linears (as the runtime runs them: the fused op's product then gives k_proj's and v_proj's bits)."""
    from dflash_trt.models.checkpoints import load_drafter
    from dflash_trt.models.default import default_drafter_path
    from dflash_trt.ops.packed_linear import use_packed_linears

    ref = load_drafter(default_drafter_path(), torch.float32, "cpu")
    use_packed_linears(ref)
    fused = load_drafter(default_drafter_path(), torch.float32, "cpu")
    fused.use_fused_injection()
    use_packed_linears(fused)
    return ref, fused


def inject(drafter, features, positions, rows, batch=4, capacity=64):
    cache = drafter.new_cache(batch, capacity)
    cache.buffer.normal_()  # stale values elsewhere must stay untouched
    before = cache.buffer.clone()
    drafter.inject_context(features, positions, cache, rows)
    return before, cache.buffer


def test_fused_injection_writes_what_the_reference_writes(drafters):
    ref, fused = drafters
    torch.manual_seed(0)
    n, c = 3, 7
    features = torch.randn(n, c, ref.config.fc_in_features) * 2
    positions = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5, 6], [40, 41, 42, 43, 44, 45, 63]])
    rows = torch.tensor([2, 0, 3])
    torch.manual_seed(1)
    before, want = inject(ref, features, positions, rows)
    torch.manual_seed(1)
    before_f, got = inject(fused, features, positions, rows)
    assert torch.equal(before, before_f)
    k, v = got[0], got[1]
    assert torch.equal(v, want[1])  # V: copied exactly
    torch.testing.assert_close(k, want[0], rtol=1e-6, atol=1e-6)  # K: k_norm's mean summed in double
    written = torch.zeros_like(before[0], dtype=torch.bool)  # [L, B, H, cap, D]
    for j, r in enumerate(rows.tolist()):
        written[:, r, :, positions[j]] = True
    assert torch.equal(got[:, ~written], before[:, ~written])  # nothing else moved
    assert (k[written] != before[0][written]).float().mean() > 0.99


def test_all_rows_by_default(drafters):
    ref, fused = drafters
    features = torch.randn(4, 3, ref.config.fc_in_features)
    positions = torch.arange(3).expand(4, 3).contiguous()
    torch.manual_seed(2)
    _, want = inject(ref, features, positions, None)
    torch.manual_seed(2)
    _, got = inject(fused, features, positions, None)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_bad_arguments_are_named(drafters):
    _, fused = drafters
    cache = fused.new_cache(2, 8)
    kv = torch.zeros(1, 1, fused._kv_all.out_features)
    cos = sin = torch.zeros(1, 1, fused.config.head_dim)
    norm = fused._k_norm_all
    op = torch.ops.dflash_trt.kv_inject
    with pytest.raises(IndexError, match="position 8 outside the cache's capacity 8"):
        op(kv, norm, 1e-6, cos, sin, cache.buffer, torch.tensor([0]), torch.tensor([[8]]))
    with pytest.raises(IndexError, match="row 2 outside the cache's 2 rows"):
        op(kv, norm, 1e-6, cos, sin, cache.buffer, torch.tensor([2]), torch.tensor([[0]]))
    with pytest.raises(RuntimeError, match="must be float32"):
        op(kv.double(), norm, 1e-6, cos, sin, cache.buffer, torch.tensor([0]), torch.tensor([[0]]))
    with pytest.raises(RuntimeError, match=r"kv must be \[n, c, L \* 2 \* H \* D\]"):
        op(kv[..., :-1], norm, 1e-6, cos, sin, cache.buffer, torch.tensor([0]), torch.tensor([[0]]))


def small_args(device="cpu"):
    """A valid small call of the op (2 layers, 3 cache rows, 2 KV heads, capacity 8, head_dim 4; 2 x 3 tokens)."""
    L, B, H, cap, D, n, c = 2, 3, 2, 8, 4, 2, 3
    gen = torch.Generator().manual_seed(0)
    args = dict(kv=torch.randn(n, c, L * 2 * H * D, generator=gen), k_norm=torch.rand(L, D, generator=gen) + 0.5,
                eps=1e-6, cos=torch.randn(n, c, D, generator=gen), sin=torch.randn(n, c, D, generator=gen),
                cache=torch.zeros(2, L, B, H, cap, D), rows=torch.tensor([2, 0]),
                positions=torch.tensor([[1, 2, 3], [5, 6, 7]]))
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in args.items()}


def test_bad_tensors_are_named_and_nothing_is_written():
    """A tensor of the wrong dtype or layout was refused with one message for all of them ("kv, k_norm, cos, sin
    and cache must be float32", "every tensor must be contiguous"): now the message names the tensor, and a
    row or position outside the cache names its index. Every check comes before the first write."""
    good = small_args()
    op = torch.ops.dflash_trt.kv_inject
    cases = [("kv", good["kv"].half(), "kv must be float32, got Half"),
             ("k_norm", good["k_norm"].double(), "k_norm must be float32, got Double"),
             ("sin", good["sin"].bfloat16(), "sin must be float32, got BFloat16"),
             ("cache", good["cache"].bfloat16(), "cache must be float32, got BFloat16"),
             ("positions", good["positions"].int(), "positions must be int64, got Int"),
             ("rows", good["rows"].float(), "rows must be int64, got Float"),
             ("kv", good["kv"].transpose(0, 1).contiguous().transpose(0, 1),
              r"kv must be contiguous \(call .contiguous\(\) on it\), got strides \[32, 64, 1\] for sizes \[2, 3, 32\]"),
             ("cos", good["cos"].transpose(0, 1).contiguous().transpose(0, 1), "cos must be contiguous"),
             ("positions", good["positions"].t().contiguous().t(), "positions must be contiguous"),
             ("cache", torch.zeros(2, 2, 3, 8, 2, 4).transpose(3, 4),
              r"cache must be contiguous \(it is written in place: allocate it so\)")]
    for name, value, message in cases:
        args = {**small_args(), name: value}
        with pytest.raises(RuntimeError, match=f"^kv_inject: {message}"):
            op(**args)
        assert args["cache"].count_nonzero() == 0
    for name, index, value, message in [("rows", (1,), 3, r"rows\[1\]: row 3 outside the cache's 3 rows"),
                                        ("rows", (0,), -1, r"rows\[0\]: row -1 outside"),
                                        ("positions", (1, 2), 8, r"positions\[1, 2\]: position 8 outside the cache's "
                                         "capacity 8"),
                                        ("positions", (0, 1), -1, r"positions\[0, 1\]: position -1 outside")]:
        args = small_args()
        args[name][index] = value
        with pytest.raises(IndexError, match=f"^kv_inject: {message}"):
            op(**args)
        assert args["cache"].count_nonzero() == 0  # the tokens before the bad one were not written either


def test_meta_tensors_check_shapes_and_write_nothing():
    """The op had no kernel for meta tensors ("there was no fake impl or Meta kernel registered"): now its fake
    kernel makes the CUDA kernel's argument checks (naming the tensor) and returns, as a meta tensor has no data;
    a meta tensor mixed with CPU ones is refused by name."""
    op = torch.ops.dflash_trt.kv_inject
    args = small_args("meta")
    assert op(**args) is None and args["cache"].is_meta
    with pytest.raises(RuntimeError, match=r"^kv_inject: kv must be \[2, 3, 32\], got \[2, 3, 31\]"):
        op(**{**args, "kv": torch.zeros(2, 3, 31, device="meta")})
    with pytest.raises(RuntimeError, match=r"^kv_inject: head_dim must be even for RoPE, got 3"):
        op(**{**args, "cache": torch.zeros(2, 2, 3, 2, 8, 3, device="meta")})
    with pytest.raises(RuntimeError, match="^kv_inject: positions must be torch.int64, got torch.int32"):
        op(**{**args, "positions": args["positions"].int()})
    cpu = small_args()
    with pytest.raises(RuntimeError, match="^kv_inject: kv is on cpu, the cache on meta"):
        op(**{**cpu, "cache": cpu["cache"].to("meta")})
    with pytest.raises(RuntimeError, match="^kv_inject: rows is on meta, the cache on cpu"):
        op(**{**cpu, "rows": cpu["rows"].to("meta")})
    assert cpu["cache"].count_nonzero() == 0


def test_fake_cpu_tensors_take_the_cpu_kernels_dtypes():
    """Under FakeTensorMode (torch.compile's tracing) CPU tensors are checked as the CPU kernel takes them:
    float32 passes, bfloat16 (which the CUDA kernel takes) is refused as csrc/kv_inject.cpp refuses it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.dflash_trt.kv_inject
    real = small_args()
    with FakeTensorMode() as mode:
        args = {k: mode.from_tensor(v) for k, v in real.items() if isinstance(v, torch.Tensor)}
        args = {**real, **args}
        assert args["cache"].device.type == "cpu" and op(**args) is None
        half = {**args, **{k: args[k].bfloat16() for k in ("kv", "k_norm", "cache")}}
        with pytest.raises(RuntimeError, match="^kv_inject: kv, k_norm and cache must share one dtype of float32, "
                                               "got torch.bfloat16"):
            op(**half)
    with pytest.raises(RuntimeError, match="^kv_inject: kv must be float32, got BFloat16"):  # the real kernel's
        op(**{**real, **{k: real[k].bfloat16() for k in ("kv", "k_norm", "cache")}})


#: run in a fresh process: `import dflash_trt.ops`, then the op on CPU tensors with no require_cpu_kernels() before it
DIRECT_CALL = """
import torch

import dflash_trt.ops

torch.manual_seed(0)
L, B, H, cap, D, n, c, eps = 2, 3, 2, 8, 4, 1, 2, 1e-6
kv, w = torch.randn(n, c, L * 2 * H * D), torch.rand(L, D) + 0.5
cos, sin = torch.randn(n, c, D), torch.randn(n, c, D)
cache, rows, positions = torch.zeros(2, L, B, H, cap, D), torch.tensor([1]), torch.tensor([[5, 2]])
torch.ops.dflash_trt.kv_inject(kv, w, eps, cos, sin, cache, rows, positions)

x = kv.view(n, c, L, 2, H, D)  # the reference: k_norm (RMSNorm over D), then RoPE (rotate-half) on K; V as it is
k, v = x[:, :, :, 0], x[:, :, :, 1]
k = k / torch.sqrt(k.double().pow(2).mean(-1, keepdim=True).float() + eps) * w[:, None]
k = k * cos[:, :, None, None] + torch.cat([-k[..., D // 2:], k[..., :D // 2]], -1) * sin[:, :, None, None]
want = torch.zeros_like(cache)
for t, p in enumerate(positions[0].tolist()):
    want[0, :, 1, :, p], want[1, :, 1, :, p] = k[0, t], v[0, t]
assert torch.equal(cache[1], want[1]) and cache[1].count_nonzero() == L * H * c * D
torch.testing.assert_close(cache[0], want[0], rtol=1e-6, atol=1e-6)
print("kv_inject ok")
"""


def test_the_op_runs_before_require_cpu_kernels():
    """`import dflash_trt.ops` registers kv_inject's schema, but its CPU kernel came only with the library that
    require_cpu_kernels() loads: a direct call before it failed with torch's "Could not run 'dflash_trt::kv_inject'
    with arguments from the 'CPU' backend". Now the op's CPU kernel loads the library itself and the call writes what
    the reference writes."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", DIRECT_CALL], capture_output=True, text=True, check=False)
    assert res.returncode == 0 and res.stdout == "kv_inject ok\n", res.stderr[-3000:]


@pytest.mark.slow
def test_same_drafts_end_to_end(smollm2_pipeline):
    """The test pipeline runs the CPU kernels, so its drafter injects with the fused op; the reference path
    (`_kv_all` None) gives the same tokens and the same acceptance on real prompts."""
    from dflash_trt.runtime.sampling import SamplingParams

    pipe = smollm2_pipeline
    drafter = pipe.engine.proposer.drafter
    assert drafter._kv_all is not None
    prompts = [pipe.encode_chat("Write a Python function that reverses a string."), pipe.encode("def is_prime(n):")]
    params = SamplingParams(max_tokens=48)
    fused = pipe.generate(prompts, params)
    saved = drafter._kv_all
    try:
        drafter._kv_all = None  # the reference path: context_kv + a cache write per layer
        ref = pipe.generate(prompts, params)
    finally:
        drafter._kv_all = saved
    ar = pipe.generate(prompts, params, mode="ar")
    for f, r, a in zip(fused, ref, ar):
        assert f.token_ids == r.token_ids == a.token_ids
        assert f.metrics.accepted_per_position == r.metrics.accepted_per_position
