"""README.md files of a bundle: what it holds, the quantization applied, which loaders take each part.

Everything they say about the bundle comes from the manifest fields the build writes (`write_readmes`
is called with them just before `manifest.write_manifest`, so the READMEs are hashed with the rest):
- `NAME/README.md`: the models, the quantization of each part, how to run and serve it, the layout;
- `trtllm/target/README.md`: the target checkpoint and its quantization;
- the drafter folders' README.md (`trtllm/drafter/`, and `runtime/drafter/` for a reduced-vocabulary
  drafter): the drafter's own README (as given, or `dflash_trt.training.export.bundle_readme` when it
  has none) with a "Quantization in this bundle" section appended.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_trt.text import count

README = "README.md"
QUANT_HEADING = "## Quantization in this bundle"

#: manifest quantization.target -> (name, what is stored and how)
TARGET_FORMATS = {
    "none": ("not quantized", "weights in bfloat16 (the serving dtype)."),
    "fp8": ("FP8", "ModelOpt `FP8_DEFAULT_CFG` (W8A8, per tensor): the weight of every quantized Linear is "
            "float8_e4m3fn with a float32 `weight_scale` (value = weight * weight_scale) and a calibrated static "
            "float32 `input_scale` for its activations; `quant_algo: FP8` in config.json `quantization_config` and "
            "hf_quant_config.json."),
    "nvfp4": ("NVFP4", "ModelOpt `NVFP4_DEFAULT_CFG` (W4A4): the weight of every quantized Linear is uint8 "
              "[out, in / 2] (two FP4 E2M1 codes per byte), with a float8_e4m3fn `weight_scale` per block of 16 "
              "input elements, a float32 global `weight_scale_2` and a static float32 `input_scale`; `quant_algo: "
              "NVFP4` in config.json `quantization_config` and hf_quant_config.json."),
}
#: GPUs TensorRT-LLM runs each format's kernels on
TARGET_GPUS = {"fp8": "FP8 kernels need a GPU of compute capability >= 8.9 (Ada, Hopper, Blackwell)",
               "nvfp4": "NVFP4 kernels need a Blackwell GPU"}
#: what dflash-trt does with each format (dflash_trt.models.dequant / dflash_trt.models.fp8)
TARGET_RUNTIME = {
    "none": "loads the bfloat16 weights into the model dtype (`--dtype`).",
    "fp8": ("on a CPU dequantizes the FP8 weights once at load time into the model dtype (activations are not "
            "quantized: W8A16-equivalent); on a CUDA GPU of compute capability >= 8.9 it runs W8A8 FP8 matmuls "
            "with the checkpoint's scales, as TensorRT-LLM does (`--fp8-matmul auto|on|off`; `on` on a CPU is a "
            "slow reference)."),
    "nvfp4": ("dequantizes the NVFP4 weights once at load time into the model dtype, on every device "
              "(activations are not quantized: W4A16-equivalent)."),
}


def _describe(fmt: str, table: dict) -> tuple[str, str]:
    return table.get(fmt, (fmt, "see config.json `quantization_config` and hf_quant_config.json."))


def _excluded(manifest: dict) -> list[str]:
    trt = (manifest.get("quantization") or {}).get("trtllm_checkpoint") or {}
    return list(trt.get("exclude_modules") or [])


def target_lines(manifest: dict) -> list[str]:
    """Markdown bullets: the target's (and KV cache's) quantization, as recorded in `manifest`."""
    q = manifest["quantization"]
    name, how = _describe(q["target"], TARGET_FORMATS)
    lines = [f"- Target: **{name}**: {how}"]
    if q["target"] != "none":
        kept = ", ".join(["embeddings", "norms", *_excluded(manifest)])
        if q.get("trtllm_checkpoint") is None:  # no per-rank checkpoint (a MoE target): the HF export's own list
            kept += (", and the modules trtllm/target/config.json's `quantization_config.ignore` lists (lm_head; a "
                     "mixture-of-experts target's routers, `mlp.gate`)")
        gpus = f" {TARGET_GPUS[q['target']]}." if q["target"] in TARGET_GPUS else ""
        lines.append(f"  Quantized: the Linear layers of the decoder (attention q/k/v/o projections, MLP); kept in "
                     f"bfloat16: {kept}.{gpus}")
    if q["kv_cache_dtype"] == "fp8":
        lines.append("- KV cache: **FP8** (ModelOpt `FP8_KV_CFG`): calibrated float32 `k_scale` / `v_scale` per "
                     "attention layer (`kv_cache_quant_algo: FP8`), and `kv_cache_config: {dtype: fp8}` in "
                     "trtllm/serve.yaml. dflash-trt keeps its KV cache in the model dtype (the scales are not used).")
    else:
        lines.append("- KV cache: not quantized (`kv_cache_config: {dtype: auto}`: the model dtype).")
    return lines


#: why trtllm/drafter is not FP8 when the bundle's runtime drafter is (`dflash_trt.build.pipeline.drafter_as_given`)
TRTLLM_NOT_FP8 = ("TensorRT-LLM's DFlash loader (`tensorrt_llm/_torch/models/modeling_dflash.py`) makes `fc` a plain "
                  "Linear in the checkpoint's dtype and reads no FP8 scales")


def drafter_lines(manifest: dict, folder: str | None = None) -> list[str]:
    """Markdown bullets: the drafter's quantization, as recorded in `manifest`; for the bundle (`folder` None) or
    for one of its drafter folders (`folder`: "trtllm/drafter" or "runtime/drafter")."""
    d = manifest["models"]["drafter"]
    if manifest["quantization"]["drafter"] != "fp8":
        return ["- Drafter: not quantized (its weights as given)."]
    fp8 = ("**FP8** (`--drafter-quant fp8`, ModelOpt `FP8_DEFAULT_CFG`, calibrated while it drafted for the target): "
           "the weight of each Linear is float8_e4m3fn with a per-tensor float32 `weight_scale` (value = weight * "
           "weight_scale) and a static `input_scale`, the layout of the target's FP8 checkpoints; `quant_algo: FP8` in "
           "config.json `quantization_config` and hf_quant_config.json. dflash-trt dequantizes it at load time into "
           "the model dtype, on every device")
    plain = f"not quantized: {TRTLLM_NOT_FP8}, so TensorRT-LLM gets the drafter's own weights"
    if folder == d.get("trtllm_path"):
        return [f"- Drafter: {plain} (the FP8 drafter dflash-trt loads is in `{d['path']}/`)."]
    if folder is not None:
        return [f"- Drafter: {fp8}."]
    return [f"- Drafter: {fp8}, in `{d['path']}/`.", f"- TensorRT-LLM's drafter (`{d.get('trtllm_path')}/`): {plain}."]


def calibration_line(manifest: dict) -> list[str]:
    cal = manifest["quantization"].get("calibration") or {}
    if not cal.get("num_prompts"):
        return []
    return [f"- Calibration: ModelOpt max calibration on {cal['num_prompts']} prompts ({cal.get('source')})."]


def bundle_readme(manifest: dict) -> str:
    """The bundle's top-level README.md, from its manifest fields."""
    t, d = manifest["models"]["target"], manifest["models"]["drafter"]
    q = manifest["quantization"]
    tp = manifest["tp_size"]
    version = (manifest.get("tools") or {}).get("dflash-trt")
    reduced = d.get("draft_vocab_size") is not None
    lines = [
        f"# dflash-trt bundle {manifest['name']}",
        "",
        f"Target `{t['source']}` ({t['architecture']}, {t['num_hidden_layers']} layers, hidden {t['hidden_size']}, "
        f"vocabulary {t['vocab_size']}) with the DFlash drafter `{d['source']}` ({count(d['num_hidden_layers'], 'layer')}, "
        f"block size {manifest['block_size']}: max_draft_len {manifest['max_draft_len']}, target layers "
        f"{manifest['target_layer_ids']}, mask token id {manifest['mask_token_id']}"
        + (f", draft vocabulary {d['draft_vocab_size']}" if reduced else "")
        + (")." if d.get("trained", True) else "; UNTRAINED: few drafts are accepted).")
        + f" Tensor parallel size {tp}. Built by dflash-trt {version} on {manifest.get('created_utc')}.",
        "",
        "## Quantization",
        "",
        *target_lines(manifest),
        *drafter_lines(manifest),
        *calibration_line(manifest),
        "",
        "manifest.json `quantization` records the same.",
        "",
        "## Loaders",
        "",
        f"- dflash-trt: `dflash-trt generate --bundle THIS_FOLDER --chat '...'` verifies manifest.json, then loads "
        f"trtllm/target and {d['path']}; it {_describe(q['target'], TARGET_RUNTIME)}",
        f"- TensorRT-LLM >= 1.3.0rc (PyTorch backend, DFlash), on {count(tp, 'GPU')}: `trtllm/launch.sh` (trtllm-serve "
        "./target --config serve.yaml; its arguments go on to trtllm-serve, e.g. `--tool_parser qwen3 --reasoning_parser "
        "qwen3` for a Qwen3 target's tool calls and reasoning) or `python trtllm/llm_api_example.py`.",
        ("- TensorRT-LLM 1.2.x - 1.3.0rc20 (TensorRT engines, no DFlash: it verifies drafts supplied from outside): "
         "`trtllm_checkpoint/build_engine.sh [OUTPUT_DIR]` (default: THIS_FOLDER.engine, beside this folder)."
         if manifest.get("trtllm_checkpoint") else
         "- TensorRT-LLM 1.2.x - 1.3.0rc20 (TensorRT engines): none; this bundle has no trtllm_checkpoint/ (not "
         "written for a mixture-of-experts target)."),
        "- Triton Inference Server (Python backend; its Python must import dflash_trt): where dflash-trt is installed "
        "with nvidia-pytriton (`make install`), `dflash-trt triton --model-repository THIS_FOLDER/triton` (it sets up "
        "that wheel's tritonserver, whose binary alone finds no Python backend); in NVIDIA's Triton container "
        "(nvcr.io/nvidia/tritonserver:YY.MM-py3, dflash-trt installed into its Python) `tritonserver "
        "--model-repository THIS_FOLDER/triton`; then `curl -X POST localhost:8000/v2/models/dflash/generate -d "
        "'{\"text_input\": \"Hi\", \"apply_chat_template\": true, \"max_tokens\": 32}'` (the model runs "
        "dflash-trt's runtime on this bundle on one device: its parameters `device` / `dtype` in "
        "triton/dflash/config.pbtxt are auto, the GPU in bfloat16 where torch sees one when the model loads, else the "
        "CPU in float32; as the TensorRT-LLM backend's, text_output starts with the prompt unless "
        "`exclude_input_in_output` is true, and keeps a stop word; tensors: `dflash_trt/serve/triton_tensors.py`).",
        "- OpenAI API (trtllm-serve's endpoints and metrics) without TensorRT-LLM: `dflash-trt serve --bundle "
        "THIS_FOLDER`.",
        "",
        "## Files",
        "",
        "- manifest.json: how this bundle was made and the sha256 of every file (checked before dflash-trt loads it; "
        "a file added later to the folders it loads is refused, elsewhere not checked: keep other outputs out of this "
        "folder).",
        "- trtllm/target/: the target, a ModelOpt unified HF checkpoint, and the tokenizer.",
        "- trtllm/drafter/: the drafter TensorRT-LLM loads (z-lab format over the full target vocabulary, not "
        "quantized).",
    ]
    if d.get("path") != d.get("trtllm_path", d.get("path")):
        given = d.get("as_given") or f"draft vocabulary {d['draft_vocab_size']}"
        lines.append(f"- {d['path']}/: the drafter dflash-trt loads ({given}).")
    lines += [
        "- trtllm/serve.yaml, launch.sh, llm_api_example.py: serving with TensorRT-LLM.",
        "- triton/dflash/: config.pbtxt and 1/model.py, the Triton model (parameter `bundle`: this folder, `../..` "
        "from the model's folder).",
    ]
    if manifest.get("trtllm_checkpoint"):
        lines.append(f"- trtllm_checkpoint/: the target as TensorRT-LLM's per-rank checkpoint ({count(tp, 'rank file')}) "
                     "and build_engine.sh.")
    return "\n".join(lines) + "\n"


def target_readme(manifest: dict) -> str:
    """trtllm/target/README.md, from the bundle's manifest fields."""
    t, q = manifest["models"]["target"], manifest["quantization"]
    return "\n".join([
        "# Target checkpoint",
        "",
        f"`{t['source']}` ({t['architecture']}, {t['num_hidden_layers']} layers) as a ModelOpt unified HF checkpoint "
        "(config.json, model.safetensors) with its tokenizer, written by `dflash-trt build`. Part of the bundle "
        "two folders up (see its README.md and manifest.json).",
        "",
        QUANT_HEADING,
        "",
        *target_lines(manifest),
        "",
        "Loaders: TensorRT-LLM (`trtllm-serve`, `tensorrt_llm.LLM`: the PyTorch backend reads "
        "`quantization_config`); dflash-trt (`dflash-trt generate --bundle`, or `--target` this folder) "
        f"{_describe(q['target'], TARGET_RUNTIME)}",
    ]) + "\n"


def drafter_section(manifest: dict, folder: str | None = None) -> str:
    """The section appended to the README.md of the bundle's drafter folder `folder` ("trtllm/drafter" or
    "runtime/drafter")."""
    drafter = manifest["models"]["drafter"]
    copy = drafter.get("trtllm_path")
    if copy and copy != drafter.get("path") and folder != copy:  # build wrote TensorRT-LLM's copy
        where = [f"In this bundle the full-vocabulary copy that TensorRT-LLM, vLLM and SGLang load is already at "
                 f"`{copy}` (what `serve.yaml` names; z-lab format, not quantized): no export step is needed.", ""]
    else:
        where = []
    return "\n".join(["", QUANT_HEADING, "", *drafter_lines(manifest, folder), "", *where,
                      "(Added by `dflash-trt build`; the bundle's README.md, two folders up, describes every part.)"]) + "\n"


def drafter_folder_readme(folder: Path) -> str:
    """The README of a drafter folder that has none (`dflash_trt.training.export.bundle_readme`)."""
    from dflash_trt.config import DrafterConfig, read_config_json
    from dflash_trt.models.speculators import is_speculators
    from dflash_trt.training.export import bundle_readme as drafter_readme

    info = json.loads((folder / "training.json").read_text()) if (folder / "training.json").is_file() else {}
    return drafter_readme(DrafterConfig.from_pretrained(folder), info, is_speculators(read_config_json(folder)))


def write_readmes(root: Path, manifest: dict, drafter_folders: list[str]) -> None:
    """Write the bundle's README.md and trtllm/target/README.md under `root`, and append the quantization
    section to the README.md of each folder of `drafter_folders` (written first when missing)."""
    (root / README).write_text(bundle_readme(manifest))
    target = root / manifest["models"]["target"]["path"]
    if target.is_dir():
        (target / README).write_text(target_readme(manifest))
    for rel in drafter_folders:
        folder = root / rel
        path = folder / README
        text = path.read_text() if path.is_file() else drafter_folder_readme(folder)
        path.unlink(missing_ok=True)  # copy2 keeps a read-only README read-only; publish_folder sets the modes
        path.write_text(text.rstrip("\n") + "\n" + drafter_section(manifest, rel))
