"""The Triton model's repository (`dflash_trt.serve.triton`): the config.pbtxt that declares the model
(`model_config`), the folder that holds it (`write_model_repository`), and its model parameters, checked
(`check_parameters`) and read (`load_from_parameters`).

`write_model_repository(repo, ...)` writes `repo/NAME/config.pbtxt` and `repo/NAME/1/model.py` (two lines
importing `TritonPythonModel` from `dflash_trt.serve.triton`, so the package must be importable by the Python that
runs Triton's Python-backend stub). The config.pbtxt declares the tensors of `dflash_trt.serve.triton_tensors`.

Model parameters (config.pbtxt `parameters`): `bundle` (a `dflash-trt build` bundle) or `target` /
`drafter` (model folders; empty: the embedded defaults), each absolute or relative to the model's folder; `mode` (dflash or ar), `dtype`, `device`, `max_batch_size` (sequences in the in-flight batch at most),
`prefill_chunk_size` (chunked prefill: prompt tokens read per decode step; empty: off, as `serve`'s flag),
`enable_kv_cache_reuse` (true / false, tensorrtllm_backend's name; empty: false: prefix caching, as `serve
--enable-prefix-caching`), `prefix_cache_gb` (its memory bound in GiB; empty: 1) and `exclude_input_in_output`
(true / false, tensorrtllm_backend's name: the requests' default; empty: false). `device` auto is the GPU where
torch sees one when the model loads, else the CPU (a line in Triton's log says so); `dtype` auto is the target
checkpoint's dtype on a GPU (a bundle's: bfloat16), float32 on the CPU (`auto_device_dtype`). A bundle's model
(`dflash-trt build`) has both auto; empty, they are cpu and float32.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash_trt.serve.triton_tensors import INPUTS, MAX_REQUEST_BATCH, OUTPUTS

#: the model parameters config.pbtxt may set (module docstring)
PARAMETERS = ("bundle", "target", "drafter", "mode", "dtype", "device", "max_batch_size", "prefill_chunk_size",
              "enable_kv_cache_reuse", "prefix_cache_gb", "exclude_input_in_output")
#: config.pbtxt parameters that Triton's Python backend reads itself (its README: a custom execution environment)
BACKEND_PARAMETERS = ("EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS")
#: what model.py holds: the class lives in the package, so an upgrade needs no new repository
MODEL_PY = "from dflash_trt.serve.triton import TritonPythonModel  # noqa: F401  (Triton Python backend)\n"


def model_config(name: str, parameters: dict[str, str], instances: int = 1) -> str:
    """config.pbtxt text of the model (protobuf text format of Triton's ModelConfig): Python backend,
    decoupled, no Triton-side batching (the runtime batches), CPU instances (the runtime places the models
    itself: `device`)."""
    def tensor(name, dtype, dims, optional=None):
        extra = " optional: true" if optional else ""
        return f'  {{ name: "{name}" data_type: {dtype} dims: [ {", ".join(map(str, dims))} ]{extra} }}'

    lines = [f'name: "{name}"', 'backend: "python"', f"max_batch_size: {MAX_REQUEST_BATCH}",
             "model_transaction_policy { decoupled: true }",
             "input [\n" + ",\n".join(tensor(*t) for t in INPUTS) + "\n]",
             "output [\n" + ",\n".join(tensor(*t) for t in OUTPUTS) + "\n]",
             f"instance_group [ {{ kind: KIND_CPU count: {instances} }} ]"]
    for key, value in parameters.items():
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: {json.dumps(str(value))} }} }}')
    return "\n".join(lines) + "\n"


def write_model_repository(repo: str | Path, name: str = "dflash", **parameters: str) -> Path:
    """Write the model `name` into the Triton model repository `repo` (created if needed): `name/config.pbtxt`
    and `name/1/model.py`. `parameters` are the model parameters named in this module's docstring (e.g.
    bundle="../..", or target=..., drafter=...). Returns the model's folder.

    Raises:
        ValueError: parameters that `check_parameters` refuses.
    """
    check_parameters(parameters)
    folder = Path(repo) / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(model_config(name, parameters))
    (folder / "1" / "model.py").write_text(MODEL_PY)
    return folder


def missing_inputs(config: dict) -> list[str]:
    """The inputs this version reads (`INPUTS`) that the model's config (Triton's JSON of config.pbtxt) lacks:
    a model repository written by an older dflash-trt. Triton refuses a request that sends one of them (its
    name is unknown to the model); everything else works, so the model loads with a warning naming them."""
    have = {t.get("name") for t in config.get("input", ())}
    return [name for name, *_ in INPUTS if name not in have]


def check_parameters(params: dict[str, str]) -> None:
    """Refuse model parameters the model would otherwise ignore or fail on later: an unknown name (a typo such
    as `max_batch_sise` loaded with the default), a `mode` other than dflash / ar (empty: dflash), a `dtype`
    other than the runtime's or auto (empty: float32), a `device` not written cpu, cuda, cuda:N or auto (empty: cpu;
    whether that GPU exists is checked when the model loads), `enable_kv_cache_reuse` / `exclude_input_in_output`
    not true or false, or `bundle` together with `target` / `drafter` (a bundle holds both). The parameters Triton's
    Python backend reads itself (`BACKEND_PARAMETERS`) are allowed.

    Raises:
        ValueError: naming the parameter and the fix (Triton then fails the model's load with it).
    """
    import re

    from dflash_trt.api import DTYPES
    from dflash_trt.runtime.decode_batch import MODES

    unknown = sorted(set(params) - set(PARAMETERS) - set(BACKEND_PARAMETERS))
    if unknown:
        raise ValueError(f"unknown Triton model parameter(s) {unknown} in config.pbtxt; known: {', '.join(PARAMETERS)} "
                         f"(and the Python backend's {', '.join(BACKEND_PARAMETERS)})")
    mode = params.get("mode") or "dflash"
    if mode not in MODES:
        raise ValueError(f"config.pbtxt parameter 'mode' must be one of {', '.join(MODES)} (empty: dflash), got {mode!r}")
    dtype = params.get("dtype") or "float32"
    if dtype not in (*DTYPES, "auto"):
        raise ValueError(f"config.pbtxt parameter 'dtype' must be one of {', '.join(DTYPES)}, auto (empty: float32), "
                         f"got {dtype!r}")
    device = params.get("device") or "cpu"
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?|auto", device):
        raise ValueError(f"config.pbtxt parameter 'device' must be cpu, cuda, cuda:N or auto (empty: cpu), got "
                         f"{device!r}")
    for key in ("enable_kv_cache_reuse", "exclude_input_in_output"):
        bool_parameter(params, key)
    prefix_cache_bytes(params)
    if params.get("bundle") and (params.get("target") or params.get("drafter")):
        raise ValueError("config.pbtxt parameters 'bundle' and 'target' / 'drafter' exclude each other (a bundle holds "
                         "its target and drafter): keep one of them")


def bool_parameter(params: dict[str, str], key: str) -> bool:
    """Model parameter `key` as true / false, any case, spaces around ignored (empty or absent: false, as
    tensorrtllm_backend reads its `enable_kv_cache_reuse` and `exclude_input_in_output`).

    Raises:
        ValueError: another value, naming the parameter.
    """
    value = (params.get(key) or "").strip().lower()
    if value not in ("", "true", "false"):
        raise ValueError(f"config.pbtxt parameter {key!r} must be true or false (empty: false), got {params[key]!r}")
    return value == "true"


def prefix_cache_bytes(params: dict[str, str]) -> int | None:
    """The prefix cache's bound in bytes that `enable_kv_cache_reuse` / `prefix_cache_gb` ask for, or None (off).

    Raises:
        ValueError: a prefix_cache_gb that is not a number of GiB >= MIN_PREFIX_CACHE_GB."""
    from dflash_trt.runtime.prefix_cache import MIN_PREFIX_CACHE_GB

    text = (params.get("prefix_cache_gb") or "").strip()
    try:
        gb = float(text) if text else 1.0
    except ValueError:
        gb = float("nan")
    if not gb >= MIN_PREFIX_CACHE_GB or gb == float("inf"):
        raise ValueError(f"config.pbtxt parameter 'prefix_cache_gb' must be a number of GiB >= {MIN_PREFIX_CACHE_GB:g} "
                         f"(about 1 MiB; empty: 1), got {text!r}")
    return max(1, int(gb * 2**30)) if bool_parameter(params, "enable_kv_cache_reuse") else None


def auto_device_dtype(device: str, dtype: str, stored_dtype: str | None, cuda: bool) -> tuple[str, str, str | None]:
    """The device and dtype the model loads with, where the `device` / `dtype` parameters say "auto" (what
    `dflash-trt build` writes into a bundle's config.pbtxt: a bundle is built for GPUs).

    Args:
        device: the `device` parameter (empty: cpu). dtype: the `dtype` parameter (empty: float32).
        stored_dtype: the target checkpoint's dtype (its config.json's `dtype` / `torch_dtype`; a bundle's is
            bfloat16, `dflash_trt.build.trtllm.EXPORT_DTYPE`), or None where it names none.
        cuda: whether torch sees a CUDA GPU here (`torch.cuda.is_available()`).
    Returns:
        (device, dtype, note): device auto is cuda where there is a GPU, else cpu; dtype auto is the stored dtype on
        a GPU (bfloat16 where it names none or one the runtime does not run), float32 on the CPU (the CPU kernels'
        dtype; bfloat16 / float16 matmuls are slow there). `note` is the line to log when device auto fell back to
        the CPU (None otherwise).
    """
    from dflash_trt.api import DTYPES

    device, dtype = device or "cpu", dtype or "float32"
    note = None
    if device == "auto":
        device = "cuda" if cuda else "cpu"
        if not cuda:
            note = ("config.pbtxt parameter 'device' auto: torch sees no CUDA GPU here, so the model runs on the CPU"
                    + (" in float32" if dtype == "auto" else ""))
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else stored_dtype if stored_dtype in DTYPES else "bfloat16"
    return device, dtype, note


def stored_dtype(params: dict[str, str], folder) -> str | None:
    """The dtype the target's config.json names (`dtype`, or the older `torch_dtype`): the bundle's target
    (its manifest's path), the `target` folder, or the embedded default target; None where it names none."""
    import json as json_

    if params.get("bundle"):
        from dflash_trt.build.manifest import load_manifest

        target = folder("bundle") / load_manifest(folder("bundle"), verify=False)["models"]["target"]["path"]
    elif params.get("target"):
        target = folder("target")
    else:
        from dflash_trt.models.default import default_target_path

        target = default_target_path()
    try:
        config = json_.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the load that follows names what is wrong with the folder
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) else None


def load_from_parameters(params: dict[str, str], model_dir: Path):
    """The Pipeline that `params` (config.pbtxt parameters, strings) name; a relative `bundle`, `target` or
    `drafter` is taken from the model's folder (not from tritonserver's working directory); `device` / `dtype`
    auto as `auto_device_dtype` chooses (a fallback to the CPU logged to stderr, Triton's log). Raises ConfigError
    for a `device` GPU torch does not see (naming the parameter), and what `load_bundle` / `load_pipeline` raise."""
    import torch

    from dflash_trt.api import load_bundle, load_pipeline
    from dflash_trt.models.checkpoints import check_device

    def folder(key):
        path = Path(params[key]) if params.get(key) else None
        return path if path is None or path.is_absolute() else (model_dir / path).resolve()

    mode = params.get("mode") or "dflash"
    dtype, device = params.get("dtype") or "float32", params.get("device") or "cpu"
    if "auto" in (dtype, device):
        cuda = torch.cuda.is_available()
        on_gpu = device.startswith("cuda") or (device == "auto" and cuda)  # only then is the stored dtype used
        stored = stored_dtype(params, folder) if dtype == "auto" and on_gpu else None
        device, dtype, note = auto_device_dtype(device, dtype, stored, cuda)
        if note:
            print(f"dflash-trt: {note}", file=sys.stderr, flush=True)
    check_device(device, "config.pbtxt parameter 'device'")  # a GPU it names is there (written well: checked above)
    if params.get("bundle"):
        return load_bundle(folder("bundle"), dtype, load_drafter_model=mode == "dflash", device=device)
    return load_pipeline(folder("target"), folder("drafter"), dtype, load_drafter_model=mode == "dflash",
                         device=device)


def whole_number_parameter(params: dict[str, str], key: str, default: int | None) -> int | None:
    """Model parameter `key` as a whole number >= 1 (`default` when absent or empty).

    Raises:
        ValueError: naming the parameter, its value and what it must be (Triton then fails the model's load with it).
    """
    value = (params.get(key) or "").strip()
    if not value:
        return default
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise ValueError(f"config.pbtxt parameter {key!r} must be a whole number >= 1, got {value!r}")
    return int(value)
