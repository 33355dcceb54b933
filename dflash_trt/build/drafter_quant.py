"""FP8 quantization of a DFlash drafter (`--drafter-quant fp8`).

The drafter is not a transformers model, so ModelOpt's `export_hf_checkpoint` does not apply. We
calibrate it with ModelOpt (`mtq.FP8_DEFAULT_CFG`, max calibration) while it drafts for the real
target on the calibration prompts (its inputs are target features, so it cannot be calibrated
alone), then write the same per-tensor FP8 layout as ModelOpt's unified checkpoint:
`X.weight` float8_e4m3fn, `X.weight_scale` = amax(|W|) / 448, `X.input_scale` = calibrated amax(|x|) / 448,
plus `quantization_config` in config.json and `hf_quant_config.json`. `dflash_trt.models.dequant`
reads it back.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

from dflash_trt.build.quantize import E4M3_MAX, import_modelopt
from dflash_trt.errors import ConfigError
from dflash_trt.models.checkpoints import load_drafter
from dflash_trt.models.loading import save_checkpoint
from dflash_trt.models.target import TargetModel


def fp8_quant_config(producer_version: str) -> tuple[dict, dict]:
    """(config.json `quantization_config`, hf_quant_config.json) for per-tensor FP8 W8A8 Linears."""
    producer = {"name": "modelopt", "version": producer_version}
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    qcfg = {"config_groups": {"group_0": {"input_activations": fp8, "weights": dict(fp8), "targets": ["Linear"]}},
            "ignore": [], "quant_algo": "FP8", "producer": producer, "quant_method": "modelopt"}
    hf_quant = {"producer": producer, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                                       "exclude_modules": []}}
    return qcfg, hf_quant


def quantize_drafter_fp8(drafter_path: str | Path, target: TargetModel, prompts: list[list[int]], out: str | Path,
                         draft_tokens: int = 32) -> int:
    """Calibrate and write an FP8 copy of the drafter at `drafter_path` into `out`.

    Args:
        target: the (float32) target the drafter serves; supplies features, embedding and lm_head. The
            drafter is calibrated on the target's device.
        prompts: tokenized calibration prompts; each is decoded for `draft_tokens` tokens with DFlash.
    Returns:
        The number of Linear layers quantized.
    """
    import modelopt

    from dflash_trt.config import DrafterConfig
    from dflash_trt.runtime.engine import Engine
    from dflash_trt.runtime.proposer import DFlashProposer
    from dflash_trt.runtime.sampling import SamplingParams

    mtq = import_modelopt()
    drafter = load_drafter(drafter_path, torch.float32, target.embed_weight.device)  # where the target is
    engine = Engine(target, DFlashProposer(drafter, target))
    params = SamplingParams(max_tokens=draft_tokens, ignore_eos=True)

    room = target.config.max_position_embeddings - draft_tokens - 2 * drafter.config.block_size
    if room < 1:
        raise ConfigError(f"the target's context ({target.config.max_position_embeddings}) is too short to calibrate the "
                          f"drafter with {draft_tokens} drafted tokens per prompt")

    def loop(_model):
        for p in prompts:
            engine.generate([p[:room]], params, "dflash")

    with torch.no_grad():
        mtq.quantize(drafter, copy.deepcopy(mtq.FP8_DEFAULT_CFG), loop)
    tensors: dict[str, torch.Tensor] = {}
    count = 0
    for name, module in drafter.named_modules():
        wq = getattr(module, "weight_quantizer", None)
        if wq is not None and wq.is_enabled and wq.amax is not None:
            w_scale = (wq.amax.float().reshape(()).cpu() / E4M3_MAX).clamp(min=1e-12)
            w = module.weight.detach().float().cpu()
            tensors[f"{name}.weight"] = (w / w_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            tensors[f"{name}.weight_scale"] = w_scale
            iq = module.input_quantizer
            tensors[f"{name}.input_scale"] = (iq.amax.float().reshape(()).cpu() / E4M3_MAX).clamp(min=1e-12)
            if module.bias is not None:
                tensors[f"{name}.bias"] = module.bias.detach().float().cpu()
            count += 1
    for name, t in drafter.state_dict().items():
        base = name.rsplit(".", 1)[0]
        if "_quantizer" in name or f"{base}.weight_scale" in tensors:
            continue
        tensors[name] = (t.detach().float() if t.is_floating_point() else t.detach()).cpu()  # e.g. int64 d2t
    cfg = DrafterConfig.from_pretrained(drafter_path).to_hf_dict()
    qcfg, hf_quant = fp8_quant_config(modelopt.__version__)
    cfg["quantization_config"] = qcfg
    save_checkpoint(out, cfg, tensors)
    (Path(out) / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2) + "\n")
    # the same drafter, quantized: keep how it was made (training.json, loss.png), not acceptance.* (measured on
    # the unquantized drafts); the build writes its README.md (dflash_trt.build.readme)
    for f in [Path(drafter_path) / "training.json", *sorted(Path(drafter_path).glob("*.png"))]:
        if f.is_file() and not f.name.startswith("acceptance."):
            shutil.copy2(f, Path(out) / f.name)
    return count
