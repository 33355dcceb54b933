"""`dflash-trt serve --config FILE`: a trtllm-serve YAML config (TensorRT-LLM's LLM API options, `trtllm-serve
--config` / `--extra_llm_api_options`; what `dflash-trt build` writes as `trtllm/serve.yaml`) read as serve's own
options, so that the settings a deployment gives trtllm-serve serve the same way here.

Each key is one of three kinds (`SERVE_OPTIONS`, `IGNORED`, `REFUSED`):
- a setting serve has: it becomes that option's value (tensor_parallel_size -> --tp-size, max_batch_size, max_seq_len,
  speculative_config.max_draft_len / speculative_model / max_concurrency, kv_cache_config.enable_block_reuse ->
  --enable-prefix-caching (on when left out, TensorRT-LLM's default), enable_chunked_prefill with max_num_tokens ->
  --prefill-chunk-size, dtype);
  speculative_config.mask_token_id and target_layer_ids are checked against the drafter's own config;
- a knob of TensorRT-LLM's executor that changes its speed or GPU memory, not the tokens it returns (CUDA graphs, the
  overlap scheduler, free_gpu_memory_fraction, iteration logs, ...): accepted and named in one line on stderr as
  not applying here;
- a setting that would change what is returned or what is accepted, which serve does not implement (max_input_len,
  a quantized KV cache, pipeline parallelism, attention DP): refused, naming the key.
Unknown keys and wrong types are refused by the schema check (`dflash_trt.build.schema.validate_llm_args`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dflash_trt.errors import ConfigError

#: YAML key (dotted) -> serve's option (the click parameter name)
SERVE_OPTIONS = {
    "tensor_parallel_size": "tp_size", "max_batch_size": "max_batch_size", "dtype": "dtype",
    "max_seq_len": "max_seq_len",
    "speculative_config.max_draft_len": "max_draft_len", "speculative_config.speculative_model": "drafter",
    "speculative_config.speculative_model_dir": "drafter",
    "speculative_config.max_concurrency": "max_concurrency",
    "kv_cache_config.enable_block_reuse": "enable_prefix_caching",
    "enable_chunked_prefill": "prefill_chunk_size", "max_num_tokens": "prefill_chunk_size",
}
#: keys checked against the drafter (`check_drafter`), or that must say what serve does (decoding_type DFlash)
CHECKED = ("speculative_config.decoding_type", "speculative_config.mask_token_id",
           "speculative_config.target_layer_ids")
#: keys that change TensorRT-LLM's speed or memory use, not its outputs: accepted, named as not applying here
IGNORED = (
    "disable_overlap_scheduler", "cuda_graph_config", "print_iter_log", "enable_iter_perf_stats", "return_perf_metrics",
    "stream_interval", "trust_remote_code", "moe_expert_parallel_size",
    "kv_cache_config.free_gpu_memory_fraction", "kv_cache_config.max_tokens", "kv_cache_config.tokens_per_block",
    "kv_cache_config.host_cache_size", "kv_cache_config.enable_partial_reuse",
    "speculative_config.attention_backend", "speculative_config.load_format",
    "speculative_config.max_total_draft_tokens", "speculative_config.draft_len_schedule",
    "speculative_config.acceptance_rate_window_size", "speculative_config.acceptance_rate_threshold",
    "speculative_config.use_rejection_sampling", "speculative_config.allow_advanced_sampling",
    "speculative_config.enable_penalty",
)
#: key -> why serve refuses it (it would change what is returned or accepted), unless at the value given
REFUSED = {
    "max_input_len": "serve accepts any prompt that leaves room in the target's context",
    "pipeline_parallel_size": "serve has no pipeline parallelism (tensor_parallel_size splits the target)",
    "enable_attention_dp": "serve has no attention data parallelism",
    "kv_cache_config.dtype": "serve keeps the KV cache in the model's dtype (no FP8 / NVFP4 KV cache)",
}
#: REFUSED keys at the values that ask for what serve does anyway
NEUTRAL = {"pipeline_parallel_size": (1,), "enable_attention_dp": (False,), "kv_cache_config.dtype": ("auto",)}
#: TensorRT-LLM's max_num_tokens default (TorchLlmArgs), the chunk size when enable_chunked_prefill has none
DEFAULT_MAX_NUM_TOKENS = 8192
#: TensorRT-LLM's KvCacheConfig.enable_block_reuse default: a config that leaves the key out reuses KV blocks across
#: requests, so serve then caches prefixes (`--enable-prefix-caching`)
DEFAULT_ENABLE_BLOCK_REUSE = True


def _flatten(cfg: dict) -> dict[str, Any]:
    out = {}
    for key, value in cfg.items():
        if key in ("kv_cache_config", "speculative_config") and isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def read_serve_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Read a trtllm-serve YAML config as serve's options.

    Args:
        path: the YAML file. A relative speculative_model is taken from the YAML's folder (TensorRT-LLM opens it
            from the folder trtllm-serve runs in, which is the YAML's for the bundle's launch.sh).
    Returns:
        (options: {serve parameter name: value}, checked: {CHECKED key: value}, ignored: the IGNORED keys given).
    Raises:
        ConfigError: an unreadable file, YAML that is not a mapping, a key TensorRT-LLM does not have or a wrong type
            (the schema check, every problem at once), a REFUSED key (naming it and why), speculative_config of
            another decoding_type. (max_num_tokens without enable_chunked_prefill only bounds TensorRT-LLM's tokens
            per iteration: ignored, named.)
    """
    import yaml

    from dflash_trt.build.schema import validate_llm_args

    path = Path(path)
    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config {path}: cannot read it as YAML ({exc}); give a trtllm-serve config file "
                          "(the LLM API options, as `dflash-trt build` writes trtllm/serve.yaml)") from None
    if cfg is None:
        cfg = {}
    if not isinstance(cfg, dict):
        raise ConfigError(f"--config {path}: a trtllm-serve config is a mapping of LLM API options, got "
                          f"{type(cfg).__name__}")
    spec = cfg.get("speculative_config")
    if isinstance(spec, dict) and spec.get("decoding_type") not in (None, "DFlash"):
        raise ConfigError(f"--config {path}: speculative_config.decoding_type is {spec['decoding_type']!r}; "
                          "dflash-trt serve speculates with DFlash only (decoding_type: DFlash), or give --mode ar")
    try:
        validate_llm_args(cfg, drafter_ids_required=False)  # TensorRT-LLM reads missing ones from the drafter
    except ConfigError as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    flat = _flatten(cfg)
    refused = [f"{k} ({REFUSED[k]})" for k, v in flat.items() if k in REFUSED and v not in NEUTRAL.get(k, ())]
    if refused:
        raise ConfigError(f"--config {path}: dflash-trt serve does not implement " + "; ".join(refused)
                          + ": drop the key to serve here")
    options: dict[str, Any] = {}
    for key, value in flat.items():
        name = SERVE_OPTIONS.get(key)
        if name is None or key in ("enable_chunked_prefill", "max_num_tokens"):
            continue
        if key == "speculative_config.speculative_model_dir" and "speculative_config.speculative_model" in flat:
            continue  # both given: TensorRT-LLM's AliasChoices("speculative_model", "speculative_model_dir") takes the first
        if key == "dtype":
            if value == "auto":  # the checkpoint's: serve's default
                continue
        elif key in ("speculative_config.speculative_model", "speculative_config.speculative_model_dir"):
            resolved = (path.parent / value) if not Path(value).is_absolute() else Path(value)
            if not resolved.exists() and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", value):
                raise ConfigError(f"--config {path}: {key} {value}: no such folder beside the config ({resolved}); "
                                  f"{value} looks like a Hugging Face Hub id, which TensorRT-LLM downloads and dflash-trt "
                                  f"does not: fetch it first (huggingface-cli download {value} --local-dir DIR) and "
                                  "give DIR there")
            value = str(resolved)
        elif key == "speculative_config.max_concurrency":
            value = str(value)
        options[name] = value
    if "kv_cache_config.enable_block_reuse" not in flat:  # left out: TensorRT-LLM's KvCacheConfig default, on
        options["enable_prefix_caching"] = DEFAULT_ENABLE_BLOCK_REUSE
    if flat.get("enable_chunked_prefill"):  # TensorRT-LLM then reads a prompt max_num_tokens at a time
        options["prefill_chunk_size"] = flat.get("max_num_tokens", DEFAULT_MAX_NUM_TOKENS)
    # (without chunking, max_num_tokens only bounds TensorRT-LLM's tokens per iteration: ignored)
    checked = {k: v for k, v in flat.items() if k in CHECKED}
    ignored = [k for k in flat if k in IGNORED or (k == "max_num_tokens" and not flat.get("enable_chunked_prefill"))]
    return options, checked, ignored


def check_drafter(checked: dict[str, Any], mask_token_id: int | None, target_layer_ids, path: Path) -> None:
    """The config's speculative_config.mask_token_id and target_layer_ids against the loaded drafter's.

    Raises:
        ConfigError: either differs (naming both values): TensorRT-LLM would run the drafter with the config's.
    """
    for key, own in (("speculative_config.mask_token_id", mask_token_id),
                     ("speculative_config.target_layer_ids", None if target_layer_ids is None else list(target_layer_ids))):
        if key in checked and own is not None and checked[key] != own:
            raise ConfigError(f"--config {path}: {key} is {checked[key]}, but the drafter was trained with {own}; give "
                              "the drafter's value (its config.json) or that config's drafter")
