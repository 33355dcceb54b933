"""An FP8 bundle in our runtime with FP8 (W8A8) matmuls: the target's quantized Linears become Fp8Linear
(`torch._scaled_mm`, here on the CPU), DFlash stays lossless against AR of the same W8A8 target, and its
logits stay close to the dequantize-on-load (W8A16) path. The fp8_matmul switch: "auto" on the CPU
dequantizes; "on" for a target that is not FP8 is one clear error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash_trt.models.fp8 import Fp8Linear, quantize_fp8
from build_helpers import assert_greedy_dflash_equals_ar, prompt_logits

from tests.conftest import run_main


def fp8_modules(pipe) -> list[str]:
    return [name for name, m in pipe.engine.target.named_modules() if isinstance(m, Fp8Linear)]


@pytest.fixture(scope="module")
def fp8_pipes(tiny_bundle_fp8_tp3):
    from dflash_trt.api import load_bundle

    return load_bundle(tiny_bundle_fp8_tp3, fp8_matmul="on"), load_bundle(tiny_bundle_fp8_tp3, fp8_matmul="off")


def test_fp8_matmul_on_is_lossless_and_close_to_the_dequantized_target(fp8_pipes):

    on, off = fp8_pipes
    names = fp8_modules(on)
    assert len(names) == 4 * 7  # q, k, v, o, gate, up, down of 4 layers; lm_head stays float
    assert "lm_head" not in names and isinstance(on.engine.target.lm_head, nn.Linear)
    layer = on.engine.target.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.input_scale.dtype == torch.float32
    assert layer.input_scale.item() > 0 and layer.weight_scale.item() > 0
    assert fp8_modules(off) == []

    # a flip where 1-token and multi-token FP8 matmuls differ moved a logit by up to 0.077 (measured); a quarter
    # of the AR positions of this random tiny model have a top-2 gap < 0.1, so a real bug still shows
    prompts = assert_greedy_dflash_equals_ar(on, near_tie=0.1)

    ids = prompts[1]
    a, b = prompt_logits(on, ids), prompt_logits(off, ids)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"W8A8 vs W8A16 logits over {len(ids)} positions: cosine mean {cos.mean():.5f} min {cos.min():.5f}, "
          f"top-1 agreement {top1:.3f}")
    # activation quantization costs a little (SmolLM2 fake-quant W8A8, docs/build.md: cosine 0.986 mean); the
    # random tiny model has many near-tied top logits, so top-1 agreement is only a sanity bound here
    assert cos.mean() > 0.98 and cos.min() > 0.9 and top1 > 0.5

    # the whole W8A8 target == the dequantized target with each FP8 Linear's input quantize-dequantized
    scales = {name: on.engine.target.get_submodule(name).input_scale for name in names}
    hooks = [off.engine.target.get_submodule(name).register_forward_pre_hook(
        lambda _m, args, s=s: (quantize_fp8(args[0], s).float().mul(s).to(args[0].dtype),)) for name, s in scales.items()]
    try:
        ref = prompt_logits(off, ids)
    finally:
        for h in hooks:
            h.remove()
    # float32 accumulation order is the CPU's (oneDNN picks AMX on Sapphire Rapids, AVX-512 elsewhere): up to
    # 2.3e-4 apart there (measured), 1e-4 elsewhere; a wrong scale or rounding moves logits by ~1e-1
    torch.testing.assert_close(a, ref, rtol=1e-4, atol=5e-4)


def test_auto_on_the_cpu_dequantizes(tiny_bundle_fp8_tp3):
    from dflash_trt.api import load_bundle

    pipe = load_bundle(tiny_bundle_fp8_tp3, load_drafter_model=False, cpu_kernels="off")  # fp8_matmul="auto"
    assert fp8_modules(pipe) == []
    assert pipe.engine.target.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    packed = load_bundle(tiny_bundle_fp8_tp3, load_drafter_model=False)  # and so the CPU kernel can pack it
    assert packed.engine.target.model.layers[0].mlp.down_proj.packed.dtype == torch.float32


def test_on_for_a_target_that_is_not_fp8_is_a_clear_error(monkeypatch, capsys, tiny_pair):
    from dflash_trt.api import load_pipeline
    from dflash_trt.errors import ConfigError

    target, drafter = tiny_pair
    with pytest.raises(ConfigError, match=f"needs an FP8 checkpoint, but the target at {target} is unquantized; "
                                          "use --fp8-matmul auto or off"):
        load_pipeline(target, drafter, fp8_matmul="on")
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(target), "--drafter", str(drafter),
                            "--prompt", "hi", "--fp8-matmul", "on")
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"error: --fp8-matmul on needs an FP8 checkpoint, but the target at {target} is unquantized")


def test_fp8_matmuls_are_not_split_under_tensor_parallelism(tiny_bundle_fp8_tp3):
    """`shard_target` splits nn.Linear layers only: under tp_size > 1, "on" is one clear error before any weight
    loads (it was a NotImplementedError for float8 from every rank's shard_target), and "auto", FP8 matmuls on an
    FP8 GPU, dequantizes as on a CPU."""
    from dflash_trt.api import load_pipeline
    from dflash_trt.errors import ConfigError
    from dflash_trt.runtime.tensor_parallel import tp_fp8_matmul

    target, drafter = tiny_bundle_fp8_tp3 / "trtllm" / "target", tiny_bundle_fp8_tp3 / "trtllm" / "drafter"
    with pytest.raises(ConfigError, match=r"--fp8-matmul on with --tp-size 3: FP8 \(W8A8\) layers are not split over "
                                          r"ranks; use --fp8-matmul auto or off"):
        load_pipeline(target, drafter, tp_size=3, fp8_matmul="on")
    assert [tp_fp8_matmul(mode, 3) for mode in ("auto", "off")] == ["off", "off"]
