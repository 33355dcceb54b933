"""`dflash-trt build`: check -> calibrate + quantize -> export -> write serving files -> README -> manifest.

The steps are `step_titles` (8 for every combination of options; the progress lines and the
`--dry-run` plan number them `[i/8]`). The bundle is written into a temporary sibling folder
(`.NAME.building-*`) and renamed to `--out` only when every step succeeded, so a failed or
interrupted (Ctrl-C: `BuildInterrupted`) build leaves no half-written bundle (and an existing bundle
replaced with `--force` stays intact until the new one is complete). `--out` is checked again before that
rename; what appeared there meanwhile and the checks refuse stays, and the bundle goes to `OUT.new` instead.

Bundle layout (docs/build.md):
    NAME/manifest.json           schema version, models, quantization, tp, block size, ... sha256 of every file
    NAME/README.md               the models, the quantization applied, the loaders (`dflash_trt.build.readme`;
                                 trtllm/target/ and the drafter folders get a README saying their quantization)
    NAME/trtllm/target/          unified HF checkpoint (ModelOpt) + tokenizer
    NAME/trtllm/drafter/         DFlash drafter (z-lab format, full target vocabulary: what TensorRT-LLM loads)
    NAME/runtime/drafter/        only for a reduced-vocabulary drafter (d2t), one in the vLLM speculators format or an
                                 FP8 one (--drafter-quant fp8): what `dflash-trt generate --bundle` loads (drafting
                                 over fewer lm_head rows is faster); trtllm/drafter then holds TensorRT-LLM's copy
    NAME/trtllm/serve.yaml       trtllm-serve --config; launch.sh; llm_api_example.py
    NAME/trtllm_checkpoint/      config.json (mapping, quantization), rank{N}.safetensors, build_engine.sh
    NAME/triton/dflash/          Triton model repository: the Python-backend model over this bundle
                                 (`dflash_trt.serve.triton`; dflash-trt triton --model-repository NAME/triton, or
                                 tritonserver --model-repository NAME/triton in a Triton container)
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_trt.errors import BuildError, ConfigError, DFlashError, IncompatibleModelsError
from dflash_trt.files import DISK_FULL, cannot_write, make_folders, os_error, remove_empty
from dflash_trt.interrupts import Terminated
from dflash_trt.text import count

if TYPE_CHECKING:
    from dflash_trt.config import DrafterConfig


@dataclass(frozen=True)
class BuildOptions:
    """Inputs of one build (CLI flags of `dflash-trt build`)."""

    target: Path
    drafter: Path
    out: Path
    quant: str = "none"
    drafter_quant: str = "none"
    kv_cache_dtype: str = "auto"
    tp_size: int = 1
    calib_prompts: Path | None = None
    calib_size: int = 32
    max_batch_size: int = 8
    force: bool = False
    device: str = "cpu"  # where the target (and drafter) are calibrated and quantized: cpu, cuda, cuda:N

    @property
    def calibrates(self) -> bool:
        """Whether the build runs calibration prompts (and so reads --calib-prompts)."""
        return self.quant != "none" or self.kv_cache_dtype == "fp8" or self.drafter_quant == "fp8"


@dataclass
class StepResult:
    """One finished build step: its name, wall time in seconds, and a short detail for the log."""

    name: str
    seconds: float
    detail: str = ""


@dataclass
class BuildReport:
    """What a build did: per-step times (`step_titles` order, the checks first), folder sizes in bytes,
    the manifest written."""

    out: Path
    steps: list[StepResult] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)
    running: str | None = None  # the step in progress (named by the error when it fails)

    @property
    def total_seconds(self) -> float:
        """Wall time of all steps (seconds; the weight-free checks of step 1 included)."""
        return sum(s.seconds for s in self.steps)


def folder_bytes(path: Path) -> int:
    """Total size of the files under `path` (bytes)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def preflight(opts: BuildOptions) -> dict:
    """Every check that needs no weights: --out first (`check_paths`), options, `dflash-trt check`, unquantized inputs
    (`check_unquantized`), tensor-parallel divisibility. Warnings also name engines that `build_engine.sh` wrote
    beside --out from an earlier bundle (OUT.engine, which this build leaves as they are), and the temporary
    folders of builds of --out that did not finish (`stale_builds`: never removed here, one may still run).

    Returns:
        {"target": TargetConfig, "drafter": DrafterConfig, "warnings": [str], "engine_checkpoint": bool (whether
        trtllm_checkpoint/ is written: not for a mixture-of-experts target, `trtllm.engine_checkpoint_refusal`)}.
    Raises:
        ConfigError: a bad option, an already-quantized --target or --drafter (`check_unquantized`), a bad --out, a
            target family build does not write (`trtllm.refuse_unbuilt_family`: gpt-oss);
            IncompatibleModelsError: `check` found errors (all listed).
    """
    from dflash_trt.build.quantize import DRAFTER_QUANT_FORMATS, import_modelopt, modelopt_config
    from dflash_trt.build.sharding import ShardSpec, check_divisible
    from dflash_trt.build.trtllm import check_trtllm_target
    from dflash_trt.compat import ERROR, check_checkpoints
    from dflash_trt.config import DrafterConfig, TargetConfig

    check_paths(opts)
    from dflash_trt.build.trtllm import refuse_unbuilt_family

    refuse_unbuilt_family(opts.target)  # gpt-oss: generate / serve run it, build writes nothing
    if opts.drafter_quant not in DRAFTER_QUANT_FORMATS:
        raise ConfigError(f"--drafter-quant must be one of {', '.join(DRAFTER_QUANT_FORMATS)}, got {opts.drafter_quant!r}")
    if opts.calib_size < 1:
        raise ConfigError(f"--calib-size must be >= 1, got {opts.calib_size}")
    if opts.calibrates and opts.calib_prompts is None:
        from dflash_trt.build.quantize import calibration_texts

        calibration_texts(opts.calib_size)  # the built-in corpus holds that many (refused before any weight is read)
    from dflash_trt.models.checkpoints import check_device

    check_device(opts.device)
    modelopt_config(opts.quant, opts.kv_cache_dtype)  # validates both names
    import_modelopt()  # every build exports through ModelOpt: fail now, with the pip command, if it is missing
    findings = check_checkpoints(opts.target, opts.drafter)
    errors = [f.message for f in findings if f.level == ERROR]
    if errors:
        raise IncompatibleModelsError("dflash-trt check failed, nothing was built:\n  - " + "\n  - ".join(errors))
    for flag, folder in (("--target", opts.target), ("--drafter", opts.drafter)):
        check_unquantized(flag, folder)
    target = TargetConfig.from_pretrained(opts.target)
    check_trtllm_target(target)  # a sliding window TensorRT-LLM's checkpoints cannot carry
    drafter = DrafterConfig.from_pretrained(opts.drafter)
    spec = ShardSpec(opts.tp_size, target.num_attention_heads, target.num_key_value_heads, target.head_dim)
    check_divisible(spec, target.vocab_size, target.dense_intermediate_size, target.hidden_size,
                    nvfp4=opts.quant == "nvfp4")
    warnings = [f.message for f in findings if f.level != ERROR]
    from dflash_trt.build.trtllm import engine_checkpoint_refusal

    no_engine_checkpoint = engine_checkpoint_refusal(target)  # Qwen3-MoE: the PyTorch backend's files only
    if no_engine_checkpoint is not None:
        warnings.append(no_engine_checkpoint)
    engines = opts.out.resolve()
    engines = engines.with_name(engines.name + ".engine")  # build_engine.sh's default OUTPUT_DIR
    if engines.exists():
        warnings.append(f"{engines} holds TensorRT engines built from an earlier bundle at {opts.out}; once this "
                        f"build is done, rebuild them with {opts.out / 'trtllm_checkpoint' / 'build_engine.sh'}")
    space = disk_space_warning(opts)
    if space:
        warnings.append(space)
    stale = stale_builds(opts.out)
    if stale:
        warnings.append(f"{count(len(stale), 'unfinished build folder')} beside --out ({', '.join(map(str, stale))}): "
                        "left by a build that was killed, or in use by one still running; if no build of "
                        f"{opts.out} is running, remove {'it' if len(stale) == 1 else 'them'}")
    return {"target": target, "drafter": drafter, "warnings": warnings, "engine_checkpoint": no_engine_checkpoint is None}


def check_paths(opts: BuildOptions) -> None:
    """The checks of --out that read no weights and import nothing (a few file system calls): not overlapping the
    --target or --drafter folder (`path_overlap`), then `check_out` (an existing --out without --force, ...).
    `preflight` runs them first, and `run_build` once more before its first step, so that such an --out is
    refused at once, not after the seconds the other checks take (ModelOpt's import alone takes ~5 s).

    Raises:
        ConfigError: naming --out, the problem and the fix.
    """
    from dflash_trt.models.loading import path_overlap

    for flag, folder in (("--target", opts.target), ("--drafter", opts.drafter)):
        where = path_overlap(opts.out, folder)
        if where is not None:
            raise ConfigError(f"--out {opts.out} {where} the {flag} folder {folder}; write the bundle to a folder "
                              "outside the inputs (--force does not change this)")
    check_out(opts)


#: bytes per stored weight of a quantized Linear: FP8 e4m3 1; NVFP4 two E2M1 values per byte plus one e4m3 block
#: scale per 16 weights; unquantized (bfloat16) 2
_BYTES_PER_WEIGHT = {"none": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1 / 16}


def bundle_bytes_estimate(opts: BuildOptions) -> int:
    """About how many bytes the build has on disk at its peak, from the target's and drafter's safetensors headers
    (no weights read): the target twice over (the TensorRT-LLM checkpoint's unsharded export and its rank files
    while step 3 splits it, then the rank files and trtllm/target/), each copy holding the decoder's Linear weights
    at `--quant`'s size and the embedding and lm_head in bfloat16 (the per-rank checkpoint stores lm_head apart
    from the embedding even when they are tied), plus the drafter in bfloat16 twice (trtllm/drafter/, runtime/drafter/)
    and the target's tokenizer files."""
    from dflash_trt.build.trtllm import TOKENIZER_FILES
    from dflash_trt.compat import _header_shapes

    def numel(shape) -> int:
        n = 1
        for d in shape:
            n *= d
        return n

    shapes = {k: shape for k, (shape, _) in _header_shapes(Path(opts.target)).items()}
    embed = sum(numel(v) for k, v in shapes.items() if "embed_tokens" in k)
    head = sum(numel(v) for k, v in shapes.items() if k.split(".")[-2:-1] == ["lm_head"])
    linear = sum(numel(v) for k, v in shapes.items() if len(v) == 2 and "embed_tokens" not in k
                 and k.split(".")[-2:-1] != ["lm_head"])
    vocab = embed + (head or embed)  # a tied lm_head is written out too
    one_copy = linear * _BYTES_PER_WEIGHT.get(opts.quant, 2.0) + 2 * vocab
    drafter = 2 * sum(numel(shape) for shape, _ in _header_shapes(Path(opts.drafter)).values())
    # the target's tokenizer files, copied to trtllm/target/ (`trtllm.copy_tokenizer`)
    other = sum((Path(opts.target) / n).stat().st_size for n in TOKENIZER_FILES if (Path(opts.target) / n).is_file())
    return int(2 * one_copy + 2 * drafter + other)


def disk_space_warning(opts: BuildOptions) -> str | None:
    """A warning when the file system --out is on has less free space than the build needs at its peak
    (`bundle_bytes_estimate`, about 10% over it), else None: a build that runs out of space fails only when it
    writes (after the hours a large model's calibration can take), with nothing kept. None when the headers or the
    free space cannot be read (the checks before this one name such problems)."""
    out = Path(opts.out).resolve()
    nearest = out
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    try:
        need = bundle_bytes_estimate(opts)
        free = shutil.disk_usage(nearest).free
    except (OSError, ValueError, DFlashError):
        return None
    if free >= need * 1.1:
        return None
    def size(n: int) -> str:
        return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"

    return (f"the file system of --out ({nearest}) has {size(free)} free, and this build writes about "
            f"{size(need)} at its peak (--quant {opts.quant}: the TensorRT-LLM checkpoint, unsharded and per "
            "rank, then the rank files and trtllm/target/, plus the drafter); it will likely fail with 'No space left "
            "on device' when it writes: free some space or pick an --out on another file system")


def stale_builds(out: Path) -> list[Path]:
    """The temporary folders of other builds of `out` beside it (`.NAME.building-*`, what `run_build` writes into;
    a build killed with SIGKILL leaves its own), sorted."""
    out = Path(out).resolve()
    return sorted(p for p in out.parent.glob(f".{glob.escape(out.name)}.building-*") if p.is_dir()) \
        if out.parent.is_dir() else []


def check_unquantized(flag: str, folder: Path) -> None:
    """A build quantizes (or copies) full-precision weights: a checkpoint that is already quantized (config.json
    `quantization_config`, or an `hf_quant_config.json`: e.g. a bundle's own ModelOpt FP8 `trtllm/target`) would
    be loaded by transformers without its scales, and the bundle would generate garbage. (`dflash-trt check` and
    `generate` accept such folders: the runtime dequantizes them on load.)

    Raises:
        ConfigError: `folder` (given as `flag`) is quantized; names the marker and the fix.
    """
    from dflash_trt.config import read_config_json

    markers = (["config.json quantization_config"] if read_config_json(folder).get("quantization_config") else []) + (
        ["hf_quant_config.json"] if (Path(folder) / "hf_quant_config.json").is_file() else [])
    if markers:
        raise ConfigError(f"{flag} {folder} is an already-quantized checkpoint ({' and '.join(markers)}); build needs "
                          f"the original unquantized checkpoint: give that as {flag} (a bundle's trtllm/ folders are "
                          "quantized already and cannot be quantized again)")


def check_out(opts: BuildOptions) -> Path | None:
    """The checks on `--out` that need no writing (preflight, so `--dry-run` fails exactly as the build does):
    `dflash_trt.out_folder.check_out` with the bundle as the kind --force replaces.

    The build creates missing parent folders of `--out`, then its temporary folder beside `--out`, and
    (with `--force`) moves what is at `--out` aside there: so the nearest existing ancestor of `--out`'s
    parent must be a folder in which this process can create one (tried: an empty folder is made and
    removed). Returns the parent folder the build would create (None when it exists).
    Raises:
        ConfigError: `--out` is empty, names '.' or '..', or lies inside a dflash-trt bundle; it exists without
            `--force`; with `--force`, it is a file, a non-empty folder that is not a dflash-trt bundle, or a
            bundle holding files its manifest does not list (named; nothing but a bundle of only its own files,
            or an empty folder, is ever replaced); a parent of it is a file, or it is not writable.
    """
    from dflash_trt.out_folder import BUNDLE
    from dflash_trt.out_folder import check_out as check_output_folder

    return check_output_folder("--out", opts.out, BUNDLE, opts.force, exists_message=(
        f"{opts.out} already exists; remove it, pick another --out, or pass --force to replace it (--force replaces a "
        "dflash-trt bundle or an empty folder only)"))


def calibration_prompts(opts: BuildOptions) -> tuple[list | None, str | None]:
    """The `--calib-prompts` items the build calibrates on, and a warning when the file holds fewer than
    `--calib-size` (it then calibrates on all of them) or when it is given but nothing is calibrated (the build
    and `--dry-run` both warn through this).

    Returns:
        (None, None) when the build uses the built-in corpus or does not calibrate (with --calib-prompts: (None,
        the warning that it is not used)); else (the first `--calib-size` prompts of the file,
        `quantize.read_calibration_jsonl`, the warning or None).
    Raises:
        ConfigError: the file is an evaluation set, unreadable, malformed or empty.
    """
    from dflash_trt.build.quantize import read_calibration_jsonl

    if opts.calib_prompts is not None and not opts.calibrates:
        return None, (f"--calib-prompts {opts.calib_prompts} is not used: nothing is quantized (give --quant, "
                      "--kv-cache-dtype fp8 or --drafter-quant fp8 to calibrate)")
    if opts.calib_prompts is None:
        return None, None
    items = read_calibration_jsonl(opts.calib_prompts, opts.calib_size)
    warning = None
    if len(items) < opts.calib_size:
        warning = (f"--calib-size {opts.calib_size} but {opts.calib_prompts} has {len(items)} prompts: calibrating "
                   f"on all {len(items)}")
    return items, warning


def drafter_as_given(opts: BuildOptions, dcfg: DrafterConfig) -> str | None:
    """What keeps the drafter that dflash-trt loads out of TensorRT-LLM's format (z-lab, full vocabulary, not
    quantized), so that the bundle holds it in runtime/drafter (for dflash-trt) beside TensorRT-LLM's copy in
    trtllm/drafter: "draft vocabulary N", "speculators format" and/or "FP8", or None. FP8 (`--drafter-quant
    fp8`) is for dflash-trt alone: TensorRT-LLM's DFlash loader (`tensorrt_llm/_torch/models/modeling_dflash.py`,
    `DFlashForCausalLM.load_weights`) makes `fc` a plain Linear in the checkpoint's dtype and reads no FP8
    scales, so an FP8 drafter there would compute in float8 without its scales."""
    from dflash_trt.config import read_config_json
    from dflash_trt.models.speculators import is_speculators

    why = [f"draft vocabulary {dcfg.draft_vocab_size}"] if dcfg.draft_vocab_size is not None else []
    if opts.drafter_quant == "fp8":  # written in the z-lab format, whatever the source's
        why.append("FP8")
    elif is_speculators(read_config_json(opts.drafter)):
        why.append("speculators format")
    return ", ".join(why) or None


def calibration_source(path: Path) -> str:
    """How the manifest names --calib-prompts: a file by its absolute path; a pipe or device (bash's <(...), read
    once) by what was given, with what it is (its resolved name, e.g. /proc/PID/fd/pipe:[N], means nothing later)."""
    if path.is_file():
        return str(path.resolve())
    return f"{path} (a pipe or device, read once at build time)"


def trtllm_needs_conversion(opts: BuildOptions, dcfg: DrafterConfig) -> bool:
    """Whether TensorRT-LLM's copy of the drafter is converted (`full_vocab_copy`: a reduced vocabulary, or the
    speculators format) rather than copied as given."""
    from dflash_trt.config import read_config_json
    from dflash_trt.models.speculators import is_speculators

    return dcfg.draft_vocab_size is not None or is_speculators(read_config_json(opts.drafter))


def trtllm_drafter_how(converted: bool, fp8: bool) -> str:
    """How trtllm/drafter is made when runtime/drafter holds the drafter dflash-trt loads (`drafter_as_given`):
    `converted` (`trtllm_needs_conversion`) or copied as given, and not quantized when that one is FP8."""
    if not converted:
        return "the drafter as given, in bfloat16, not quantized"
    return "z-lab format, full vocabulary, no d2t, in bfloat16" + (", not quantized" if fp8 else "")


#: where a drafter TensorRT-LLM cannot load as it is (`drafter_as_given`) goes, for our runtime (trtllm/drafter gets
#: TensorRT-LLM's copy: z-lab format, full vocabulary, not quantized)
RUNTIME_DRAFTER = "runtime/drafter"
TRTLLM_DRAFTER = "trtllm/drafter"
#: the Triton model repository in a bundle, and its one model (`dflash_trt.serve.triton`)
TRITON_REPO = "triton"
#: the config.pbtxt parameters of the bundle's Triton model
TRITON_PARAMETERS = {"bundle": "../..", "device": "auto", "dtype": "auto"}
TRITON_MODEL = "dflash"


def existing_out(out: Path) -> str | None:
    """What `--force` would replace at `out`: None when nothing is there, "a dflash-trt bundle" (one holding only
    the files its manifest lists), or a description of something else (a file, a folder without a bundle
    manifest, a bundle plus files its manifest does not list): `dflash_trt.out_folder.existing_out`."""
    from dflash_trt.out_folder import BUNDLE
    from dflash_trt.out_folder import existing_out as existing

    return existing(out, BUNDLE)


def step_titles(opts: BuildOptions) -> list[str]:
    """The build's steps, in order: the progress lines of a build print them as `[i/N] title`, the
    `--dry-run` plan numbers its lines the same way, for every combination of options."""
    load = (f"calibrate + quantize target ({opts.quant}, kv cache {opts.kv_cache_dtype})" if opts.calibrates
            else "load target (nothing to quantize)")
    return ["check", load, f"export TensorRT-LLM per-rank checkpoint (tp {opts.tp_size})",
            "export unified HF target checkpoint",
            "drafter (FP8)" if opts.drafter_quant == "fp8" else "drafter (copied, not quantized)",
            "write serve.yaml, launch.sh, LLM API example, Triton model repository", "write README.md files",
            "write manifest.json and move the bundle to --out"]


def numbered(lines: list[str]) -> list[str]:
    """`[i/N] line` for each of the N lines (the numbering of the progress lines and of the plan)."""
    return [f"[{i}/{len(lines)}] {line}" for i, line in enumerate(lines, 1)]


def plan(opts: BuildOptions, pre: dict, calib_count: int | None = None) -> list[str]:
    """What `--dry-run` prints: one line per step of `step_titles(opts)`, in its order (number them with
    `numbered`). `calib_count`: how many --calib-prompts prompts calibration would use (None: --calib-size)."""
    t, d = pre["target"], pre["drafter"]
    calib = str(opts.calib_prompts) if opts.calib_prompts else "built-in corpus (stdlib signatures + docstrings)"
    steps = [f"check: {opts.target} + {opts.drafter}: compatible ({count(len(pre['warnings']), 'warning')})"]
    if opts.calibrates:
        steps.append(f"calibrate + quantize target with ModelOpt on {opts.device}: {opts.quant} (kv cache "
                     f"{opts.kv_cache_dtype}), {calib_count or opts.calib_size} prompts from {calib}")
    else:
        steps.append(f"load target on {opts.device} (float32); nothing to quantize (--quant none, kv cache auto)")
    kv_per_rank = max(t.num_key_value_heads // opts.tp_size, 1)
    drafter_how = "FP8 (ModelOpt calibration while drafting)" if opts.drafter_quant == "fp8" else "copied"
    given = drafter_as_given(opts, d)
    if given is not None:
        how = trtllm_drafter_how(trtllm_needs_conversion(opts, d), opts.drafter_quant == "fp8")
        drafter_how = f"{drafter_how} to {RUNTIME_DRAFTER}/ ({given}, for dflash-trt); {how} to {TRTLLM_DRAFTER}/ for TensorRT-LLM"
    existing = existing_out(opts.out)
    publish = f"move the bundle to {opts.out}"
    if existing == "a dflash-trt bundle":
        publish = f"replace the existing bundle at {opts.out} (--force) with the new one"
    elif existing:
        publish = f"REPLACE {opts.out} (--force), which is {existing}, with the new bundle"
    created = check_out(opts)
    if created is not None:
        publish += f" (creating the folder {created})"
    engine = (f"export trtllm_checkpoint/: TensorRT-LLM per-rank {t.model_type} checkpoint, tp {opts.tp_size} "
              f"({count(t.num_attention_heads // opts.tp_size, 'head')}, {count(kv_per_rank, 'KV head')} per rank)"
              " + build_engine.sh (trtllm-build, TensorRT-LLM 1.2.x - 1.3.0rc20)")
    if not pre.get("engine_checkpoint", True):
        engine = f"skip trtllm_checkpoint/: not written for a mixture-of-experts target ({t.model_type}; see the warning)"
    steps += [
        engine,
        "export trtllm/target/: unified HF checkpoint + tokenizer",
        (f"drafter{'' if given is not None else ' -> trtllm/drafter/'}: {drafter_how} ({d.num_hidden_layers} layers, "
         f"block {d.block_size}, "
         f"target layers {list(d.target_layer_ids)}, mask id {d.mask_token_id})"),
        (f"write trtllm/serve.yaml (max_draft_len {d.block_size - 1}, tensor_parallel_size {opts.tp_size}, "
         f"kv cache {opts.kv_cache_dtype}), launch.sh, llm_api_example.py; schema-check the YAML; "
         f"{TRITON_REPO}/{TRITON_MODEL}/: Triton Python-backend model over this bundle"),
        (f"write README.md (the bundle, quantization {opts.quant}, loaders), trtllm/target/README.md and the drafter "
         "README(s)' quantization section"),
        f"write manifest.json (sha256 of every file) and {publish}",
    ]
    assert len(steps) == len(step_titles(opts))  # one line per step: the same numbering as the build's progress
    return steps


def dry_run(opts: BuildOptions, warn: Callable[[str], None] = print) -> list[str]:
    """`--dry-run`: every check of the build (`preflight`, --out included, and reading --calib-prompts),
    nothing written. `warn` gets each warning as it is found (so those of `check` come out before an
    error of --calib-prompts). Returns the plan, numbered as the build's progress lines.
    Raises:
        what `preflight` and `calibration_prompts` raise, as the build does.
    """
    pre = preflight(opts)
    for w in pre["warnings"]:
        warn(w)
    items, warning = calibration_prompts(opts)  # the loader the real build uses
    if warning:
        warn(warning)
    return numbered(plan(opts, pre, None if items is None else len(items)))


class BuildInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM, `terminate_as_interrupt`) during `run_build`; the message (one line) says which, where,
    and what is at `--out`. `terminated`: True for SIGTERM."""

    def __init__(self, message: str, terminated: bool = False):
        super().__init__(message)
        self.terminated = terminated


class _Progress:
    """Runs the build's steps in the order of `step_titles`, logs `[i/N] title ...` and `... done`,
    and records each one's time in the report."""

    def __init__(self, titles: list[str], report: BuildReport, log: Callable[[str], None]):
        self.titles, self.report, self.log = titles, report, log

    def __call__(self, fn: Callable[[], str | None]) -> None:
        i = len(self.report.steps) + 1
        tag, name = f"[{i}/{len(self.titles)}]", self.titles[i - 1]
        self.log(f"{tag} {name} ...")
        self.report.running = name
        t0 = time.perf_counter()
        detail = fn() or ""
        self.report.steps.append(StepResult(name, time.perf_counter() - t0, detail))
        self.report.running = None
        self.log(f"{tag} {name}: done in {self.report.steps[-1].seconds:.1f} s {detail}")


def run_build(opts: BuildOptions, log: Callable[[str], None] = print) -> BuildReport:
    """Build a bundle at `opts.out` (see the module docstring). `log` receives the progress lines
    (`[i/N] step ...`, `[i/N] step: done ...`, numbered as `step_titles`) and the warnings.

    Raises:
        ConfigError / IncompatibleModelsError: found before anything is written.
        BuildError: a step failed (the message names it; a full disk: the file or --out, and the fix); nothing was written to `opts.out` (the parent folders of
            it that the build created are removed again, as on Ctrl-C). Or `opts.out` changed
            while the build ran so that `check_out` now refuses it (e.g. a folder with files appeared there): it is
            left as it is, and the complete bundle is moved to `OUT.new` (`dflash_trt.out_folder.publish_out`), which the message names.
        BuildInterrupted (a KeyboardInterrupt): Ctrl-C, or SIGTERM inside `terminate_as_interrupt` (`terminated`
            True); its one-line message says which, where, and that nothing
            was written to `opts.out` (what was there is unchanged), or, interrupted while the old --out
            was being removed, that the complete bundle is already there.
    """
    out = opts.out.resolve()
    report = BuildReport(out)
    step = _Progress(step_titles(opts), report, log)
    pre: dict = {}
    tmp = None
    made: list[Path] = []  # the missing parent folders of --out this build creates, deepest first

    def check():
        pre.update(preflight(opts))
        for w in pre["warnings"]:
            log(f"warning: {w}")
        # --calib-prompts is read here, before the target is loaded (minutes for a large model): a malformed or
        # evaluation-set file fails in this step, as in --dry-run; a pipe (bash's <(...)) is still read only once
        pre["calib_items"], warning = calibration_prompts(opts)
        if warning:
            log(f"warning: {warning}")
        existing = existing_out(opts.out)
        if existing and existing != "a dflash-trt bundle":
            log(f"warning: --force: {opts.out} is {existing}; it is replaced by the bundle")
        return f"({count(len(pre['warnings']), 'warning')})"

    check_paths(opts)  # an --out that is refused (it exists, without --force) before the progress lines and ~10 s
    try:
        step(check)  # ConfigError / IncompatibleModelsError as they are: nothing is written yet
        made = make_folders(out.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
        _build_into(tmp, out, opts, pre, report, step, log)  # its last step moves tmp to out
    except KeyboardInterrupt as exc:
        published = tmp is not None and not tmp.exists()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_empty(made)
        terminated = isinstance(exc, Terminated)
        raise BuildInterrupted(_interrupted(opts, report, published, terminated), terminated) from exc
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_empty(made)
        if tmp is None:  # the checks failed, or --out's parent could not be made: nothing was written
            raise
        if isinstance(exc, BuildError) or not isinstance(exc, Exception):
            raise
        if isinstance(exc, DFlashError):
            raise BuildError(f"{exc}\n(build failed; nothing was written to {out})") from exc
        where = f"in step '{report.running}'" if report.running else "before its first step"
        err = os_error(exc)
        if err is not None and err.errno in DISK_FULL:  # a full disk: where, and the fix
            file = err.filename and Path(err.filename)
            what = file if file and tmp not in file.parents else f"the bundle to --out {opts.out}"
            raise BuildError(f"build failed {where}: {cannot_write(str(what), err, 'give another --out')}; nothing "
                             f"was written to {out}") from exc
        raise BuildError(f"build failed {where}: {type(exc).__name__}: {exc}; nothing was written to "
                         f"{out}") from exc
    return report


def _interrupted(opts: BuildOptions, report: BuildReport, published: bool, terminated: bool = False) -> str:
    """The one-line message of a `BuildInterrupted` (`terminated`: by SIGTERM, not Ctrl-C)."""
    total = len(step_titles(opts))
    how = "terminated (SIGTERM)" if terminated else "interrupted (Ctrl-C)"
    where = (f"in step {len(report.steps) + 1}/{total} '{report.running}'" if report.running
             else f"after step {len(report.steps)}/{total}")
    if published:
        return f"build {how} {where}, after the complete bundle was moved to {report.out}"
    existing = existing_out(report.out)
    kept = f" (what was there, {existing}, is unchanged)" if existing else ""
    return f"build {how} {where}; nothing was written to {report.out}{kept}"

def _build_into(root: Path, out: Path, opts: BuildOptions, pre: dict, report: BuildReport, step: _Progress,
                log: Callable[[str], None]) -> None:
    """Steps 2 to the last of `step_titles(opts)` (`step` runs them): the bundle in `root`, then `root`
    moved to `out`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_trt.build import trtllm
    from dflash_trt.build.manifest import sha256_file, tool_versions, write_manifest
    from dflash_trt.build.quantize import calibration_token_ids, hf_forward_loop, quantize_model
    from dflash_trt.build.quantize import tokenized_prompts
    from dflash_trt.build.readme import write_readmes
    from dflash_trt.build.schema import validate_with_tensorrt_llm
    from dflash_trt.models.loading import no_transformers_bars
    from dflash_trt.out_folder import BUNDLE, publish_out

    tcfg, dcfg = pre["target"], pre["drafter"]
    state: dict = {}

    def load_and_quantize():
        with no_transformers_bars():
            model = AutoModelForCausalLM.from_pretrained(str(opts.target), dtype=torch.float32)
        model = model.eval().to(opts.device)
        state["calib"] = []
        items = pre["calib_items"]  # read in the check step
        if opts.calibrates:
            tok = AutoTokenizer.from_pretrained(str(opts.target))
            state["calib"] = (calibration_token_ids(tok, opts.calib_size) if items is None
                              else tokenized_prompts(tok, items))
        state["model"] = quantize_model(model, opts.quant, opts.kv_cache_dtype, hf_forward_loop(state["calib"]))
        return f"({len(state['calib'])} calibration prompts)" if state["calib"] else "(no quantization)"

    def export_checkpoint():
        if not pre.get("engine_checkpoint", True):
            return f"(skipped: a mixture-of-experts target, {tcfg.model_type}; see the warning)"
        cfg = trtllm.export_trtllm_checkpoint(state["model"], root / "trtllm_checkpoint", opts.tp_size, root,
                                              dcfg.block_size - 1, tcfg.max_position_embeddings, opts.max_batch_size)
        state["trt_quant"] = cfg.get("quantization")
        state["trt_arch"] = cfg["architecture"]
        return f"({opts.tp_size} rank file(s), {cfg['architecture']})"

    def export_target():
        trtllm.export_target_hf(state["model"], root / "trtllm" / "target", Path(opts.target))
        del state["model"]

    # A reduced-vocabulary (d2t), speculators-format or FP8 drafter goes to runtime/drafter for our runtime;
    # TensorRT-LLM's DFlash loader reads the z-lab format over the full target vocabulary, not quantized
    # (`drafter_as_given`): trtllm/drafter gets that copy.
    given = drafter_as_given(opts, dcfg)
    reduced = given is not None
    converted = trtllm_needs_conversion(opts, dcfg)
    runtime_drafter = RUNTIME_DRAFTER if reduced else TRTLLM_DRAFTER

    def drafter():
        dst = root / runtime_drafter
        detail = ""
        if opts.drafter_quant == "fp8":
            from dflash_trt.build.drafter_quant import quantize_drafter_fp8
            from dflash_trt.models.checkpoints import load_target

            n = quantize_drafter_fp8(opts.drafter, load_target(opts.target, device=opts.device), state["calib"][:8], dst)
            detail = f"({n} Linear layers in FP8)"
        else:
            trtllm.copy_drafter(Path(opts.drafter), dst)
        if reduced:
            from dflash_trt.training.export import full_vocab_copy

            if converted:  # from the source: the FP8 copy is not what TensorRT-LLM gets
                full_vocab_copy(Path(opts.drafter), root / TRTLLM_DRAFTER)
            else:  # z-lab, full vocabulary already: a plain copy of the drafter as given
                trtllm.copy_drafter(Path(opts.drafter), root / TRTLLM_DRAFTER)
            how = trtllm_drafter_how(converted, opts.drafter_quant == "fp8")
            detail += f" ({given} in {RUNTIME_DRAFTER}/ for dflash-trt; {TRTLLM_DRAFTER}/: {how})"
        trtllm.drafter_in_serving_dtype(root / TRTLLM_DRAFTER)
        return detail.strip()

    def serving():
        cfg = trtllm.serve_config(opts.tp_size, dcfg.block_size, dcfg.mask_token_id, list(dcfg.target_layer_ids),
                                  opts.kv_cache_dtype, opts.max_batch_size, tcfg.max_position_embeddings)
        trtllm.write_serving_files(root / "trtllm", cfg)
        from dflash_trt.serve.triton_repository import write_model_repository

        # the model's folder -> the bundle; device / dtype auto: the GPU in the bundle's dtype where torch sees one
        # at load time, else the CPU in float32 (`dflash_trt.serve.triton_repository.auto_device_dtype`)
        write_model_repository(root / TRITON_REPO, TRITON_MODEL, **TRITON_PARAMETERS)
        state["serve_check"] = validate_with_tensorrt_llm(cfg)
        return f"(schema ok; tensorrt_llm check: {state['serve_check']})"

    def readmes():
        # sources as absolute paths: the record is read from the bundle's folder, or on another machine
        tok_file = root / "trtllm" / "target" / "tokenizer.json"
        fields = {
            "name": out.name,  # the folder itself: a symlinked --out names the folder it points to
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "models": {
                "target": {"source": str(Path(opts.target).resolve()), "architecture": (tcfg.architectures or ("?",))[0],
                           "num_hidden_layers": tcfg.num_hidden_layers, "hidden_size": tcfg.hidden_size,
                           "vocab_size": tcfg.vocab_size, "path": "trtllm/target",
                           "trtllm_checkpoint_architecture": state.get("trt_arch")},
                # path: what dflash-trt loads; trtllm_path: what serve.yaml / llm_api_example.py point at
                "drafter": {"source": str(Path(opts.drafter).resolve()), "num_hidden_layers": dcfg.num_hidden_layers,
                            "trained": dcfg.trained, "path": runtime_drafter,
                            "draft_vocab_size": dcfg.draft_vocab_size, "trtllm_path": TRTLLM_DRAFTER,
                            "trtllm_vocabulary": ("full (dflash_trt.training.export.full_vocab_copy: same weights, "
                                                  "no d2t)") if converted else "full (as given)",
                            # trtllm/drafter is never quantized (`drafter_as_given`); quantization.drafter is path's
                            "trtllm_quantization": "none",
                            # why runtime/drafter holds the drafter dflash-trt loads (`drafter_as_given`), or None
                            "as_given": given},
            },
            "quantization": {"target": opts.quant, "drafter": opts.drafter_quant, "kv_cache_dtype": opts.kv_cache_dtype,
                             "trtllm_checkpoint": state.get("trt_quant"),
                             # num_prompts: the prompts calibrated on (fewer than --calib-size when the file
                             # holds fewer); source, requested: the prompts, --calib-size (None: nothing was
                             # calibrated)
                             "calibration": {"source": None if not opts.calibrates else
                                             calibration_source(Path(opts.calib_prompts)) if opts.calib_prompts
                                             else "built-in corpus",
                                             "num_prompts": len(state.get("calib", [])),
                                             "requested": opts.calib_size if opts.calibrates else None}},
            "tp_size": opts.tp_size,
            "block_size": dcfg.block_size,
            "max_draft_len": dcfg.block_size - 1,
            "target_layer_ids": list(dcfg.target_layer_ids),
            "mask_token_id": dcfg.mask_token_id,
            "tokenizer": {"path": "trtllm/target",
                          "sha256": sha256_file(tok_file) if tok_file.is_file() else None},
            "serve_config": "trtllm/serve.yaml",
            "serve_config_check": state.get("serve_check"),
            "triton_model_repository": TRITON_REPO,
            "trtllm_checkpoint": "trtllm_checkpoint" if pre.get("engine_checkpoint", True) else None,
            "tools": tool_versions(),
        }
        # the READMEs say what the manifest records (quantization included) and are hashed with the rest
        state["fields"] = fields
        write_readmes(root, fields, [TRTLLM_DRAFTER, RUNTIME_DRAFTER] if reduced else [TRTLLM_DRAFTER])

    def manifest_and_move():
        report.manifest = write_manifest(root, state["fields"])
        for part in ("trtllm/target", TRTLLM_DRAFTER, RUNTIME_DRAFTER, "trtllm_checkpoint"):
            if part != RUNTIME_DRAFTER or reduced:
                report.sizes[part] = folder_bytes(root / part) if (root / part).is_dir() else 0
        report.sizes["total"] = folder_bytes(root)
        try:  # --out checked again: what is there may have changed while the build ran; readable modes;
            # --force: the old --out (a bundle of its own files) goes only now
            publish_out(root, "--out", opts.out, BUNDLE, opts.force, "the build", "complete bundle")
        except ConfigError as exc:
            raise BuildError(str(exc)) from exc
        return f"({len(report.manifest['files'])} files hashed)"

    for fn in (load_and_quantize, export_checkpoint, export_target, drafter, serving, readmes, manifest_and_move):
        step(fn)


def summary_table(report: BuildReport):
    """A rich Table of step times and bundle sizes."""
    from rich.table import Table

    table = Table(title=f"dflash-trt build: {report.out}")
    table.add_column("step")
    table.add_column("time", justify="right")
    for s in report.steps:
        table.add_row(s.name, f"{s.seconds:.1f} s")
    table.add_row("[bold]total", f"[bold]{report.total_seconds:.1f} s")
    table.add_section()
    for part, size in report.sizes.items():
        table.add_row(f"size {part}", f"{size / 2**20:.1f} MiB")
    return table
