"""Panel-packed float32 linear layers for the CPU: the few-row products of speculative decoding.

A DFlash step multiplies every target weight by 2-16 rows (the verify pass) and every drafter weight
by a 16-position block; an autoregressive step by 1 row. All of these are limited by reading the
weights from memory, but torch's CPU BLAS (MKL, float32) is 1.3-2x slower for 2-16 rows than for 1
(measured on the 2-core dev machines; docs/kernels.md). `torch.ops.dflash_trt.packed_linear`
(`csrc/packed_linear.cpp`, AVX-512) reads a weight packed as panels of 32 outputs once per call at
any row count, and computes each output with one fixed summation order, so its results are
bit-identical whatever the number of rows or threads: a verify pass gives exactly the logits a
one-token decode would (batch invariance).

`use_packed_linears` swaps a model's `nn.Linear`s (and a target's lm_head) for `PackedLinear`s, in
place, for inference only (no gradients; state_dict keys change from `weight` to `packed`).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from dflash_trt.errors import ConfigError
from dflash_trt.ops import cpu_kernels_unavailable, require_cpu_kernels

PANEL = 32  # outputs per panel (csrc/packed_linear.cpp kPanel)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear weight [N, K] -> packed [ceil(N / 32), K, 32] float32 (contiguous, rows past N zero):
    packed[p, k, j] = weight[32 p + j, k]."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.float32, device=weight.device)
    padded[:n] = weight.detach()
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


class PackedLinear(nn.Module):
    """y = x @ W^T + b over a panel-packed W; x [..., in_features] float32 (CPU) -> [..., out_features].

    Raises:
        ConfigError (construction): the CPU op library cannot run here (names why).
        RuntimeError (forward, from the op): a non-float32 input or a wrong in_features, named.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        require_cpu_kernels()
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", pack_weight(weight))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dflash_trt.packed_linear(x, self.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


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


def use_packed_linears(model: nn.Module) -> int:
    """Replace every float32 `nn.Linear` of `model` by a `PackedLinear` (same outputs up to float32
    rounding), in place; returns how many were replaced. Inference only."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32:
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                swapped += 1
    return swapped
