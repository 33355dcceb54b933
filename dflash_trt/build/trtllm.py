"""Everything TensorRT-LLM reads from a bundle.

`trtllm/` (PyTorch backend, TensorRT-LLM >= 1.3.0rc with DFlash):
- `target/`: the target as a ModelOpt unified HF checkpoint (`export_hf_checkpoint`: config.json with
  `quantization_config`, hf_quant_config.json, safetensors) plus the tokenizer files;
- `drafter/`: the DFlash drafter (z-lab format over the full target vocabulary: a reduced-vocabulary
  drafter's `full_vocab_copy`; FP8 when `--drafter-quant fp8`);
- `serve.yaml`: the `trtllm-serve --config` file (TorchLlmArgs: tensor_parallel_size, kv_cache_config,
  speculative_config with decoding_type DFlash), checked by `dflash_trt.build.schema`;
- `launch.sh`: the trtllm-serve command; `llm_api_example.py`: the same settings through `tensorrt_llm.LLM`
  (`llm_api_example` writes every field of the serve config, so the two cannot differ).

`trtllm_checkpoint/` (the legacy TensorRT engine flow of TensorRT-LLM 1.2.x - 1.3.0rc20): the target as
TensorRT-LLM's per-rank checkpoint (config.json with `mapping` and `quantization`, rank{N}.safetensors),
made by ModelOpt's `export_tensorrt_llm_checkpoint` at tp 1 and split with `dflash_trt.build.sharding`,
plus `build_engine.sh` with the `trtllm-build` command. Those versions have no DFlash: the engine is
built in `draft_tokens_external` mode, i.e. it verifies drafts that an external drafter supplies.
Llama and Mistral targets export with ModelOpt's decoder type `llama` (TensorRT-LLM's LLaMAForCausalLM,
which its MODEL_MAP also gives "MistralForCausalLM"), Qwen3 and Qwen2 targets with `qwen` (TensorRT-LLM's
QWenForCausalLM with `qwen_type: qwen3`, which adds per-head RMSNorm on q and k: `attention.q_layernorm` /
`attention.k_layernorm`; or `qwen_type: qwen2`, whose fused `attention.qkv` has a bias and `attention.dense`
none). Targets with sliding-window layers are refused (`check_trtllm_target`); a mixture-of-experts target
(Qwen3-MoE) gets no trtllm_checkpoint/ (`engine_checkpoint_refusal`). Without `tensorrt_llm`
installed, ModelOpt 0.47 writes config.json by hand and leaves out fields TensorRT-LLM reads
(`trtllm_config_fields` adds them).
"""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from pathlib import Path

import torch
import yaml

from dflash_trt.build.schema import validate_llm_args
from dflash_trt.build.sharding import ShardSpec, check_divisible, merge_state_dicts, split_state_dict, tensors_equal
from dflash_trt.config import TargetConfig
from dflash_trt.errors import BuildError, ConfigError
from dflash_trt.text import count

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")
SERVE_CONFIG = "serve.yaml"
#: dtype of the non-quantized tensors in exported checkpoints (what GPUs serve in)
EXPORT_DTYPE = torch.bfloat16


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer / generation config files present in `src` to `dst`; return their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def export_target_hf(model, out: Path, source: Path) -> None:
    """Write the (possibly ModelOpt-quantized) transformers `model` as a unified HF checkpoint to `out`.

    Quantized models go through `modelopt.torch.export.export_hf_checkpoint`, which converts the model
    IN PLACE (packs weights): call this after every other use of `model`. Its float32 tensors that are
    not scales (embedding, norms, unquantized layers) are then stored in bfloat16, the serving dtype.
    Unquantized models are cast to bfloat16 and saved with `save_pretrained`.
    """
    from dflash_trt.models.loading import no_transformers_bars

    out.mkdir(parents=True, exist_ok=True)
    if any(hasattr(m, "weight_quantizer") for m in model.modules()):
        from modelopt.torch.export import export_hf_checkpoint

        with torch.inference_mode(), no_transformers_bars():
            export_hf_checkpoint(model, dtype=EXPORT_DTYPE, export_dir=str(out))
        _store_unquantized_as(out, EXPORT_DTYPE)
    else:
        with no_transformers_bars():
            copy.deepcopy(model).to(EXPORT_DTYPE).save_pretrained(out, safe_serialization=True)
    copy_tokenizer(source, out)


def _store_unquantized_as(folder: Path, dtype: torch.dtype, sources: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
    """Rewrite a checkpoint's non-scale tensors of a `sources` dtype in `dtype` (scales stay float32, quantized
    weights as they are); set config dtype."""
    from safetensors.torch import load_file, save_file

    from dflash_trt.models.dequant import SCALE_SUFFIXES

    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(file))
        if not any(t.dtype in sources and t.dtype != dtype for t in tensors.values()):
            continue  # nothing to convert: the file stays as copied
        for name, t in tensors.items():
            if t.dtype in sources and not name.endswith(SCALE_SUFFIXES):
                tensors[name] = t.to(dtype)
        save_file(tensors, str(file), metadata={"format": "pt"})
    cfg_file = folder / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg.pop("torch_dtype", None)
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")


def copy_drafter(src: Path, out: Path) -> None:
    """Copy an unquantized drafter folder to `out`: config.json, safetensors, the other JSON files
    (training.json, acceptance.json), its Markdown (README.md: vocabulary and loaders, acceptance.md) and
    the PNG figures they refer to (loss.png, acceptance.png)."""
    out.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and (p.suffix in (".json", ".safetensors", ".md", ".png") or p.name in TOKENIZER_FILES):
            shutil.copy2(p, out / p.name)


def drafter_in_serving_dtype(folder: Path) -> None:
    """Store TensorRT-LLM's copy of the drafter (an unquantized z-lab drafter folder) in EXPORT_DTYPE, the target's:
    TensorRT-LLM builds the draft model in its config's dtype and feeds it the target's hidden states, so a float32
    drafter (what `init-drafter` and `train-drafter --export-dtype float32` write) next to a bfloat16 target would
    not run there (and its weights and draft KV cache take twice the memory). float32 and float16 weights are
    converted; config.json's `dtype` says EXPORT_DTYPE (its `torch_dtype` dropped, as the target's export)."""
    _store_unquantized_as(folder, EXPORT_DTYPE, (torch.float32, torch.float16))


def serve_config(tp_size: int, block_size: int, mask_token_id: int, target_layer_ids: list[int],
                 kv_cache_dtype: str, max_batch_size: int = 8, max_seq_len: int | None = None,
                 speculative_model: str = "./drafter") -> dict:
    """The trtllm-serve YAML as a dict (validated against the schema).

    max_draft_len = block_size - 1: one DFlash block holds the last verified token and block_size - 1 drafts.
    Paths are relative to the folder the YAML lives in (`launch.sh` runs from there).
    """
    cfg = {
        "tensor_parallel_size": tp_size,
        "max_batch_size": max_batch_size,
        "kv_cache_config": {"dtype": kv_cache_dtype, "free_gpu_memory_fraction": 0.85, "enable_block_reuse": False},
        "disable_overlap_scheduler": True,
        "speculative_config": {
            "decoding_type": "DFlash",
            "max_draft_len": block_size - 1,
            "speculative_model": speculative_model,
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target_layer_ids),
            "attention_backend": "VANILLA",
        },
    }
    if max_seq_len is not None:
        cfg["max_seq_len"] = max_seq_len
    validate_llm_args(cfg, block_size)
    return cfg


LAUNCH_SH = """#!/usr/bin/env bash
# Serve this bundle with TensorRT-LLM's OpenAI-compatible server (PyTorch backend, DFlash needs >= 1.3.0rc).
# {gpus}
# Arguments go on to trtllm-serve, e.g. --tool_parser qwen3 --reasoning_parser qwen3 for a Qwen3 target (tool calls,
# reasoning_content), as dflash-trt serve's --tool-parser / --reasoning-parser.
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v trtllm-serve >/dev/null; then
    echo "trtllm-serve not found: install TensorRT-LLM >= 1.3.0rc (pip install tensorrt_llm; DFlash needs its" \
         "PyTorch backend), or serve this bundle with dflash-trt serve --bundle $(dirname "$PWD")" >&2
    exit 127
fi
exec trtllm-serve ./target --config {config} --host "${{HOST:-0.0.0.0}}" --port "${{PORT:-8000}}" "$@"
"""

LLM_EXAMPLE = '''"""Run this bundle with the tensorrt_llm.LLM API (PyTorch backend, DFlash needs TensorRT-LLM >= 1.3.0rc).

    python llm_api_example.py          # on a machine with {tp} GPU(s)

The settings are serve.yaml's (dflash-trt build writes both from the same config).
"""
import sys
from pathlib import Path

try:
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi import DFlashDecodingConfig, KvCacheConfig
except ImportError as exc:
    sys.exit(f"llm_api_example.py: cannot import TensorRT-LLM ({{exc}}); install TensorRT-LLM >= 1.3.0rc (pip install "
             "tensorrt_llm; DFlash needs its PyTorch backend), or run this bundle with dflash-trt generate --bundle "
             f"{{Path(__file__).resolve().parent.parent}}")

here = Path(__file__).resolve().parent
spec = DFlashDecodingConfig(
{spec_kwargs}
)
kv_cache = KvCacheConfig(
{kv_kwargs}
)
llm = LLM(
    str(here / "target"),
{llm_kwargs}
    kv_cache_config=kv_cache,
    speculative_config=spec,
)
for out in llm.generate(["The capital of France is"], SamplingParams(max_tokens=64, temperature=0.0)):
    print(out.outputs[0].text)
'''

#: LLM-API class of each serve.yaml section (the example passes the section's fields to it)
LLM_API_SECTIONS = {"kv_cache_config": "KvCacheConfig", "speculative_config": "DFlashDecodingConfig"}


def llm_api_example(cfg: dict) -> str:
    """llm_api_example.py for the serve config `cfg` (`serve_config`): every field of serve.yaml, passed to
    `tensorrt_llm.LLM` (top-level fields), `KvCacheConfig` (kv_cache_config) and `DFlashDecodingConfig`
    (speculative_config, less `decoding_type`, which the class stands for); `speculative_model`, relative
    to the folder of serve.yaml, becomes a path beside the script."""
    def kwargs(fields: dict, indent: str = "    ", path_keys: tuple[str, ...] = ()) -> str:  # one per line
        return "\n".join(f"{indent}{k}=str(here / {v!r})," if k in path_keys else f"{indent}{k}={v!r},"
                         for k, v in fields.items())

    top = {k: v for k, v in cfg.items() if k not in LLM_API_SECTIONS}
    spec = {k: v for k, v in cfg["speculative_config"].items() if k != "decoding_type"}
    return LLM_EXAMPLE.format(tp=cfg["tensor_parallel_size"], llm_kwargs=kwargs(top),
                              kv_kwargs=kwargs(cfg["kv_cache_config"]),
                              spec_kwargs=kwargs(spec, path_keys=("speculative_model",)))


#: first lines of serve.yaml. TensorRT-LLM opens speculative_config.speculative_model as given (TorchLlmArgs.
#: validate_speculative_config joins it with "config.json" as is, tensorrt_llm/llmapi/llm_args.py), so the relative
#: "./drafter" resolves against the directory trtllm-serve runs in, not against this file's folder
SERVE_YAML_HEADER = ("# trtllm-serve --config file (TorchLlmArgs); written and schema-checked by dflash-trt build\n"
                     "# speculative_model is relative to this folder: run trtllm-serve from here (launch.sh does:\n"
                     "# cd trtllm && trtllm-serve ./target --config serve.yaml), or make it an absolute path\n")


def write_serving_files(root: Path, cfg: dict) -> None:
    """Write serve.yaml, launch.sh and llm_api_example.py into `root` (the bundle's trtllm/ folder), all
    from the one serve config `cfg` (`serve_config`)."""
    (root / SERVE_CONFIG).write_text(
        SERVE_YAML_HEADER + yaml.safe_dump(cfg, sort_keys=False))
    tp = cfg["tensor_parallel_size"]
    launch = root / "launch.sh"
    launch.write_text(LAUNCH_SH.format(config=SERVE_CONFIG, gpus=f"needs {count(tp, 'GPU')} (tensor_parallel_size {tp})"))
    launch.chmod(0o755)
    (root / "llm_api_example.py").write_text(llm_api_example(cfg))


BUILD_ENGINE_SH = """#!/usr/bin/env bash
# Build TensorRT engines from this per-rank checkpoint with TensorRT-LLM 1.2.x - 1.3.0rc20 (the legacy
# TensorRT backend, removed after 1.3.0rc20). These versions have no DFlash: the engine verifies drafts
# supplied from outside (speculative_decoding_mode draft_tokens_external, max_draft_len {max_draft_len}).
# Usage: build_engine.sh [OUTPUT_DIR]   (default: BUNDLE.engine beside the bundle folder, which stays as
# built: its manifest.json does not list the engine; a relative OUTPUT_DIR is taken from where you run it)
set -euo pipefail
usage="usage: $0 [OUTPUT_DIR]  (default: the bundle folder's path + .engine)"
case "${{1:-}}" in -h|--help) echo "$usage"; exit 0;; -*) echo "$usage" >&2; exit 2;; esac
if [ $# -gt 1 ]; then echo "$usage" >&2; exit 2; fi
if ! command -v trtllm-build >/dev/null; then
    echo "trtllm-build not found: install TensorRT-LLM 1.2.x - 1.3.0rc20 (the last versions with trtllm-build)," \\
         "or serve the bundle's trtllm/ folder with trtllm-serve (TensorRT-LLM >= 1.3.0rc, DFlash)" >&2
    exit 127
fi
checkpoint="$(cd "$(dirname "$0")" && pwd -P)"
bundle="$(dirname "$checkpoint")"
out="${{1:-$bundle.engine}}"
case "$(realpath -m -- "$out")/" in "$bundle"/*)
    echo "OUTPUT_DIR $out is inside the bundle $bundle (its manifest.json lists what it holds): give a folder" \\
         "outside it" >&2
    exit 2;;
esac
trtllm-build --checkpoint_dir "$checkpoint" --output_dir "$out" \\
    --gemm_plugin auto --use_paged_context_fmha enable \\
    --speculative_decoding_mode draft_tokens_external --max_draft_len {max_draft_len} \\
    --max_batch_size {max_batch_size} --max_seq_len {max_seq_len} --workers {tp}
"""


#: target model_type -> (ModelOpt `decoder_type`, `architecture` in the checkpoint's config.json). The
#: architecture is a key of TensorRT-LLM's `tensorrt_llm.models.MODEL_MAP`; "Qwen3ForCausalLM" (mapped to
#: QWenForCausalLM since TensorRT-LLM PR #5650, July 2025) is also what its own convert_checkpoint.py writes,
#: and fails loudly on a version without Qwen3 engine support instead of building a Qwen2 graph.
TRTLLM_ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen", "Qwen3ForCausalLM"),
                        "qwen2": ("qwen", "Qwen2ForCausalLM"), "mistral": ("llama", "MistralForCausalLM")}


#: target families `dflash-trt build` refuses, with why (`refuse_unbuilt_family`)
UNBUILT_FAMILIES = {
    "gpt_oss": "its attention sinks, biased router and fused MXFP4 experts have no ModelOpt quantization and "
               "TensorRT-LLM export checked by dflash-trt, so no bundle is written for it",
}


def refuse_unbuilt_family(target_folder) -> None:
    """Refuse a --target of a family `dflash-trt build` does not write bundles for (`UNBUILT_FAMILIES`: gpt-oss),
    naming what runs it instead. A folder whose config.json cannot be read passes (`dflash-trt check` names that).

    Raises:
        ConfigError: the target's model_type is one of `UNBUILT_FAMILIES`.
    """
    from dflash_trt.config import read_config_json
    from dflash_trt.errors import CheckpointError

    try:
        model_type = read_config_json(target_folder).get("model_type")
    except CheckpointError:
        return
    why = UNBUILT_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if why is not None:
        raise ConfigError(f"dflash-trt build does not take a {model_type} target ({target_folder}): {why}. Run it with "
                          f"dflash-trt generate / serve / bench --target {target_folder} (the runtime loads it, MXFP4 "
                          "experts dequantized on load, with --tp-size for several GPUs)")


def check_trtllm_target(target: TargetConfig) -> None:
    """Refuse a target whose TensorRT-LLM checkpoints would not compute what it computes.

    Sliding-window layers (Mistral's `sliding_window`, Qwen2's `use_sliding_window`): TensorRT-LLM's per-rank
    checkpoint config has no window field (the engine's window is a runtime setting, `max_attention_window_size`),
    and its PyTorch-backend Qwen2 attention (tensorrt_llm/_torch/models/modeling_qwen.py, QwenAttention) passes no
    window, so both would attend over every key where the target masks old ones.

    Raises:
        ConfigError: naming the field and the fixes.
    """
    if target.layer_types:
        field, off = ("sliding_window", "null") if target.model_type == "mistral" else ("use_sliding_window", "false")
        window, n = target.sliding_window, target.layer_types.count("sliding_attention")
        why = {"qwen2": "the engine flow's config has no window field, and TensorRT-LLM's PyTorch Qwen2 model "
                        "attends over every key",
               "mistral": "the engine flow's config has no window field (TensorRT-LLM's PyTorch Mistral model applies "
                          "it, but the bundle holds both)"}.get(
            target.model_type, "the engine flow's config has no window field, and whether TensorRT-LLM's PyTorch "
                               f"{target.model_type} model applies one is not checked here")
        raise ConfigError(f"the target attends through a sliding window of {window} positions on {n} of "
                          f"{target.num_hidden_layers} layers (config.json's {field}), which TensorRT-LLM's "
                          f"checkpoints cannot carry ({why}): run this target with dflash-trt generate / serve, which "
                          f"apply the window exactly, or, if every prompt + answer fits in {window} tokens (the window "
                          f"then masks nothing), build from a copy whose config.json sets {field} {off} and "
                          f"max_position_embeddings {window} (serve.yaml's max_seq_len comes from it, so TensorRT-LLM "
                          "then refuses longer requests)")


def engine_checkpoint_refusal(target: TargetConfig) -> str | None:
    """Why `dflash-trt build` writes no trtllm_checkpoint/ for `target`, naming what serves the bundle instead, or
    None when it writes one. A mixture-of-experts target (Qwen3-MoE) gets none: the engine flow's MoE checkpoint
    (TensorRT-LLM's `moe` config section and its expert tensor layout, split per rank) is not wired up or checked
    here. TensorRT-LLM's PyTorch backend loads the HF checkpoint in trtllm/target/ (its Qwen3MoeForCausalLM)."""
    if not target.is_moe:
        return None
    return (f"trtllm_checkpoint/ (TensorRT-LLM's per-rank checkpoint for the TensorRT engine flow, 1.2.x - 1.3.0rc20) "
            f"is not written for a mixture-of-experts target ({target.model_type}, {target.num_experts} experts): its "
            "MoE layout is not supported by dflash-trt build. The bundle serves with TensorRT-LLM's PyTorch backend "
            "(trtllm/launch.sh, llm_api_example.py), dflash-trt (generate / serve --bundle) and Triton")


def trtllm_config_fields(target: TargetConfig) -> dict:
    """config.json fields that TensorRT-LLM's model config reads and ModelOpt 0.47 leaves out or gets wrong.

    Without `tensorrt_llm` importable, ModelOpt writes the config by hand: it reads RoPE from
    `rope_theta` / `rope_scaling`, which transformers >= 5 keeps in `rope_parameters` (so `rotary_base`
    is lost and TensorRT-LLM would default to 10000), and for Qwen it writes neither `qwen_type` nor
    `attn_bias`. Verified against TensorRT-LLM's tensorrt_llm/models/qwen/{config,model,convert}.py and
    llama/config.py: QWenConfig defaults `attn_bias` to True and reads `qwen_type`, `rotary_base`,
    `rotary_scaling`, `seq_length` (its converter writes 8192 when the HF config has none) and
    `use_logn_attn`; QWenDecoderLayer turns on `qk_layernorm` (RmsNorm over head_size) for qwen_type
    qwen3; its converter stores HF `q_norm` / `k_norm` whole on every rank as
    `transformer.layers.N.attention.{q,k}_layernorm.weight`, the names ModelOpt exports.
    """
    scaling = None
    if target.rope_scaling:
        scaling = {**target.rope_scaling, "type": target.rope_scaling["rope_type"]}  # HF configs used either key
    fields = {"architecture": TRTLLM_ARCHITECTURES[target.model_type][1], "rotary_base": target.rope_theta,
              "rotary_scaling": scaling, "attn_bias": target.attention_bias or target.qkv_bias,
              "mlp_bias": target.mlp_bias}
    if target.model_type == "qwen3":
        # qk_layernorm is PretrainedConfig's generic flag; QWen itself keys on qwen_type
        fields.update(qwen_type="qwen3", qk_layernorm=True, seq_length=8192, use_logn_attn=False)
    if target.model_type == "qwen2":
        # QWenConfig.from_hugging_face for qwen2: attn_bias True (QWenDecoderLayer: Attention(bias=attn_bias,
        # dense_bias=False), i.e. biases on the fused qkv only, as HF's q/k/v_proj), no qk norm
        fields.update(qwen_type="qwen2", seq_length=8192, use_logn_attn=False)
    return fields


def export_trtllm_checkpoint(model, out: Path, tp_size: int, scratch: Path, max_draft_len: int,
                             max_seq_len: int, max_batch_size: int = 8) -> dict:
    """Write TensorRT-LLM's per-rank checkpoint of the (possibly quantized) Llama, Mistral, Qwen2 or Qwen3 `model` to
    `out`.

    ModelOpt exports it unsharded (a deep copy of `model`, so `model` itself is untouched) and
    `trtllm_config_fields` completes its config.json; the tp-way split uses `dflash_trt.build.sharding`,
    and the split is checked by reassembling it.
    Returns:
        The checkpoint's config.json (with `mapping` and `quantization`).
    Raises:
        BuildError: the model is not a Llama, Mistral, Qwen2 or Qwen3 decoder (the decoder types wired up here),
            or reassembling the shards does not give back the unsharded tensors.
        ConfigError: a target with sliding-window layers (`check_trtllm_target`).
    """
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from safetensors.torch import load_file, save_file

    model_type = getattr(model.config, "model_type", "?")
    refusal = engine_checkpoint_refusal(TargetConfig.from_hf_config(model.config)) if model_type == "qwen3_moe" else None
    if refusal is not None:
        raise BuildError(refusal)
    if model_type not in TRTLLM_ARCHITECTURES:
        raise BuildError(f"the TensorRT-LLM per-rank checkpoint is wired up for {', '.join(TRTLLM_ARCHITECTURES)} "
                         f"targets only, got model_type {model_type!r}; use the trtllm/ folder (PyTorch backend)")
    check_trtllm_target(TargetConfig.from_hf_config(model.config))
    full_dir = scratch / "trtllm_checkpoint_tp1"
    with warnings.catch_warnings():
        # Two misleading ModelOpt 0.47 warnings: without tensorrt_llm installed it "cannot export the
        # checkpoint config" and writes it by hand (the fields it misses are added below); and it warns
        # "Enable lm_head quantization" even when lm_head's quantizers are disabled, as ours are (tested).
        warnings.filterwarnings("ignore", message="Cannot export tensorrt_llm checkpoint config")
        warnings.filterwarnings("ignore", message="Enable lm_head quantization")
        export_tensorrt_llm_checkpoint(copy.deepcopy(model), TRTLLM_ARCHITECTURES[model_type][0], EXPORT_DTYPE,
                                       str(full_dir), inference_tensor_parallel=1)
    config = json.loads((full_dir / "config.json").read_text())
    config.update(trtllm_config_fields(TargetConfig.from_hf_config(model.config)))
    full = load_file(str(full_dir / "rank0.safetensors"))
    spec = ShardSpec.from_trtllm_config(config, tp_size)
    check_divisible(spec, int(config["vocab_size"]), int(config["intermediate_size"]), int(config["hidden_size"]),
                    nvfp4=(config.get("quantization") or {}).get("quant_algo") == "NVFP4")
    ranks = split_state_dict(full, spec)
    merged = merge_state_dicts(ranks, spec)
    bad = [k for k in full if not tensors_equal(merged[k], full[k])]
    if bad:
        raise BuildError(f"tensor-parallel shards do not reassemble to the unsharded tensors: {bad[:5]}")
    out.mkdir(parents=True, exist_ok=True)
    config.pop("rank", None)
    config["mapping"] = {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1}
    (out / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    for r, sd in enumerate(ranks):
        save_file(sd, str(out / f"rank{r}.safetensors"), metadata={"format": "pt"})
    script = out / "build_engine.sh"
    script.write_text(BUILD_ENGINE_SH.format(max_draft_len=max_draft_len, max_batch_size=max_batch_size,
                                             max_seq_len=max_seq_len, tp=tp_size))
    script.chmod(0o755)
    shutil.rmtree(full_dir, ignore_errors=True)
    return config


def read_trtllm_ranks(folder: Path) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """(config.json, [rank0 tensors, rank1 tensors, ...]) of a per-rank TensorRT-LLM checkpoint."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    world = int(config["mapping"]["world_size"])
    return config, [load_file(str(folder / f"rank{r}.safetensors")) for r in range(world)]
