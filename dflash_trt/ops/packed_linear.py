"""Panel-packed float32 linear layers for the CPU: the few-row products of speculative decoding.

A DFlash step multiplies every target weight by 2-16 rows (the verify pass) and every drafter weight
by a 16-position block; an autoregressive step by 1 row. All of these are limited by reading the
weights from memory, but torch's CPU BLAS (MKL, float32) is 1.3-2x slower for 2-16 rows than for 1
(measured on the 2-core dev machines; docs/kernels.md). `torch.ops.dflash_trt.packed_linear`
(`csrc/packed_linear.cpp`, AVX-512 or AVX2) reads a weight packed as panels of 32 outputs once per call at
any row count, and computes each output with one fixed summation order, so its results are
bit-identical whatever the number of rows or threads: a verify pass gives exactly the logits a
one-token decode would (batch invariance).

Each weight is stored in the smallest format that holds its float32 values EXACTLY (`pack_exact`):
GGUF Q4_1 or Q8_0 blocks (a model converted from a GGUF file, like the embedded SmolLM2: 0.625 and
1.06 bytes per weight), bfloat16 (a bf16 checkpoint, like the shipped drafter, run in float32: 2
bytes), else float32. The kernel rebuilds the exact float32 weights in registers (up to 16 rows) or
in a cache-resident panel buffer (a prefill) and multiplies exactly as the float32 format does, so
the output is the same bit for bit while up to 6.4x fewer bytes are read.

`use_packed_linears` swaps a model's `nn.Linear`s (and a target's lm_head) for `PackedLinear`s, in
place, for inference only (no gradients; state_dict keys change from `weight` to `packed`, `scales`).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from dflash_trt.errors import ConfigError
from dflash_trt.ops import cpu_kernels_unavailable, require_cpu_kernels

PANEL = 32  # outputs per panel (csrc/packed_linear.cpp kPanel)
BLOCK = 32  # inputs per GGUF quantization block (Q8_0, Q4_1)
#: the weight formats of the packed kernel, smallest first: `PackedLinear` stores each weight in the
#: first one that holds it EXACTLY (bytes per weight: 0.625, 1.0625, 2, 4), so results never change.
FORMATS = ("q4_1", "q8_0", "bfloat16", "float32")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear weight [N, K] -> packed [ceil(N / 32), K, 32] float32 (contiguous, rows past N zero):
    packed[p, k, j] = weight[32 p + j, k]."""
    return _panels(weight.detach().float())


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [ceil(N / 32), C, 32] (rows past N zero), keeping the dtype."""
    n, c = t.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, c, dtype=t.dtype, device=t.device)
    padded[:n] = t
    return padded.view(panels, PANEL, c).transpose(1, 2).contiguous()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def pack_exact(weight: torch.Tensor,
               formats: tuple[str, ...] = FORMATS) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """A weight [N, K] in the first of `formats` that holds its float32 values exactly (checked value by
    value, bit for bit): q4_1 / q8_0 (GGUF blocks of 32 inputs along K, e.g. a model converted from a
    GGUF file; found by csrc/pack_gguf.cpp), bfloat16 (a bf16 checkpoint loaded in float32), else
    float32, which is always possible. Needs the CPU op library (`require_cpu_kernels`).

    Returns:
        (format, packed, scales): packed [ceil(N / 32), K, 32] (16 uint8 for q4_1), scales float16 or None;
        the layouts are in csrc/packed_linear.cpp.
    """
    w = weight.detach().float().contiguous()
    k = w.shape[1]
    for fmt in formats:
        if fmt in ("q4_1", "q8_0") and k % BLOCK == 0:
            got = getattr(torch.ops.dflash_trt, f"pack_{fmt}")(w)  # csrc/pack_gguf.cpp; [] when not exact
            if got:
                return fmt, got[0], got[1]
        elif fmt == "bfloat16" and _same_bits(w.bfloat16().float(), w):
            return fmt, _panels(w.bfloat16()), None
        elif fmt == "float32":
            return fmt, _panels(w), None
    raise ConfigError(f"no exact format among {formats} for this weight; add 'float32'")


class PackedLinear(nn.Module):
    """y = x @ W^T + b over a panel-packed W; x [..., in_features] float32 (CPU) -> [..., out_features].

    W is stored in the smallest of `formats` that holds it exactly (`pack_exact`), so the output is
    bit for bit the float32 format's whatever the format; `format` says which was chosen.

    Raises:
        ConfigError (construction): the CPU op library cannot run here (names why).
        RuntimeError (forward, from the op): a non-float32 input or a wrong in_features, named.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, formats: tuple[str, ...] = FORMATS):
        require_cpu_kernels()
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.format, packed, scales = pack_exact(weight, formats)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dflash_trt.packed_linear(x, self.packed, self.scales, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.format}")


def resolve_cpu_kernels(mode: str, device: str, dtype: torch.dtype) -> bool:
    """Whether to run the packed CPU kernels: `mode` "auto" (when the models run in float32 on the
    CPU and the kernels build here), "on" (the same, else an error), or "off".

    Raises:
        ConfigError: mode "on" where the kernels cannot run (names why), or an unknown mode.
    """
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"cpu_kernels must be auto, on or off, got {mode!r}")
    if mode == "off":
        return False
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        if mode == "on":
            raise ConfigError(f"--cpu-kernels on needs --device cpu and --dtype float32 (got {device}, "
                              f"{str(dtype).removeprefix('torch.')}); use --cpu-kernels auto or off")
        return False
    why = cpu_kernels_unavailable()
    if why is not None:
        if mode == "on":
            raise ConfigError(f"--cpu-kernels on: {why}; or use --cpu-kernels off")
        print(f"dflash-trt: running torch's linears: {why}", file=sys.stderr)
        return False
    return True


def use_packed_linears(model: nn.Module, formats: tuple[str, ...] = FORMATS) -> int:
    """Replace every float32 `nn.Linear` of `model` by a `PackedLinear` (same outputs up to float32
    rounding; each weight in the smallest exact one of `formats`), in place; returns how many were
    replaced. Inference only."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32:
                setattr(parent, name, PackedLinear(child.weight, child.bias, formats))
                swapped += 1
    return swapped
