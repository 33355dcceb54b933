"""The TensorRT-LLM fields our `trtllm-serve` YAML may contain, and their validation.

Source: TensorRT-LLM's documented LLM-API reference (PyTorch backend), 1.3.0rc27 / 1.4.0rc1:
`tensorrt_llm.llmapi.TorchLlmArgs` (top level of the `--config` / `--extra_llm_api_options` YAML),
`KvCacheConfig` (`kv_cache_config`) and `DFlashDecodingConfig` (`speculative_config` with
`decoding_type: DFlash`). Only the fields we emit or that users commonly add are listed; every
other key is an error (TensorRT-LLM's pydantic models also forbid extra keys, so a typo would
otherwise fail only on the GPU machine). Where `tensorrt_llm` is importable, `validate_with_tensorrt_llm`
additionally builds TensorRT-LLM's own `DFlashDecodingConfig` and `KvCacheConfig` from the YAML.
Value ranges (`_MINIMUM`, `_MAXIMUM`) follow the source of tensorrt_llm/llmapi/llm_args.py (DecodingBaseConfig,
KvCacheConfig, TorchLlmArgs.validate_speculative_config), which enforces some the reference does not list.
"""

from __future__ import annotations

import difflib
from typing import Any

from dflash_trt.errors import ConfigError

SCHEMA_SOURCE = "TensorRT-LLM LLM API reference 1.3.0rc27 (TorchLlmArgs, KvCacheConfig, DFlashDecodingConfig)"
#: first TensorRT-LLM version whose PyTorch backend has DFlash (its DFlashDecodingConfig)
MIN_TRTLLM_VERSION_DFLASH = "1.3.0rc"

_INT, _FLOAT, _BOOL, _STR, _LIST_INT, _DICT = int, float, bool, str, "list[int]", dict

#: DFlashDecodingConfig fields -> type, or a tuple of allowed literal values
DFLASH_FIELDS: dict[str, Any] = {
    "decoding_type": ("DFlash",),
    "max_draft_len": _INT,
    "max_total_draft_tokens": _INT,
    "speculative_model": _STR,
    "speculative_model_dir": _STR,  # DecodingBaseConfig's older name for speculative_model, still accepted
    "mask_token_id": _INT,
    "target_layer_ids": _LIST_INT,
    # DFlashDecodingConfig.attention_backend is Literal["VANILLA", "TRTLLM"] (tensorrt_llm/llmapi/llm_args.py), and
    # DFlashForCausalLM (tensorrt_llm/_torch/models/modeling_dflash.py) raises ValueError for any other value; FA4 is
    # a backend of TensorRT-LLM's visual-generation AttentionConfig, not of DFlash
    "attention_backend": ("VANILLA", "TRTLLM"),
    "use_rejection_sampling": _BOOL,
    "max_concurrency": _INT,
    "draft_len_schedule": _DICT,
    "load_format": _STR,
    "acceptance_rate_window_size": _INT,
    "acceptance_rate_threshold": _FLOAT,
    "allow_advanced_sampling": _BOOL,
    "enable_penalty": _BOOL,
}

#: KvCacheConfig fields
KV_CACHE_FIELDS: dict[str, Any] = {
    "dtype": ("auto", "fp8", "nvfp4", "float16", "bfloat16"),
    "free_gpu_memory_fraction": _FLOAT,
    "enable_block_reuse": _BOOL,
    "max_tokens": _INT,
    "tokens_per_block": _INT,
    "host_cache_size": _INT,
    "enable_partial_reuse": _BOOL,
}

#: TorchLlmArgs top-level fields (those we emit plus common serving knobs)
LLM_ARGS_FIELDS: dict[str, Any] = {
    "tensor_parallel_size": _INT,
    "pipeline_parallel_size": _INT,
    "moe_expert_parallel_size": _INT,
    "dtype": ("auto", "float16", "bfloat16", "float32"),
    "max_batch_size": _INT,
    "max_num_tokens": _INT,
    "max_seq_len": _INT,
    "max_input_len": _INT,
    "trust_remote_code": _BOOL,
    "enable_chunked_prefill": _BOOL,
    "disable_overlap_scheduler": _BOOL,
    "enable_attention_dp": _BOOL,
    "print_iter_log": _BOOL,
    "enable_iter_perf_stats": _BOOL,
    "return_perf_metrics": _BOOL,
    "stream_interval": _INT,
    "cuda_graph_config": _DICT,
    "kv_cache_config": KV_CACHE_FIELDS,
    "speculative_config": DFLASH_FIELDS,
}

#: lower bounds TensorRT-LLM enforces (pydantic Ge / Gt / PositiveInt, validators). max_draft_len: DecodingBaseConfig
#: allows 0, but TorchLlmArgs.validate_speculative_config asserts "DFlash max_draft_len must be > 0";
#: max_concurrency and stream_interval are PositiveInt, acceptance_rate_window_size NonNegativeInt
_MINIMUM = {"max_draft_len": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "max_batch_size": 1,
            "max_num_tokens": 1, "max_seq_len": 1, "mask_token_id": 0, "max_concurrency": 1, "stream_interval": 1,
            "acceptance_rate_window_size": 0, "free_gpu_memory_fraction": 0, "acceptance_rate_threshold": 0}
#: upper bounds TensorRT-LLM enforces: KvCacheConfig.free_gpu_memory_fraction and
#: DecodingBaseConfig.acceptance_rate_threshold are fractions (ge=0, le=1)
_MAXIMUM = {"free_gpu_memory_fraction": 1, "acceptance_rate_threshold": 1}


def _type_ok(value: Any, kind: Any) -> bool:
    if isinstance(kind, tuple):
        return value in kind
    if kind == _LIST_INT:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if kind is _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is _FLOAT:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _describe(kind: Any) -> str:
    if isinstance(kind, tuple):
        return "one of " + ", ".join(map(repr, kind))
    return kind if isinstance(kind, str) else kind.__name__


def _check(section: dict, fields: dict[str, Any], where: str, problems: list[str]) -> None:
    for key, value in section.items():
        path = f"{where}.{key}" if where else key
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(sorted(fields))}"
            problems.append(f"unknown key '{path}'{hint}")
            continue
        kind = fields[key]
        if isinstance(kind, dict):
            if not isinstance(value, dict):
                problems.append(f"'{path}' must be a mapping, got {type(value).__name__}")
            else:
                _check(value, kind, path, problems)
            continue
        if not _type_ok(value, kind):
            problems.append(f"'{path}' must be {_describe(kind)}, got {value!r}")
        elif key in _MINIMUM and value < _MINIMUM[key]:
            problems.append(f"'{path}' must be >= {_MINIMUM[key]}, got {value}")
        elif key in _MAXIMUM and value > _MAXIMUM[key]:
            problems.append(f"'{path}' must be <= {_MAXIMUM[key]}, got {value}")


def validate_llm_args(config: dict, block_size: int | None = None, drafter_ids_required: bool = True) -> None:
    """Check a trtllm-serve YAML config (as a dict) against the TensorRT-LLM fields we know.

    Also checks DFlash's own constraints: decoding_type DFlash, speculative_model and target_layer_ids
    present (with `drafter_ids_required` False, target_layer_ids and mask_token_id may be left out: TensorRT-LLM's
    TorchLlmArgs.validate_speculative_config then reads them from the drafter's config.json; the bundle's own
    config always writes them), max_draft_len >= 1 (TensorRT-LLM asserts it) and <= block_size - 1 when `block_size` is given,
    and the value ranges TensorRT-LLM enforces (`_MINIMUM`, `_MAXIMUM`: e.g. free_gpu_memory_fraction in [0, 1]).
    Raises:
        ConfigError: every unknown key (with the closest known key), wrong type or range, at once.
    """
    problems: list[str] = []
    if not isinstance(config, dict):
        raise ConfigError(f"the trtllm-serve config must be a mapping, got {type(config).__name__}")
    _check(config, LLM_ARGS_FIELDS, "", problems)
    spec = config.get("speculative_config")
    if isinstance(spec, dict):
        required = ("decoding_type", "max_draft_len", "speculative_model")
        for key in required + (("target_layer_ids", "mask_token_id") if drafter_ids_required else ()):
            if key not in spec and not (key == "speculative_model" and "speculative_model_dir" in spec):
                problems.append(f"speculative_config.{key} is required for DFlash")
        draft = spec.get("max_draft_len")
        if block_size is not None and isinstance(draft, int) and draft > block_size - 1:
            problems.append(f"speculative_config.max_draft_len {draft} exceeds block_size - 1 = {block_size - 1}: "
                            "a DFlash block holds the last verified token plus block_size - 1 drafts")
    if problems:
        raise ConfigError(f"trtllm-serve config does not match {SCHEMA_SOURCE}:\n  - " + "\n  - ".join(problems))


def tensorrt_llm_available() -> bool:
    """True when the `tensorrt_llm` package imports (never on the CPU development machines)."""
    import importlib.util

    return importlib.util.find_spec("tensorrt_llm") is not None


def validate_with_tensorrt_llm(config: dict) -> str:
    """Validate `speculative_config` and `kv_cache_config` with TensorRT-LLM's own pydantic classes.

    Returns:
        "validated with tensorrt_llm X" or "skipped: tensorrt_llm is not installed" (never pretends).
    Raises:
        ConfigError: TensorRT-LLM rejects the config (its message is included).
    """
    if not tensorrt_llm_available():
        return "skipped: tensorrt_llm is not installed here (validated against the documented schema only)"
    import tensorrt_llm
    from tensorrt_llm.llmapi import DFlashDecodingConfig, KvCacheConfig

    try:
        spec = dict(config.get("speculative_config") or {})
        spec.pop("decoding_type", None)
        DFlashDecodingConfig(**spec)
        KvCacheConfig(**(config.get("kv_cache_config") or {}))
    except Exception as exc:  # pydantic.ValidationError or TypeError; shown to the user as is
        raise ConfigError(f"tensorrt_llm {tensorrt_llm.__version__} rejects the trtllm-serve config: {exc}") from exc
    return f"validated with tensorrt_llm {tensorrt_llm.__version__}"
