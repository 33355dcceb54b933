"""The packed CPU float32 linear kernel (dflash_trt/ops/csrc/packed_linear.cpp): values against a float64
reference, bit-identical rows whatever the row or thread count, clear errors, and a target whose
layers run through it decodes exactly as with torch's linears."""

import pytest
import torch

from dflash_trt.errors import ConfigError
from dflash_trt.ops import cpu_kernels_unavailable
from dflash_trt.ops.packed_linear import PackedLinear, pack_weight, resolve_cpu_kernels, use_packed_linears

pytestmark = pytest.mark.skipif(cpu_kernels_unavailable() is not None, reason=str(cpu_kernels_unavailable()))

# (out, in): the SmolLM2 shapes, the draft-vocab head, and ragged ones (out % 32 != 0, in % 8 != 0)
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (8192, 576), (50, 37), (7, 3), (33, 129)]


@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference(out_features, in_features, bias):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    layer = PackedLinear(w, b)
    for rows in (1, 2, 3, 8, 9, 17):
        x = torch.randn(rows, in_features, generator=g)
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        y = layer(x)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        # float32 rounding of in_features products of unit-variance values
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-6 * in_features ** 0.5 * 8)


@pytest.mark.parametrize("out_features,in_features", [(576, 576), (1536, 576), (33, 129), (7, 3)])
def test_rows_are_bit_identical_whatever_the_row_count(out_features, in_features):
    """Batch invariance: a row's output does not depend on which other rows share the call."""
    g = torch.Generator().manual_seed(1)
    layer = PackedLinear(torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g))
    x = torch.randn(40, in_features, generator=g)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
    for rows in (2, 3, 7, 8, 9, 16, 40):
        assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"
    assert torch.equal(layer(x[5:21]), alone[5:21])  # a block that starts mid-chunk
    assert torch.equal(layer(x.view(4, 10, in_features)).view(40, -1), alone)  # leading dims flatten


@pytest.mark.parametrize("kind", ["float32", "q4_1"])
def test_same_bits_with_one_and_two_threads(kind):
    from tests.ops.test_weight_formats import q4_1_weights

    g = torch.Generator().manual_seed(2)
    layer = PackedLinear(torch.randn(1536, 576, generator=g) if kind == "float32" else q4_1_weights(1536, 576, 6)[0])
    assert layer.format == kind
    x = torch.randn(5, 576, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        two = layer(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_pack_layout():
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    p = pack_weight(w)
    assert p.shape == (2, 3, 32)
    assert p[1, 2, 7].item() == w[39, 2].item() and p[0, 1, 5].item() == w[5, 1].item()
    assert torch.count_nonzero(p[1, :, 8:]) == 0  # rows past out_features are zero


def test_bad_inputs_name_the_problem():
    layer = PackedLinear(torch.randn(64, 16))
    with pytest.raises(RuntimeError, match="input has 15 features, the weight expects 16"):
        layer(torch.randn(2, 15))
    with pytest.raises(RuntimeError, match="float32 only"):
        layer(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(ConfigError, match="cpu_kernels must be auto, on or off"):
        resolve_cpu_kernels("yes", "cpu", torch.float32)
    with pytest.raises(ConfigError, match="--cpu-kernels on needs --device cpu and --dtype float32"):
        resolve_cpu_kernels("on", "cpu", torch.bfloat16)
    assert resolve_cpu_kernels("auto", "cpu", torch.bfloat16) is False
    assert resolve_cpu_kernels("auto", "cpu", torch.float32) is True
    assert resolve_cpu_kernels("off", "cpu", torch.float32) is False


def test_use_packed_linears_swaps_every_float32_linear():
    model = torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(40, 3)))
    x = torch.randn(4, 8)
    with torch.no_grad():
        ref = model(x)
        assert use_packed_linears(model) == 2
        assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-6)


def test_smollm2_pipeline_runs_packed_and_decodes_as_torch_linears(smollm2_pipeline):
    """The default pipeline (cpu_kernels auto, float32, CPU) runs every target and drafter linear packed; greedy
    output equals the same models with torch's linears, and dflash equals ar."""
    from dflash_trt.api import load_pipeline
    from dflash_trt.runtime.sampling import SamplingParams

    target = smollm2_pipeline.engine.target
    assert isinstance(target.model.layers[0].self_attn.q_proj, PackedLinear) and target.packed_head is not None
    assert isinstance(smollm2_pipeline.engine.proposer.drafter.fc, PackedLinear)
    plain = load_pipeline(dtype="float32", cpu_kernels="off")
    assert isinstance(plain.engine.target.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    prompts = [smollm2_pipeline.encode_chat(q) for q in
               ("Write a Python function that reverses a string.", "Name three colors.", "What is 12 times 7?")]
    params = SamplingParams(max_tokens=24)
    packed_ar = [r.token_ids for r in smollm2_pipeline.generate(prompts, params, mode="ar")]
    packed_dflash = [r.token_ids for r in smollm2_pipeline.generate(prompts, params, mode="dflash")]
    torch_ar = [r.token_ids for r in plain.generate(prompts, params, mode="ar")]
    assert packed_dflash == packed_ar
    assert packed_ar == torch_ar


def test_cli_cpu_kernels_on_where_they_cannot_run_is_a_one_line_error(monkeypatch, capsys):
    from tests.conftest import run_main

    code, _, err = run_main(monkeypatch, capsys, "generate", "--prompt", "hi", "--dtype", "bfloat16",
                            "--cpu-kernels", "on", "--max-tokens", "2")
    assert code == 1 and "Traceback" not in err
    assert err == "error: --cpu-kernels on needs --device cpu and --dtype float32 (got cpu, bfloat16); " \
                  "use --cpu-kernels auto or off\n"


def test_auto_says_why_it_falls_back(monkeypatch, capsys):
    import dflash_trt.ops.packed_linear as pl

    monkeypatch.setattr(pl, "cpu_kernels_unavailable", lambda: "the CPU kernels failed to build (OSError: x)")
    assert resolve_cpu_kernels("auto", "cpu", torch.float32) is False
    assert capsys.readouterr().err == "dflash-trt: running torch's linears: the CPU kernels failed to build (OSError: x)\n"
    with pytest.raises(ConfigError, match=r"--cpu-kernels on: the CPU kernels failed to build \(OSError: x\); or use"):
        resolve_cpu_kernels("on", "cpu", torch.float32)
