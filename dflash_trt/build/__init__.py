"""`dflash-trt build`: ModelOpt quantization (FP8, NVFP4), tensor-parallel sharding and TensorRT-LLM bundles.

Modules: `quantize` (ModelOpt configs, CPU NVFP4 op, calibration prompts), `drafter_quant` (FP8 drafter),
`sharding` (TensorRT-LLM per-rank split rules and their inverse), `schema` (trtllm-serve YAML fields),
`trtllm` (the files TensorRT-LLM reads), `manifest` (sha256-verified bundle manifest), `readme` (the
bundle's README.md files: models, quantization, loaders), `pipeline` (the build steps). The runtime
side, reading FP8 / NVFP4 checkpoints back, is `dflash_trt.models.dequant` (and `dflash_trt.models.fp8`
for FP8 matmuls).
Heavy dependencies (modelopt, tensorrt_llm) are imported lazily.
"""
