"""Read ModelOpt unified HF checkpoints (FP8, NVFP4) and MXFP4 ones (gpt-oss) back into plain floating-point tensors.

By default on the CPU a quantized bundle is dequantized once at load time into the model dtype: the
weights the runtime multiplies with are exactly the values the quantized checkpoint encodes (what
TensorRT-LLM's kernels read), while activations stay in the model dtype (TensorRT-LLM also quantizes
activations with `input_scale`: W8A8 / W4A4 there, W8A16 / W4A16-equivalent here). An FP8 target can
instead keep its FP8 weights and run W8A8 FP8 matmuls (`dflash_trt.models.fp8`, `fp8_matmul`: by
default on CUDA GPUs of compute capability >= 8.9; on the CPU only when asked, as a slow reference).
NVFP4 is always dequantized here.

Tensor layout written by `modelopt.torch.export.export_hf_checkpoint` (ModelOpt 0.47), per Linear `X`:
- FP8:   `X.weight` float8_e4m3fn [out, in]; `X.weight_scale` float32 [] (per tensor);
         `X.input_scale` float32 []. Value = weight.float() * weight_scale.
- NVFP4: `X.weight` uint8 [out, in / 2], two E2M1 codes per byte (low nibble = even column);
         `X.weight_scale` float8_e4m3fn [out, in / 16] (per block of 16); `X.weight_scale_2` float32 []
         (global); `X.input_scale` float32 []. Value = e2m1(code) * weight_scale.float() * weight_scale_2.
- KV cache (FP8): `X.k_scale` / `X.v_scale` float32 [] on attention modules (not needed on CPU).

MXFP4 (OCP Microscaling FP4; openai/gpt-oss-20b's experts, config.json `quantization_config.quant_method`
"mxfp4", read by transformers' integrations/mxfp4.py), per fused expert tensor `X` (gate_up_proj, down_proj,
[E, in, out] as the model holds it): `X_blocks` uint8 [E, out, in / 32, 16], two E2M1 codes per byte (low nibble
= even element), groups of 32 along `in`; `X_scales` uint8 [E, out, in / 32], E8M0 exponents (bias 127).
Value = e2m1(code) * 2^(scale - 127), then [E, out, in] -> [E, in, out]. Everything else (attention, router,
embeddings, the expert biases: `modules_to_not_convert`) is stored unquantized. Dequantized once on load, to the
compute dtype; never written.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_trt.errors import CheckpointError

#: E2M1 code (sign bit 3, magnitude bits 0-2) -> value
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
#: suffixes of auxiliary scale tensors that are consumed (or not needed) when dequantizing
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale", ".output_scale")


def quant_algo(folder: str | Path) -> str | None:
    """The ModelOpt `quant_algo` of a checkpoint folder ("FP8", "NVFP4", ...) or None when unquantized.

    Read from config.json `quantization_config.quant_algo` (or hf_quant_config.json); "MXFP4" for a
    `quant_method: "mxfp4"` checkpoint (gpt-oss; not ModelOpt's).
    """
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    q = cfg.get("quantization_config") or {}
    algo = q.get("quant_algo")
    if algo is None and str(q.get("quant_method", "")).lower() == "mxfp4":
        return "MXFP4"
    if algo is None and (folder / "hf_quant_config.json").is_file():
        algo = json.loads((folder / "hf_quant_config.json").read_text()).get("quantization", {}).get("quant_algo")
    return algo


def unpack_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4 -> float. packed uint8 [out, in/2], block_scale float8_e4m3fn [out, in/16], global_scale [] ->
    [out, in] in `dtype`.

    Raises:
        CheckpointError: shapes do not fit (in must be a multiple of 16).
    """
    if packed.dtype != torch.uint8:
        raise CheckpointError(f"NVFP4 weight must be uint8 (packed E2M1 pairs), got {packed.dtype}")
    out, half = packed.shape
    cols = half * 2
    if block_scale.shape != (out, cols // 16):
        raise CheckpointError(f"NVFP4 block scale has shape {list(block_scale.shape)}, expected {[out, cols // 16]}")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(out, cols).long()
    values = E2M1_VALUES[codes].view(out, cols // 16, 16)
    scale = block_scale.float() * global_scale.float()
    return (values * scale[..., None]).reshape(out, cols).to(dtype)


#: the suffixes of an MXFP4 tensor's codes and exponents (`X_blocks`, `X_scales` -> `X`)
MXFP4_SUFFIXES = ("_blocks", "_scales")


def unpack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 -> float: blocks uint8 [E, out, G, 16], scales uint8 [E, out, G] (see the module docstring) ->
    [E, G * 32, out] in `dtype` (the fused expert layout, transposed as transformers' `convert_moe_packed_tensors`
    does). Exact in float32 and bfloat16 for the exponents real checkpoints hold.

    Raises:
        CheckpointError: dtypes or shapes that do not fit (named).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be uint8 (packed E2M1 pairs, E8M0 exponents), got "
                              f"{blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(f"MXFP4 blocks of shape {list(blocks.shape)} and scales of shape {list(scales.shape)} "
                              "do not fit: blocks [experts, out, groups, 16], scales [experts, out, groups]")
    table = E2M1_VALUES.to(blocks.device)
    out = torch.empty(blocks.shape[0], blocks.shape[2] * 32, blocks.shape[1], dtype=dtype, device=blocks.device)
    for e in range(blocks.shape[0]):  # one expert at a time: the int64 codes of all would take 16 bytes a weight
        codes = torch.stack([blocks[e] & 0x0F, blocks[e] >> 4], dim=-1).long()  # [out, G, 16, 2]: even, odd
        values = torch.ldexp(table[codes].flatten(-2), scales[e].to(torch.int32)[..., None] - 127)  # [out, G, 32]
        out[e] = values.flatten(-2).t()
    return out


def dequantize_tensors(tensors: dict[str, torch.Tensor], algo: str | None,
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Turn a unified checkpoint's tensors into plain ones: quantized `X.weight` -> float `X.weight`,
    scale tensors dropped, everything else cast to `dtype`.

    Args:
        tensors: {name: tensor} as read from the checkpoint's safetensors.
        algo: "FP8", "NVFP4", "MXFP4" (`X_blocks` + `X_scales` -> `X`, `unpack_mxfp4`) or None (then only the
            cast happens).
    Raises:
        CheckpointError: an unsupported quant_algo, or a quantized weight without its scales.
    """
    if algo not in (None, "FP8", "NVFP4", "MXFP4"):
        raise CheckpointError(f"quant_algo {algo!r} is not supported by the dflash-trt runtime (FP8, NVFP4 and "
                              "MXFP4 are)")
    out = {}
    for name, t in tensors.items():
        if algo == "MXFP4" and name.endswith(MXFP4_SUFFIXES):
            base = name[: -len("_blocks")]  # both suffixes are 7 characters
            blocks, scales = tensors.get(base + "_blocks"), tensors.get(base + "_scales")
            if blocks is None or scales is None:
                have, lack = (name, base + "_scales") if blocks is not None else (name, base + "_blocks")
                raise CheckpointError(f"MXFP4 tensor {have} has no {lack}; the checkpoint is incomplete")
            if name.endswith("_blocks"):
                out[base] = unpack_mxfp4(blocks, scales, dtype)
            continue
        if name.endswith(SCALE_SUFFIXES):
            continue
        if name.endswith(".weight") and t.dtype in (torch.float8_e4m3fn, torch.uint8):
            base = name[: -len(".weight")]
            scale = tensors.get(base + ".weight_scale")
            if scale is None:
                raise CheckpointError(f"quantized weight {name} has no {base}.weight_scale; the checkpoint is incomplete")
            if t.dtype == torch.float8_e4m3fn:
                out[name] = (t.float() * scale.float()).to(dtype)
            else:
                scale_2 = tensors.get(base + ".weight_scale_2")
                if scale_2 is None:
                    raise CheckpointError(f"NVFP4 weight {name} has no {base}.weight_scale_2 (global scale)")
                out[name] = unpack_nvfp4(t, scale, scale_2, dtype)
        else:
            out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


def read_dequantized(folder: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly ModelOpt-quantized) checkpoint folder, dequantized to `dtype`."""
    from dflash_trt.models.loading import read_tensors

    return dequantize_tensors(read_tensors(folder), quant_algo(folder), dtype)
