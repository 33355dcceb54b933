import pytest

from dflash_trt.build.schema import validate_llm_args, validate_with_tensorrt_llm
from dflash_trt.build.trtllm import serve_config
from dflash_trt.errors import ConfigError


def good():
    return serve_config(tp_size=8, block_size=16, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33],
                        kv_cache_dtype="fp8")


def test_emitted_config_passes_and_has_the_dflash_fields():
    cfg = good()
    validate_llm_args(cfg, block_size=16)
    spec = cfg["speculative_config"]
    assert spec["decoding_type"] == "DFlash" and spec["max_draft_len"] == 15
    assert spec["target_layer_ids"] == [1, 9, 17, 25, 33] and spec["mask_token_id"] == 151669
    assert cfg["tensor_parallel_size"] == 8 and cfg["kv_cache_config"]["dtype"] == "fp8"


def test_misspelled_top_level_key_is_an_error_with_a_suggestion():
    cfg = good()
    cfg["tensor_paralel_size"] = cfg.pop("tensor_parallel_size")
    with pytest.raises(ConfigError, match="unknown key 'tensor_paralel_size'; did you mean 'tensor_parallel_size'"):
        validate_llm_args(cfg)


def test_unknown_nested_key_is_an_error():
    cfg = good()
    cfg["speculative_config"]["num_speculative_tokens"] = 15  # the vLLM name, not TensorRT-LLM's
    with pytest.raises(ConfigError, match="unknown key 'speculative_config.num_speculative_tokens'"):
        validate_llm_args(cfg)


def test_wrong_types_ranges_and_draft_length():
    cfg = good()
    cfg["kv_cache_config"]["dtype"] = "int3"
    cfg["speculative_config"]["target_layer_ids"] = "1,9"
    cfg["max_batch_size"] = 0
    with pytest.raises(ConfigError) as err:
        validate_llm_args(cfg)
    msg = str(err.value)
    assert "kv_cache_config.dtype' must be one of" in msg and "target_layer_ids' must be list[int]" in msg
    assert "'max_batch_size' must be >= 1, got 0" in msg
    cfg = good()
    cfg["speculative_config"]["max_draft_len"] = 16
    with pytest.raises(ConfigError, match="max_draft_len 16 exceeds block_size - 1 = 15"):
        validate_llm_args(cfg, block_size=16)


def test_tensorrt_llm_validation_says_it_was_skipped_here():
    assert validate_with_tensorrt_llm(good()).startswith("skipped: tensorrt_llm is not installed")


def test_ranges_tensorrt_llm_enforces():
    """TensorRT-LLM llm_args.py (NVIDIA/TensorRT-LLM 0004396): TorchLlmArgs asserts DFlash max_draft_len > 0;
    KvCacheConfig.free_gpu_memory_fraction and acceptance_rate_threshold are in [0, 1]; max_concurrency and
    stream_interval are PositiveInt, acceptance_rate_window_size NonNegativeInt."""
    cfg = good()
    cfg["speculative_config"]["max_draft_len"] = 0
    cfg["kv_cache_config"]["free_gpu_memory_fraction"] = 1.5
    cfg["speculative_config"]["acceptance_rate_threshold"] = 1.2
    cfg["speculative_config"]["max_concurrency"] = 0
    cfg["speculative_config"]["acceptance_rate_window_size"] = -1
    cfg["stream_interval"] = 0
    with pytest.raises(ConfigError) as err:
        validate_llm_args(cfg, block_size=16)
    msg = str(err.value)
    assert "'speculative_config.max_draft_len' must be >= 1, got 0" in msg
    assert "'kv_cache_config.free_gpu_memory_fraction' must be <= 1, got 1.5" in msg
    assert "'speculative_config.acceptance_rate_threshold' must be <= 1, got 1.2" in msg
    assert "'speculative_config.max_concurrency' must be >= 1, got 0" in msg
    assert "'speculative_config.acceptance_rate_window_size' must be >= 0, got -1" in msg
    assert "'stream_interval' must be >= 1, got 0" in msg
    cfg = good()  # the bounds themselves pass
    cfg["speculative_config"].update(max_draft_len=1, acceptance_rate_threshold=1.0, max_concurrency=1)
    cfg["kv_cache_config"]["free_gpu_memory_fraction"] = 0
    validate_llm_args(cfg, block_size=16)


def test_dflash_attention_backends_are_tensorrt_llms():
    """DFlashDecodingConfig.attention_backend is Literal["VANILLA", "TRTLLM"] in TensorRT-LLM's
    tensorrt_llm/llmapi/llm_args.py (NVIDIA/TensorRT-LLM 0004396), and DFlashForCausalLM.__init__
    (tensorrt_llm/_torch/models/modeling_dflash.py) raises "DFlash attention backend must be VANILLA or TRTLLM":
    FA4 (a visual-generation backend there) is refused here too, before a GPU machine finds out."""
    for backend in ("VANILLA", "TRTLLM"):
        cfg = good()
        cfg["speculative_config"]["attention_backend"] = backend
        validate_llm_args(cfg, block_size=16)
    cfg = good()
    cfg["speculative_config"]["attention_backend"] = "FA4"
    with pytest.raises(ConfigError, match=r"'speculative_config.attention_backend' must be one of 'VANILLA', 'TRTLLM', "
                                          r"got 'FA4'"):
        validate_llm_args(cfg, block_size=16)
    assert good()["speculative_config"]["attention_backend"] == "VANILLA"  # TensorRT-LLM's default, any GPU


def test_serve_yaml_says_where_its_relative_drafter_path_resolves(tmp_path):
    """TensorRT-LLM opens speculative_config.speculative_model as given (TorchLlmArgs.validate_speculative_config
    joins it with "config.json" as is, tensorrt_llm/llmapi/llm_args.py): "./drafter" resolves against the directory
    trtllm-serve runs in. serve.yaml says so in its header, and launch.sh runs from serve.yaml's folder."""
    import yaml

    from dflash_trt.build.trtllm import write_serving_files

    cfg = good()
    write_serving_files(tmp_path, cfg)
    text = (tmp_path / "serve.yaml").read_text()
    assert yaml.safe_load(text) == cfg and cfg["speculative_config"]["speculative_model"] == "./drafter"
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert "speculative_model is relative to this folder: run trtllm-serve from here" in "\n".join(header)
    launch = (tmp_path / "launch.sh").read_text()
    assert 'cd "$(dirname "$0")"' in launch and "trtllm-serve ./target --config serve.yaml" in launch
