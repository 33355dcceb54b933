"""Does a drafter fit a target? Every check names the mismatch and the fix.

Used by the runtime before it loads weights, by `dflash-trt check` and by `dflash-trt build`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.config import DrafterConfig, TargetConfig, read_config_json
from dflash_trt.errors import IncompatibleModelsError
from dflash_trt.text import count


def compatibility_problems(target: TargetConfig, drafter: DrafterConfig) -> list[str]:
    """All reasons `drafter` cannot serve `target` (empty list when it can)."""
    problems = []
    if drafter.vocab_size != target.vocab_size:
        problems.append(
            f"vocab size: drafter {drafter.vocab_size} != target {target.vocab_size}; the drafter shares the "
            "target's embedding and lm_head, so it must be trained for this target's tokenizer"
        )
    if drafter.hidden_size != target.hidden_size:
        problems.append(
            f"hidden size: drafter {drafter.hidden_size} != target {target.hidden_size}; the drafter reads the "
            "target's token embeddings, so its hidden_size must equal the target's"
        )
    n = target.num_hidden_layers
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < n]
    if bad and drafter.checkpoint_format == "speculators":  # its field counts hidden_states: layer id + 1
        problems.append(
            f"aux_hidden_state_layer_ids {[i + 1 for i in drafter.target_layer_ids]}: {[i + 1 for i in bad]} outside "
            f"[1, {n}] (hidden_states indices of a target with {n} layers); set aux_hidden_state_layer_ids to layers "
            "of this target"
        )
    elif bad:
        problems.append(
            f"target_layer_ids {list(drafter.target_layer_ids)}: {bad} outside [0, {n - 1}] (the target has {n} layers); "
            "set dflash_config.target_layer_ids to layers of this target"
        )
    if drafter.target_hidden_size != target.hidden_size:
        problems.append(
            f"fc width: fc expects {drafter.fc_in_features} = {len(drafter.target_layer_ids)} x {drafter.target_hidden_size} "
            f"input features, but {len(drafter.target_layer_ids)} target layers of hidden size {target.hidden_size} give "
            f"{len(drafter.target_layer_ids) * target.hidden_size}"
        )
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        problems.append(
            f"mask_token_id {drafter.mask_token_id} is outside the target vocabulary [0, {target.vocab_size}); "
            f"set {_mask_field(drafter)} to a reserved token id of the target's tokenizer"
        )
    if drafter.num_target_layers and drafter.num_target_layers != n:
        problems.append(
            f"num_target_layers: the drafter was made for a target with {drafter.num_target_layers} layers, this "
            f"target has {n}; use the drafter trained for this target"
        )
    if drafter.draft_vocab_size is not None and not 1 <= drafter.draft_vocab_size <= target.vocab_size:
        problems.append(f"draft_vocab_size {drafter.draft_vocab_size} outside [1, {target.vocab_size}]: a draft vocabulary "
                        "is a subset of the target's; set it to the length of the drafter's d2t map, or use the "
                        "drafter made for this target")
    if drafter.block_size < 2:
        problems.append(f"block_size {drafter.block_size} < 2: a block must hold the last token and at least one mask")
    room = min(target.max_position_embeddings, drafter.max_position_embeddings)
    if drafter.block_size >= room - 1:  # a block starts at the last committed token: after a prompt of >= 2 tokens
        problems.append(f"block_size {drafter.block_size} does not fit the context ({room} positions: the target's and "
                        "the drafter's max_position_embeddings), so no block could be drafted after a prompt of 2 or "
                        "more tokens; set block_size to the one the drafter was trained with (DFlash drafters use 8-16)")
    return problems


def _mask_field(drafter: DrafterConfig) -> str:
    """The config.json field that holds the drafter's mask token id, in its checkpoint format."""
    return "mask_token_id" if drafter.checkpoint_format == "speculators" else "dflash_config.mask_token_id"


def check_compatible(target: TargetConfig, drafter: DrafterConfig) -> None:
    """Raise IncompatibleModelsError listing every problem, or return None."""
    problems = compatibility_problems(target, drafter)
    if problems:
        raise IncompatibleModelsError("drafter does not fit the target:\n  - " + "\n  - ".join(problems))


# ---------------------------------------------------------------------------------------------
# `dflash-trt check`: the config checks above plus checks that need the checkpoint folders
# ---------------------------------------------------------------------------------------------

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Finding:
    """One result of `check_checkpoints`: level ERROR (the pair cannot be served) or WARNING (it can,
    with the stated consequence); `message` names the problem and the fix."""

    level: str
    message: str


def _training_info(folder: Path) -> dict:
    """The drafter's training.json (written by train-drafter), or {} when there is none or it is not a JSON object."""
    try:
        info = json.loads((folder / "training.json").read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _training_json_problem(folder: Path) -> str | None:
    """The warning `check_checkpoints` gives when the drafter has a training.json that is not a readable JSON
    object (the checks that read it are then skipped), else None."""
    path = folder / "training.json"
    if not path.is_file() or _training_info(folder):
        return None
    return (f"training.json: {path} is not a readable JSON object (malformed, or not an object), so the checks that "
            "read it (the target it was trained for, an unfinished run) were skipped; restore it from the drafter's "
            "source, or remove it")


def _model_name(folder: Path) -> str:
    """The name a target folder goes by when a drafter's training.json target is compared with a target:
    the folder's name, except for two folders whose own name says nothing of the model: a bundle's target
    folder (`dflash-trt build` writes it as NAME/trtllm/target and records the folder it came from in
    NAME/manifest.json: that folder's name) and a Hugging Face hub snapshot
    (.../models--ORG--MODEL/snapshots/REVISION: MODEL). `folder` need not exist here (a training.json written
    on another machine)."""
    folder = Path(folder)
    for root in (folder.parent, folder.parent.parent):
        try:
            source = json.loads((root / "manifest.json").read_text())["models"]["target"]
            if (root / source["path"]).resolve() == folder.resolve():
                return Path(source["source"]).name
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.split("--")[-1]
    return folder.name


def training_target_problem(drafter_path: str | Path, target_path: str | Path) -> str | None:
    """The warning `check_checkpoints` gives when the drafter's training.json names another target than the one
    at `target_path` (`_training_target_problem`), or None; for commands that load a pair without checking it."""
    return _training_target_problem(_training_info(Path(drafter_path)), Path(target_path))


def _training_target_problem(info: dict, target_path: Path) -> str | None:
    """The warning `check_checkpoints` gives when the drafter's training.json (`info`, written by
    train-drafter: "target" is the resolved path of the target it was trained on) names another target than
    `target_path`: another folder whose name (`_model_name`, compared without case) differs too; None when
    it names this target, or records none (a drafter trained elsewhere)."""
    recorded = info.get("target")
    if not isinstance(recorded, str) or not recorded.strip():
        return None
    trained_for, here = Path(recorded), Path(target_path).resolve()
    if trained_for == here or _model_name(trained_for).casefold() == _model_name(here).casefold():
        return None
    return (f"training target: the drafter's training.json says it was trained for the target {trained_for} "
            f"({_model_name(trained_for)}), not {here} ({_model_name(here)}); fine if this target is a sibling of "
            "that one (same tokenizer and layers, e.g. a fine-tune of it), otherwise the drafter was made for "
            "another model (acceptance will be low): use the drafter trained for this target, or train one with "
            f"dflash-trt train-drafter --target {here}")


def _tokenizer_identity(folder: Path) -> tuple[str, dict[int, str]] | None:
    """(sha256 of the token->id vocabulary incl. added tokens, {id: special token}) from tokenizer.json,
    or None when the folder has no tokenizer.json.

    Raises:
        ValueError: tokenizer.json is not JSON, or not a tokenizer (the `tokenizers` library's format).
    """
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        tok = json.loads(file.read_text(encoding="utf-8"))
        vocab = tok["model"]["vocab"]
        if isinstance(vocab, list):  # unigram: [[piece, score], ...]
            if not all(isinstance(piece, list) and piece and isinstance(piece[0], str) for piece in vocab):
                raise ValueError("its model.vocab is a list, but not of [piece, score] pairs")
            vocab = {piece[0]: i for i, piece in enumerate(vocab)}
        added = [t for t in tok.get("added_tokens", []) if isinstance(t["id"], int) and isinstance(t["content"], str)]
        if not isinstance(vocab, dict) or not vocab or not all(isinstance(k, str) and isinstance(v, int)
                                                               for k, v in vocab.items()):
            raise ValueError("its model.vocab is not a map of token to id")
        if len(added) != len(tok.get("added_tokens", [])):
            raise ValueError("an added_tokens entry lacks an integer id or a string content")
        blob = json.dumps([sorted(vocab.items()), sorted((t["id"], t["content"]) for t in added)],
                          ensure_ascii=False).encode()
        special = {t["id"]: t["content"] for t in added if t.get("special")}
    except (ValueError, TypeError, AttributeError, KeyError, IndexError, OverflowError, RecursionError) as exc:
        raise ValueError(f"{file} is not a tokenizer file ({type(exc).__name__}: {exc})") from exc
    return hashlib.sha256(blob).hexdigest(), special


def _header_shapes(folder: Path) -> dict[str, tuple[list[int], str]]:
    """{key: (shape, safetensors dtype)} of every tensor of a checkpoint folder (single file or sharded
    index), read from the safetensors headers only: no tensor data is loaded.

    Raises:
        CheckpointError: no safetensors weights, a shard the index names is missing, a file that is not
            readable (truncated, corrupt), or an index that is not JSON.
    """
    from dflash_trt.models.loading import open_safetensors, safetensors_files

    found: dict[str, tuple[list[int], str]] = {}
    for file in safetensors_files(folder):  # its errors name the fix (loading gives the same)
        with open_safetensors(file) as f:
            for key in f.keys():
                s = f.get_slice(key)
                found[key] = (list(s.get_shape()), s.get_dtype())
    return found


#: per checkpoint kind: (how to fix missing keys, how to fix a tensor of the wrong shape)
_WEIGHT_FIXES = {
    "drafter": ("the weights do not match config.json (re-export the drafter)",
                "fix config.json (hidden_size, target_layer_ids, heads) or use the matching checkpoint"),
    "target": ("the weights do not match config.json (re-download or re-convert the target)",
               "config.json (vocab_size, hidden_size, intermediate_size, heads) does not describe these "
               "weights: use the config.json that came with them, or the matching checkpoint"),
}


def _mxfp4_shapes(found: dict[str, tuple[list[int], str]]) -> dict[str, tuple[list[int], str]]:
    """`found` (`_header_shapes`) with each MXFP4 pair `X_blocks` [E, out, G, 16] + `X_scales` [E, out, G] replaced
    by the tensor loading gives (`dflash_trt.models.dequant.unpack_mxfp4`): `X` [E, G * 32, out]. A lone half stays
    as it is (unexpected: loading names it)."""
    out = dict(found)
    for key, (shape, _) in found.items():
        base = key[: -len("_blocks")]
        if key.endswith("_blocks") and base + "_scales" in found and len(shape) == 4:
            del out[key], out[base + "_scales"]
            out[base] = ([shape[0], shape[2] * shape[3] * 2, shape[1]], "MXFP4")
    return out


def _weight_shape_problems(folder: Path, expected: dict[str, list[int]], what: str,
                           ignore: tuple[str, ...] = (), found: dict[str, tuple[list[int], str]] | None = None) -> list[str]:
    """What the strict load (`loading.load_strict`) would refuse in a checkpoint's weights, read from the
    safetensors headers only (`_header_shapes`): keys missing (one item naming the first five), keys of
    another shape (one item naming the first and counting the rest), unexpected keys. Quantization scales
    that loading consumes are not unexpected (all of them in a ModelOpt FP8 / NVFP4 checkpoint, only
    k_scale / v_scale in an unquantized one whose config says its KV cache is FP8); a ModelOpt NVFP4 weight (uint8, two codes per byte) is
    expected with half the columns; keys in `ignore` (a tied lm_head) may be there or not.

    Args:
        expected: {key: shape} of the module built from config.json (on the meta device).
        what: "target" or "drafter" (the messages and their fixes).
        found: the folder's `_header_shapes` when the caller has read them, else they are read here.
    Raises:
        CheckpointError: as `_header_shapes`.
    """
    from dflash_trt.models.checkpoints import KV_SCALE_SUFFIXES, kv_cache_fp8
    from dflash_trt.models.dequant import SCALE_SUFFIXES, quant_algo
    from dflash_trt.models.loading import moe_layout_hint

    missing_fix, shape_fix = _WEIGHT_FIXES[what]
    found = _header_shapes(folder) if found is None else found
    if quant_algo(folder) == "MXFP4":  # gpt-oss: X_blocks [E, out, G, 16] + X_scales load as X [E, G * 32, out]
        found = _mxfp4_shapes(found)
    problems = []
    # the scales loading consumes (`checkpoints._read_weights`): every quantization scale of a
    # ModelOpt FP8 / NVFP4 checkpoint, only the KV-cache scales of an unquantized one with an FP8 KV cache
    scales = SCALE_SUFFIXES if quant_algo(folder) is not None else KV_SCALE_SUFFIXES if kv_cache_fp8(folder) else ()
    unexpected = [k for k in found if k not in expected and k not in ignore and not (scales and k.endswith(scales))]
    if unexpected:
        problems.append(f"{what} weights: unexpected key(s) {', '.join(unexpected[:5])}"
                        f"{f' (and {len(unexpected) - 5} more)' if len(unexpected) > 5 else ''} in {folder}; "
                        "the checkpoint has weights this architecture does not use (wrong model type or config?)")
    missing = [k for k in expected if k not in found]
    if missing:
        shown = ", ".join(f"{k} {expected[k]}" for k in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        problems.append(f"{what} weights: {shown}{more} {'is' if len(missing) == 1 else 'are'} missing from "
                        f"{folder}; {missing_fix}")
    wrong = []
    for key, shape in expected.items():
        if key not in found:
            continue
        got, dtype = found[key]
        if dtype == "U8" and key.endswith(".weight") and f"{key[:-len('weight')]}weight_scale" in found and shape:
            shape = [*shape[:-1], shape[-1] // 2]  # NVFP4: two E2M1 codes per byte
        if got != shape:
            wrong.append((key, got, shape))
    if wrong:
        key, got, shape = wrong[0]
        more = f" (and {count(len(wrong) - 1, 'more tensor')} of another shape)" if len(wrong) > 1 else ""
        problems.append(f"{what} weights: {key} has shape {got}, config.json implies {shape}{more}; {shape_fix}")
    hint = moe_layout_hint([*unexpected, *missing, *(k for k, _, _ in wrong)])
    if hint:  # the last problem says which config.json fields decide the experts' layout
        problems[-1] += hint
    return problems


def _vocabulary_problems(target_path: Path, drafter_path: Path, drafter_keys: set[str]) -> list[str]:
    """What loading would refuse in the drafter's vocabulary maps (`d2t`, speculators' `t2d`) and, for a
    speculators checkpoint, in its copies of the target's embedding / lm_head rows compared with this target's
    (`dflash_trt.models.speculators`: the check the runtime makes when it pairs the two). Reads those small
    tensors of the drafter only when its `drafter_keys` (safetensors header) have them, and the target's
    embedding and lm_head only when there are copies to compare."""
    from dflash_trt.errors import DFlashError
    from dflash_trt.models.loading import read_tensors
    from dflash_trt.models.speculators import TARGET_COPIES, read_zlab
    from dflash_trt.training.vocab import draft_to_target

    keys = {"d2t", "t2d", *TARGET_COPIES} & drafter_keys
    if not keys:
        return []
    small = read_tensors(drafter_path, keys=keys)
    try:
        _, maps, copies = read_zlab(drafter_path, small)
        if not copies:
            return []
        weights = read_tensors(target_path, keys=("model.embed_tokens.weight", "lm_head.weight"))
        embed = weights["model.embed_tokens.weight"]
        copies.check(embed, weights.get("lm_head.weight", embed), None if "d2t" not in maps else draft_to_target(maps["d2t"]))
    except DFlashError as exc:  # its message names the drafter folder
        return [str(exc)]
    return []


def _nonfinite_problems(drafter_path: Path) -> list[str]:
    """What loading refuses in the drafter's weight values: NaN or infinite entries (`check_finite`; the
    drafter's tensors are read, a drafter being small next to its target, whose values are not)."""
    from dflash_trt.errors import CheckpointError
    from dflash_trt.models.loading import check_finite, read_tensors

    try:
        check_finite(read_tensors(drafter_path), "drafter", drafter_path)
    except CheckpointError as exc:
        return [str(exc)]
    return []


def _expected_shapes(module_cls, cfg) -> dict[str, list[int]]:
    """{key: shape} of `module_cls(cfg)`'s state dict, built on the meta device (no memory, no init)."""
    import torch

    with torch.device("meta"):
        return {k: list(v.shape) for k, v in module_cls(cfg).state_dict().items()}


def check_checkpoints(target_path: str | Path, drafter_path: str | Path) -> list[Finding]:
    """Every check `dflash-trt check` runs on a target folder and a drafter folder.

    Errors: unreadable configs, target or drafter weights that are missing, unreadable (truncated, a
    shard the index names absent) or do not match their config.json (read from the safetensors headers,
    no target tensor data loaded), drafter weights holding NaN or infinite values (the drafter's tensors
    are read), every `compatibility_problems` item, different tokenizers, a target without tokenizer
    files (tokenizer.json, tokenizer.model or vocab.json: the runtime cannot load it) or with tokenizer files
    transformers' AutoTokenizer cannot load (`_target_tokenizer`: e.g. a truncated tokenizer.json). Warnings: an
    untrained drafter, an unfinished training run, a drafter whose training.json names another target
    (`_training_target_problem`: a sibling target may serve), a drafter context (max_position_embeddings)
    shorter than the target's (the runtime then stops drafting near the drafter's limit and decodes one
    token per step), different RoPE settings, a mask token that is not a special token of the tokenizer.
    """
    from dflash_trt.errors import DFlashError

    target_path, drafter_path = Path(target_path), Path(drafter_path)
    try:
        target = TargetConfig.from_pretrained(target_path)
    except DFlashError as exc:
        return [Finding(ERROR, f"target: {exc}")]
    try:
        drafter = DrafterConfig.from_pretrained(drafter_path)
    except DFlashError as exc:
        return [Finding(ERROR, f"drafter: {exc}")]
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.models.target import TargetModel

    out = []
    try:
        ignore = ("lm_head.weight",) if target.tie_word_embeddings else ()  # as load_target allows
        out += [Finding(ERROR, p) for p in _weight_shape_problems(
            target_path, _expected_shapes(TargetModel, target), "target", ignore)]
    except DFlashError as exc:
        out.append(Finding(ERROR, f"target: {exc}"))
    out += [Finding(ERROR, p) for p in compatibility_problems(target, drafter)]
    from dflash_trt.models.speculators import TARGET_COPIES, TRAINING_ONLY, is_speculators

    raw = read_config_json(drafter_path)
    speculators = is_speculators(raw)
    # a speculators checkpoint's vocabulary maps and copies of the target's weights (their values: below)
    extra = TARGET_COPIES + TRAINING_ONLY + ("t2d",) + (("d2t",) if drafter.draft_vocab_size is None else ())
    try:
        found = _header_shapes(drafter_path)
        shape_problems = _weight_shape_problems(drafter_path, _expected_shapes(DFlashDrafter, drafter), "drafter",
                                                extra if speculators else (), found)
        out += [Finding(ERROR, p) for p in shape_problems]
        if not shape_problems and not any(f.level == ERROR for f in out):
            out += [Finding(ERROR, p) for p in _vocabulary_problems(target_path, drafter_path, set(found))]
        if not shape_problems:
            out += [Finding(ERROR, p) for p in _nonfinite_problems(drafter_path)]
    except DFlashError as exc:
        out.append(Finding(ERROR, f"drafter: {exc}"))
    arch = raw.get("architectures")
    if not speculators and arch != ["DFlashDraftModel"]:
        out.append(Finding(WARNING, (
            f"architectures: the drafter's config.json has {json.dumps(arch)}, not [\"DFlashDraftModel\"] (the z-lab "
            "format); dflash-trt reads it by its dflash_config, but TensorRT-LLM's, SGLang's and vLLM's DFlash loaders "
            'may not: set "architectures": ["DFlashDraftModel"]')))
    ids = list(drafter.target_layer_ids)
    if ids != sorted(ids):
        field = ("aux_hidden_state_layer_ids", [i + 1 for i in ids]) if speculators else ("target_layer_ids", ids)
        out.append(Finding(WARNING, (
            f"layer order: {field[0]} {field[1]} is not in increasing order; dflash-trt and the z-lab reference "
            "concatenate the target's hidden states in the order given, but vLLM collects its aux hidden states as the "
            "target's layers run (increasing order), so fc would get its inputs permuted there: retrain (or re-export) the "
            "drafter with sorted layer ids")))
    info = _training_info(drafter_path)
    unreadable = _training_json_problem(drafter_path)
    if unreadable is not None:
        out.append(Finding(WARNING, unreadable))
    if drafter.trained and info.get("finished") is False:
        out.append(Finding(WARNING, (
            f"unfinished: the drafter's training.json says its run stopped at step {info.get('steps')} of "
            f"{info.get('total_steps')} (a time limit or --max-steps); acceptance may be low: continue it with "
            "dflash-trt train-drafter ... --resume")))
    other_target = _training_target_problem(info, target_path)
    if other_target is not None:
        out.append(Finding(WARNING, other_target))
    if not drafter.trained:
        out.append(Finding(WARNING, (
            "untrained: the drafter's config.json marks it untrained (dflash_trt.untrained, as init-drafter writes): "
            "the target will accept almost none of its drafts (tau ~1.0, slower than --mode ar); train it with "
            "dflash-trt train-drafter --init DIR, or use a trained drafter")))
    if drafter.max_position_embeddings < target.max_position_embeddings:
        out.append(Finding(WARNING, (
            f"context: the drafter's max_position_embeddings {drafter.max_position_embeddings} is below the target's "
            f"{target.max_position_embeddings}; past position {drafter.max_position_embeddings - drafter.block_size} "
            "drafting stops and decoding continues one token per step (output unchanged, slower). Use a drafter "
            "trained for the target's context to keep the speedup")))
    if (drafter.rope_theta, drafter.rope_scaling) != (target.rope_theta, target.rope_scaling):
        out.append(Finding(WARNING, (
            f"rope: drafter rope_theta {drafter.rope_theta:g} / scaling {drafter.rope_scaling} differ from the target's "
            f"{target.rope_theta:g} / {target.rope_scaling}; fine if the drafter was trained that way, otherwise "
            "it was made for another target (acceptance will be low)")))
    tokenizer, unloadable = _target_tokenizer(target_path)
    t_tok, t_unread = None, None
    try:
        t_tok = _tokenizer_identity(target_path) if tokenizer is not None else None
    except ValueError as exc:  # it loads (AutoTokenizer), in a form this check cannot read: nothing to compare
        t_unread = f"tokenizer: {exc}; tokenizer identity and the mask token were not checked"
    try:
        d_tok = _tokenizer_identity(drafter_path)
    except ValueError as exc:  # the runtime never loads the drafter's tokenizer: not an error
        d_tok = None
        out.append(Finding(WARNING, (
            f"tokenizer: {exc}; the runtime uses the target's tokenizer, so this file is unused, but the drafter's "
            "tokenizer was not compared with the target's: replace it with the target's tokenizer.json or delete it")))
    if unloadable is not None:
        out.append(Finding(ERROR, unloadable))
    elif t_unread is not None:
        out.append(Finding(WARNING, t_unread))
    elif t_tok is None and not any((target_path / f).is_file() for f in ("tokenizer.model", "vocab.json")):
        # an error: load_pipeline, load_bundle and train-drafter's data generation all load the target's tokenizer
        # (`api.load_tokenizer`) and refuse a folder without one
        out.append(Finding(ERROR, (
            f"tokenizer: {target_path} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json); the "
            "runtime encodes prompts and decodes answers with the target's tokenizer, so generate, bench, serve and "
            "train-drafter cannot run this target, nor a bundle built from it (generate --bundle, trtllm-serve): copy "
            "the model's tokenizer files (tokenizer.json, tokenizer_config.json) into the folder")))
    elif t_tok is None:
        out.append(Finding(WARNING, f"tokenizer: {target_path} has no tokenizer.json; tokenizer identity and the mask "
                                    "token were not checked"))
    elif d_tok is not None and d_tok[0] != t_tok[0]:
        out.append(Finding(ERROR, (
            f"tokenizer: {drafter_path}/tokenizer.json differs from the target's (different vocabulary or added "
            "tokens); a drafter only works with the tokenizer it was trained on: use the drafter made for this target")))
    if t_tok is not None and 0 <= drafter.mask_token_id < target.vocab_size and drafter.mask_token_id not in t_tok[1]:
        out.append(Finding(WARNING, (
            f"mask token: id {drafter.mask_token_id} is not a special token of the target's tokenizer; it may occur "
            f"in normal text. Pick a reserved special token as {_mask_field(drafter)}")))
    elif t_tok is not None and 0 <= drafter.mask_token_id < target.vocab_size:
        streamed = _streamed_special_token(tokenizer, drafter.mask_token_id)
        if streamed is not None:
            out.append(Finding(WARNING, (
                f"mask token: id {drafter.mask_token_id} ({streamed}) is a special token that occurs in the target's "
                "text (BOS / EOS / PAD / UNK or a chat-template marker), so a block can hold it as both a mask and a "
                f"word. Pick a special token that text never holds as {_mask_field(drafter)} (init-drafter chooses one)")))
    return out


def _target_tokenizer(target_path: Path):
    """(the target's tokenizer, None), loaded as the runtime loads it (`api.load_tokenizer`: transformers'
    AutoTokenizer), or (None, the error `check_checkpoints` gives: its message names the broken file and the
    fix) when the folder has tokenizer files that do not load; (None, None) when it has none (the error for
    that is `check_checkpoints`' own)."""
    from dflash_trt.api import load_tokenizer
    from dflash_trt.errors import CheckpointError

    if not any((target_path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None, None
    try:
        return load_tokenizer(target_path), None
    except CheckpointError as exc:
        return None, ("tokenizer: the target's tokenizer does not load as the runtime loads it (transformers' "
                      "AutoTokenizer), so generate, bench, serve and train-drafter cannot run this target, nor a "
                      f"bundle built from it: {exc}")


def _streamed_special_token(tokenizer, mask_id: int) -> str | None:
    """The token string of `mask_id` when it is a special token that occurs in the token streams of the
    target's `tokenizer` (`dflash_trt.models.mask_token.streamed_special_ids`), else None."""
    from dflash_trt.models.mask_token import streamed_special_ids, token_name

    return token_name(tokenizer, mask_id) if mask_id in streamed_special_ids(tokenizer) else None
