"""Load targets and drafters from checkpoint folders; write fresh (untrained) drafters.

`load_target` reads a HF Llama / Mistral / Qwen2 / Qwen3 safetensors folder; `load_drafter` a z-lab / ModelOpt
DFlash drafter folder (z-lab/dflash's format, also ModelOpt's export). Both are strict (see `loading.load_strict`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_trt.config import DrafterConfig, TargetConfig, default_target_layer_ids
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.layers import use_transposed_weight_layout
from dflash_trt.models.loading import check_finite, load_strict, read_tensors, save_checkpoint
from dflash_trt.models.target import TargetModel
from dflash_trt.text import count


def _build_on_meta(cls, cfg):
    with torch.device("meta"):
        module = cls(cfg)
    # RoPE tables are computed, not loaded: rebuild them on the CPU.
    rotary = type(module.rotary)
    module.rotary = rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    return module


#: device types the runtime, trainer and build run on
DEVICE_TYPES = ("cpu", "cuda")


def check_device(device: str, flag: str = "--device") -> None:
    """Raises ConfigError (naming the fix) unless `device` is "cpu", "cuda" or "cuda:N" for a GPU torch can use.
    `flag` names where the value came from in the messages (a CLI flag; the Triton model: its config.pbtxt
    parameter).

    "cpu:0" is refused too: torch takes it, but safetensors cannot load onto it, and the CPU has no index.
    """
    cpu = "--device cpu" if flag == "--device" else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is not None and dev.type == "cpu" and dev.index is not None:
        raise ConfigError(f"{flag} {device}: the CPU takes no index; use cpu, cuda or cuda:N")
    if dev is None or dev.type not in DEVICE_TYPES:
        raise ConfigError(f"{flag} {device}: not a device dflash-trt runs on; use cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{flag} {device}: torch sees no CUDA GPU here (torch {torch.__version__}); "
                              f"use {cpu} or run on a machine with a GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"{flag} {device}: torch sees {count(torch.cuda.device_count(), 'GPU')}, numbered from 0; "
                              "pick one of them")


#: the KV-cache scales ModelOpt writes on the attention projections (`X.k_proj.k_scale`, `X.v_proj.v_scale`)
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")


def kv_cache_fp8(path: str | Path) -> bool:
    """Whether the checkpoint folder's quantization config says its KV cache is FP8: config.json
    `quantization_config` with `kv_cache_quant_algo` "FP8" or an 8-bit float `kv_cache_scheme` (what
    ModelOpt 0.47 writes), or hf_quant_config.json `quantization.kv_cache_quant_algo` "FP8"."""
    path = Path(path)
    q = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    scheme = q.get("kv_cache_scheme") or {}
    if str(q.get("kv_cache_quant_algo")).upper() == "FP8" or (
            scheme.get("type") == "float" and scheme.get("num_bits") == 8):
        return True
    hf = path / "hf_quant_config.json"
    if hf.is_file():
        algo = (json.loads(hf.read_text()).get("quantization") or {}).get("kv_cache_quant_algo")
        return str(algo).upper() == "FP8"
    return False


def _read_weights(path, dtype, device):
    """The folder's tensors in `dtype`; ModelOpt FP8 / NVFP4 checkpoints are dequantized first. The
    KV-cache scales of an otherwise unquantized checkpoint with an FP8 KV cache are dropped (our runtime
    keeps its KV cache in the model dtype, as the FP8 / NVFP4 paths also drop them)."""
    from dflash_trt.models.dequant import dequantize_tensors, quant_algo

    algo = quant_algo(path)
    if algo is None:
        tensors = read_tensors(path, dtype, device)
        if kv_cache_fp8(path):
            tensors = {k: v for k, v in tensors.items() if not k.endswith(KV_SCALE_SUFFIXES)}
        return tensors
    return dequantize_tensors(read_tensors(path, None, device), algo, dtype)


def _read_fp8_weights(path, model, dtype, device):
    """The folder's tensors for W8A8: the FP8 weights and scales of the Linears that become Fp8Linear
    (which `model` then has) kept as stored, everything else as `_read_weights` gives it."""
    from dflash_trt.models.dequant import dequantize_tensors
    from dflash_trt.models.fp8 import fp8_linear_names, use_fp8_linears

    raw = read_tensors(path, None, device)
    names = fp8_linear_names(raw, model)
    use_fp8_linears(model, names, dtype)
    kept = {f"{n}{s}": raw.pop(f"{n}{s}") for n in names for s in (".weight", ".weight_scale", ".input_scale")}
    kept = {k: v.reshape(()) if k.endswith("_scale") else v for k, v in kept.items()}
    return {**dequantize_tensors(raw, "FP8", dtype), **kept}


def load_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                fp8_matmul: str = "auto") -> TargetModel:
    """Load a HF causal-LM folder (config.json + safetensors) as a TargetModel in eval mode.

    A ModelOpt NVFP4 unified checkpoint is dequantized to `dtype` on load (`dflash_trt.models.dequant`);
    an FP8 one too, unless `fp8_matmul` turns FP8 matmuls on: then its quantized Linears become
    `Fp8Linear` (W8A8 with the checkpoint's scales; see `dflash_trt.models.fp8`).

    Args:
        fp8_matmul: "auto" (FP8 matmuls on a CUDA GPU of compute capability >= 8.9 only), "on", "off".
    Raises:
        CheckpointError / ConfigError: missing folder, unsupported architecture, strict-load failure
            (naming a config whose architectures are no causal LM, e.g. LlamaModel); fp8_matmul "on" for a checkpoint that is not FP8 or on a device without FP8 matmuls.
    """
    from dflash_trt.models.dequant import quant_algo
    from dflash_trt.models.fp8 import resolve_fp8_matmul

    cfg = TargetConfig.from_pretrained(path)
    fp8 = resolve_fp8_matmul(fp8_matmul, quant_algo(path), device, f"the target at {path}")
    model = _build_on_meta(TargetModel, cfg)
    tensors = _read_fp8_weights(path, model, dtype, device) if fp8 else _read_weights(path, dtype, device)
    ignore = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    try:
        load_strict(model, tensors, "target", path, ignore=ignore)
    except CheckpointError as exc:
        not_causal = [a for a in cfg.architectures if not a.endswith("ForCausalLM")]
        if cfg.architectures and len(not_causal) == len(cfg.architectures):  # e.g. LlamaModel: no lm_head, keys
            raise CheckpointError(  # without "model.": "does not match its config.json" sent users to re-download
                f"{exc}. Its config.json names architectures {list(cfg.architectures)}, not a causal language model "
                f"(...ForCausalLM, e.g. {cfg.model_type.capitalize()}ForCausalLM): give the folder of the causal-LM "
                "checkpoint, the one generating text with its lm_head") from None
        raise
    return use_transposed_weight_layout(model.eval().requires_grad_(False))


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> DFlashDrafter:
    """Load a DFlash drafter folder (z-lab / ModelOpt format, or vLLM `speculators` format) in eval mode
    (FP8 drafters dequantized on load).

    A speculators checkpoint's copies of the target's embedding / lm_head rows are kept as
    `drafter.target_copies` (`dflash_trt.models.speculators.TargetCopies`, empty for a z-lab folder), for
    the proposer to check against the target it is paired with.

    Raises:
        CheckpointError / ConfigError: missing folder, missing dflash_config, strict-load failure
            (e.g. `fc.weight` of the wrong width: the message gives the expected shape), vocabulary maps
            (`d2t`, speculators' `t2d`) that are malformed or disagree (`check_vocab_maps`), weights that
            hold NaN or infinite values (`check_finite`).
    """
    from dflash_trt.models.speculators import read_zlab

    from dflash_trt.models.dequant import quant_algo

    cfg = DrafterConfig.from_pretrained(path)
    model = _build_on_meta(DFlashDrafter, cfg)
    if quant_algo(path) is not None:  # as stored: a non-finite scale is named itself, not the weight it dequantizes
        check_finite(read_tensors(path, None, device), "drafter", path)
    _, tensors, copies = read_zlab(path, _read_weights(path, dtype, device))
    try:
        check_finite({**tensors, **copies.tensors}, "drafter", path)
    except CheckpointError:
        if dtype == torch.float32:
            raise
        _, wide, wide_copies = read_zlab(path, _read_weights(path, torch.float32, device))
        check_finite({**wide, **wide_copies.tensors}, "drafter", path)  # corrupt as stored: that error
        raise CheckpointError(f"drafter checkpoint {path}: its weights overflow {str(dtype).removeprefix('torch.')} "
                              "(values beyond its range become infinite); load it in float32 or bfloat16 "
                              "(--dtype)") from None
    load_strict(model, tensors, "drafter", path)
    model.target_copies = copies
    return use_transposed_weight_layout(model.eval().requires_grad_(False))


def new_drafter_config(target: TargetConfig, num_layers: int = 1, block_size: int = 16,
                       mask_token_id: int | None = None, target_layer_ids: list[int] | None = None,
                       num_features: int = 5) -> DrafterConfig:
    """A drafter config sized for `target`: same hidden size, heads, head_dim and MLP width as the
    target (as in the released drafters), RoPE of the target, `num_layers` decoder layers.

    mask_token_id defaults to the last vocabulary row when the caller gives none: pick a reserved
    token that never occurs in text (DFlash paper sec. 3).
    """
    ids = target_layer_ids or default_target_layer_ids(target.num_hidden_layers, num_features)
    return DrafterConfig(
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        vocab_size=target.vocab_size,
        block_size=block_size,
        mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=tuple(ids),
        num_target_layers=target.num_hidden_layers,
        target_hidden_size=target.hidden_size,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
        layer_types=("full_attention",) * num_layers,
        trained=False,
    )


def init_drafter(cfg: DrafterConfig, out: str | Path, seed: int = 0) -> Path:
    """Write a randomly initialised drafter (normal(0, 0.02) weights, unit norms) to `out`.

    The config records `dflash_trt.untrained: true`. Returns `out`.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in DFlashDrafter(cfg).state_dict().items()}
    tensors = {}
    for key, shape in shapes.items():
        if key == "d2t":  # reduced vocabulary: the first draft_vocab_size target ids
            tensors[key] = torch.zeros(shape, dtype=torch.int64)
        elif key.endswith("norm.weight"):
            tensors[key] = torch.ones(shape)
        else:
            tensors[key] = torch.randn(shape, generator=gen) * 0.02
    save_checkpoint(out, cfg.replace(trained=False).to_hf_dict(), tensors)
    return Path(out)
