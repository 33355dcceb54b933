"""FP8 (W8A8) matmuls for ModelOpt FP8 targets, as TensorRT-LLM computes them.

A ModelOpt FP8 unified checkpoint stores, per quantized Linear `X` (see `dflash_trt.models.dequant`):
`X.weight` float8_e4m3fn [out, in], `X.weight_scale` float32 [] and the calibrated static
`X.input_scale` float32 []. With `fp8_matmul` on, the target keeps the FP8 weight and both scales
(`Fp8Linear`) and at every forward quantizes its input with `input_scale` (x / input_scale, clamped
to +-448, cast to float8_e4m3fn) and multiplies FP8 x FP8 with `torch._scaled_mm`, accumulating in
float32 and writing the model dtype: y = (x_q * input_scale) @ (w_q * weight_scale)^T (+ bias).
Off, the weights are dequantized on load and activations stay in the model dtype (W8A16-equivalent).

The switch (`resolve_fp8_matmul`), "auto" | "on" | "off":
- "auto" (default): on for an FP8 target on a CUDA device of compute capability >= 8.9 (Ada,
  Hopper, Blackwell: the GPUs with FP8 tensor cores), off everywhere else (CPU included).
- "on": FP8 matmuls, or a ConfigError when the target is not FP8 or the device has no FP8 matmul.
  On the CPU torch runs `_scaled_mm` too (a slow reference, not a fast path): that is how the
  tests check this path without a GPU.
- "off": dequantize on load.

What stays dequantized even with FP8 matmuls on: NVFP4 checkpoints (no FP4 path here); the
`lm_head` (its weight is shared with the drafter, and ModelOpt leaves it unquantized anyway);
Linears whose in or out features are not multiples of 16 (cuBLASLt's FP8 GEMM needs that; the
same rule applies on every device, so the CPU runs the same modules the GPU would); the drafter
(it is small, and its code reads `fc.weight` as a float tensor); FP8 KV-cache scales.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_trt.errors import CheckpointError, ConfigError

FP8_MATMUL_MODES = ("auto", "on", "off")
#: largest finite float8_e4m3fn value
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
#: compute capability from which CUDA has FP8 tensor-core matmuls (Ada Lovelace)
MIN_CUDA_CAPABILITY = (8, 9)
#: Linears never converted (their weight is read directly elsewhere)
KEEP_FLOAT = ("lm_head",)


class Fp8Linear(nn.Module):
    """A Linear with a per-tensor FP8 weight and a static per-tensor FP8 input scale (W8A8).

    Buffers keep the checkpoint's names, so a ModelOpt FP8 checkpoint loads into it by key:
    weight float8_e4m3fn [out, in]; weight_scale float32 []; input_scale float32 []; bias [out] in
    the model dtype (only when `bias`).

    forward(x): x [..., in] in the model dtype -> [..., out] in x.dtype. Leading dims are flattened
    (`_scaled_mm` takes 2-D operands; on CUDA in and out must be multiples of 16, rows need not be).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.empty((), dtype=torch.float32))
        self.register_buffer("input_scale", torch.empty((), dtype=torch.float32))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        x_q = quantize_fp8(flat, self.input_scale)
        # weight [out, in] row-major -> .t() is the column-major [in, out] operand _scaled_mm wants
        out = torch._scaled_mm(x_q, self.weight.t(), scale_a=self.input_scale, scale_b=self.weight_scale,
                               out_dtype=x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) / scale, clamped to +-448, as float8_e4m3fn (round to nearest); same shape.

    Computed in float32, as TensorRT-LLM's static per-tensor activation quantization.
    """
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_matmul_fits(in_features: int, out_features: int) -> bool:
    """Whether a Linear of this size can run `_scaled_mm` on CUDA (both sizes multiples of 16)."""
    return in_features % 16 == 0 and out_features % 16 == 0


def resolve_fp8_matmul(mode: str, algo: str | None, device: str | torch.device, where: str) -> bool:
    """Whether to run FP8 matmuls for a checkpoint of ModelOpt `algo` ("FP8", "NVFP4", None) on `device`.

    Args:
        mode: "auto", "on" or "off" (see the module docstring).
        where: names the checkpoint in error messages (e.g. "the target at /path").
    Raises:
        ConfigError: an unknown mode; "on" for a checkpoint that is not FP8, or on a device without FP8
            matmuls (a CUDA GPU below compute capability 8.9, or a device type other than cpu / cuda).
    """
    if mode not in FP8_MATMUL_MODES:
        raise ConfigError(f"fp8_matmul must be one of {', '.join(FP8_MATMUL_MODES)}, got {mode!r}")
    if mode == "off":
        return False
    device = torch.device(device)
    if mode == "auto":
        return algo == "FP8" and device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CUDA_CAPABILITY
    if algo != "FP8":
        kind = "unquantized" if algo is None else f"{algo}-quantized (dequantized on load)"
        raise ConfigError(f"--fp8-matmul on needs an FP8 checkpoint, but {where} is {kind}; use --fp8-matmul auto "
                          "or off (fp8_matmul='auto' / 'off' in Python), or build the bundle with --quant fp8")
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < MIN_CUDA_CAPABILITY:
            raise ConfigError(f"--fp8-matmul on: {torch.cuda.get_device_name(device)} has compute capability "
                              f"{cap[0]}.{cap[1]}; FP8 matmuls need 8.9 or newer (Ada, Hopper, Blackwell); use "
                              "--fp8-matmul auto or off (weights dequantized on load)")
    elif device.type != "cpu":
        raise ConfigError(f"--fp8-matmul on: no FP8 matmul on device {device}; use --fp8-matmul auto or off")
    return True


def fp8_linear_names(tensors: dict[str, torch.Tensor], model: nn.Module) -> list[str]:
    """Names of `model`'s nn.Linear modules to run in FP8: FP8 weight in `tensors`, sizes that fit
    (`fp8_matmul_fits`), not in KEEP_FLOAT.

    Raises:
        CheckpointError: such a Linear has no `input_scale` or `weight_scale` (W8A8 needs both).
    """
    names = []
    for name, module in model.named_modules():
        w = tensors.get(f"{name}.weight")
        if not isinstance(module, nn.Linear) or w is None or w.dtype != torch.float8_e4m3fn or name in KEEP_FLOAT:
            continue
        if not fp8_matmul_fits(module.in_features, module.out_features):
            continue
        for suffix in (".weight_scale", ".input_scale"):
            if f"{name}{suffix}" not in tensors:
                raise CheckpointError(f"FP8 weight {name}.weight has no {name}{suffix}, which FP8 matmuls need; "
                                      "use --fp8-matmul off (weights dequantized on load) or rebuild the bundle")
        names.append(name)
    return names


def use_fp8_linears(model: nn.Module, names: list[str], dtype: torch.dtype) -> None:
    """Replace the nn.Linear modules `names` of `model` (e.g. built on the meta device) by empty
    Fp8Linear modules of the same size, on the same device; `loading.load_strict` then fills them."""
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        with torch.device(old.weight.device):
            setattr(parent, attr, Fp8Linear(old.in_features, old.out_features, old.bias is not None, dtype))
