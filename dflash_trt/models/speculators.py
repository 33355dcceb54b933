"""DFlash drafters in the vLLM `speculators` checkpoint format: read them, write them.

Source: vllm-project/speculators (`DFlashSpeculatorConfig`, `speculators_model_type: "dflash"`,
`DFlashDraftModel.save_pretrained`, its z-lab converter) and vLLM's reader of that format
(`vllm/transformers_utils/configs/speculators/algos.py`, `update_dflash`). The drafter network is the
same as the z-lab one (z-lab/dflash's); only the files say it differently:

config.json
    `speculators_model_type: "dflash"`, `architectures: ["DFlashDraftModel"]`;
    `transformer_layer_config`: the drafter's decoder config (model_type, hidden_size, heads, head_dim,
    intermediate_size, rms_norm_eps, RoPE, max_position_embeddings, layer_types; `vocab_size` is the
    TARGET's vocabulary);
    `block_size`, `mask_token_id`, `draft_vocab_size` (== vocab_size: the full vocabulary),
    `target_hidden_size` (optional);
    `aux_hidden_state_layer_ids`: Hugging Face `hidden_states` indices, i.e. z-lab `target_layer_ids` + 1
    (z-lab id l is the OUTPUT of decoder layer l = hidden_states[l + 1]; vLLM maps them back with i - 1);
    `sample_from_anchor` (False for DFlash: block position 0 holds the last verified token and is not
    drafted), `sliding_window_non_causal`; dflash-trt adds `num_target_layers` and, for an untrained
    drafter, `dflash_trt: {"untrained": true}` (speculators' config allows extra fields);
    `speculators_config`: {algorithm "dflash", proposal_methods [{proposal_type "greedy",
    speculative_tokens = block_size - 1}], default_proposal_method, verifier {name_or_path, architectures}}.
model.safetensors
    the z-lab body (`fc.weight`, `hidden_norm.weight`, `layers.N.*`, `norm.weight`); with a reduced draft
    vocabulary also `d2t` (int64 offsets, target id = draft id + d2t[draft id], the convention dflash-trt
    uses too), `t2d` (bool [vocab_size], True at the draft ids) and `lm_head.weight` [draft_vocab_size,
    hidden]: the target's lm_head rows at the draft ids, frozen during training (speculators stores them
    because runtimes cannot cut them from the target's head). Other writers also store
    `embed_tokens.weight` (the target's embedding) and the training-only `verifier_lm_head.weight` /
    `verifier_norm.weight`.

dflash-trt runs such a drafter as it runs a z-lab one: through the TARGET's embedding and lm_head rows.
The copies of them a checkpoint carries are checked against the target the drafter is paired with
(`check_target_copies`): they differ only when the drafter was trained for another target.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_trt.errors import CheckpointError, ConfigError

MODEL_TYPE_KEY = "speculators_model_type"
#: the key `zlab_config` marks its output with (DrafterConfig.checkpoint_format); not a config.json field
FORMAT_KEY = "_checkpoint_format"
#: the target's own weights a speculators checkpoint may copy in: checked, then the target's are used
TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")
#: what speculators' trainer keeps for its loss only; never used for drafting
TRAINING_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")
#: z-lab config.json keys that are not the decoder's (speculators' converter leaves them out of
#: transformer_layer_config)
_ZLAB_ONLY_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "draft_vocab_size",
                   "dflash_trt")
#: relative Frobenius distance below which a checkpoint's copy counts as the target's own weights
#: (a copy stored in bfloat16, or a target quantized to FP8, stays far below it; another model's is ~1.4)
COPY_TOLERANCE = 0.1


def is_speculators(cfg: Mapping) -> bool:
    """Whether a config.json dict is in the speculators format (has `speculators_model_type`)."""
    return isinstance(cfg, Mapping) and MODEL_TYPE_KEY in cfg


def _int_list(value, key: str, where: str, minimum: int) -> list[int]:
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= minimum for i in value)):
        raise ConfigError(f"{where}: '{key}' must be a non-empty list of integers >= {minimum}, got {value!r}; fix it "
                          "there")
    return list(value)


def _flag(value) -> bool:
    """A config flag as speculators' (pydantic) config reads it: true, 1, "true", "1", "yes", "on" are True."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on")
    return bool(value)


def zlab_config(cfg: Mapping, where: str = "drafter config.json") -> dict:
    """The z-lab config.json dict (what `DrafterConfig.from_hf_config` reads) of a speculators DFlash config.

    Raises:
        ConfigError: another speculators algorithm (e.g. eagle3), no `transformer_layer_config` object, no
            `aux_hidden_state_layer_ids` (or an id < 1: index 0 is the embedding output), no `mask_token_id`,
            `block_size` or `draft_vocab_size`,
            `sample_from_anchor: true` (a block layout DFlash does not have), or `sliding_window_non_causal:
            true` with sliding layers (dflash-trt's sliding layers are causal); each names the field.
    """
    kind = cfg.get(MODEL_TYPE_KEY)
    if kind != "dflash":
        raise ConfigError(f"{where}: a speculators '{kind}' drafter, not a DFlash one (speculators_model_type "
                          "'dflash'); dflash-trt runs DFlash drafters: give one, or train one with `dflash-trt "
                          "train-drafter`")
    layer_cfg = cfg.get("transformer_layer_config")
    if not isinstance(layer_cfg, Mapping):
        raise ConfigError(f"{where}: 'transformer_layer_config' (the drafter's decoder config) must be an object, got "
                          f"{layer_cfg!r}; re-save the drafter with speculators")
    aux = _int_list(cfg.get("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids", where, 1)
    mask = cfg.get("mask_token_id")
    if mask is None:
        raise ConfigError(f"{where} has no 'mask_token_id'; add the token id the drafter was trained with as its mask")
    for key in ("block_size", "draft_vocab_size"):  # speculators writes both; their defaults (8, 32000) are no guess
        if cfg.get(key) is None:
            raise ConfigError(f"{where} has no '{key}'; add it (speculators writes it with every DFlash drafter)")
    if _flag(cfg.get("sample_from_anchor")):
        raise ConfigError(f"{where}: 'sample_from_anchor' is true: the drafter also predicts at the block's first "
                          "position, a layout DFlash (and dflash-trt) does not have; use a drafter trained with "
                          "sample_from_anchor false")
    out = {k: v for k, v in layer_cfg.items() if k not in _ZLAB_ONLY_KEYS}
    if _flag(cfg.get("sliding_window_non_causal")) and "sliding_attention" in (out.get("layer_types") or ()):
        raise ConfigError(f"{where}: 'sliding_window_non_causal' is true, but dflash-trt's sliding_attention layers "
                          "attend causally (as z-lab's); use a drafter trained with it false")
    dflash = {"mask_token_id": mask, "target_layer_ids": [i - 1 for i in aux]}
    if cfg.get("target_hidden_size") is not None:
        dflash["target_hidden_size"] = cfg["target_hidden_size"]
    out.update(architectures=["DFlashDraftModel"], dflash_config=dflash)
    for key in ("block_size", "num_target_layers", "dflash_trt"):  # the last two: written by dflash-trt only
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    if cfg["draft_vocab_size"] != out.get("vocab_size"):
        out["draft_vocab_size"] = cfg["draft_vocab_size"]
    out[FORMAT_KEY] = "speculators"  # read by DrafterConfig (checkpoint_format), never written
    return out


def verifier_name(cfg: Mapping) -> str | None:
    """The target a speculators config names (`speculators_config.verifier.name_or_path`), or None."""
    spec = cfg.get("speculators_config")
    verifier = spec.get("verifier") if isinstance(spec, Mapping) else None
    name = verifier.get("name_or_path") if isinstance(verifier, Mapping) else None
    return name if isinstance(name, str) else None


def check_vocab_maps(d2t: torch.Tensor | None, t2d: torch.Tensor | None, vocab_size: int,
                     draft_vocab_size: int | None, folder: str | Path) -> None:
    """Check a drafter checkpoint's vocabulary maps (either format) before they index anything.

    `d2t` (offsets, target id = draft id + d2t[draft id]) must be an integer tensor of draft_vocab_size
    entries giving distinct target ids in [0, vocab_size); speculators' `t2d` (bool [vocab_size]) must mark
    exactly those ids. A full-vocabulary checkpoint (draft_vocab_size None) may carry them only as the
    identity (d2t all zeros, t2d all true).

    Raises:
        CheckpointError: naming the folder, the tensor and what is wrong with it.
    """
    where = f"drafter checkpoint {folder}"
    if d2t is not None:
        if d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool or d2t.dim() != 1:
            raise CheckpointError(f"{where}: 'd2t' is {d2t.dtype} of shape {list(d2t.shape)}; it must hold int64 offsets "
                                  "(target id = draft id + d2t[draft id]), one per draft token: re-save the drafter")
        want = vocab_size if draft_vocab_size is None else draft_vocab_size
        if draft_vocab_size is None and bool(d2t.ne(0).any()):
            raise CheckpointError(f"{where}: 'd2t' maps draft ids to other target ids, but config.json has no reduced "
                                  "draft_vocab_size (absent, or equal to the vocabulary size); add the draft_vocab_size "
                                  "the drafter was trained with")
        if d2t.numel() != want and draft_vocab_size is not None:
            raise CheckpointError(f"{where}: 'd2t' has {d2t.numel()} entries, draft_vocab_size is {want}; the checkpoint "
                                  "does not match its config.json")
        ids = torch.arange(d2t.numel()) + d2t.long().cpu()
        if d2t.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise CheckpointError(f"{where}: 'd2t' gives target ids outside [0, {vocab_size - 1}]; the checkpoint does "
                                  "not match its config.json (vocab_size)")
        if draft_vocab_size is not None and ids.unique().numel() != ids.numel():
            raise CheckpointError(f"{where}: 'd2t' gives some target id twice; each draft token must be a different "
                                  "target token: re-save the drafter")
    if t2d is not None:
        if t2d.numel() != vocab_size:
            raise CheckpointError(f"{where}: 't2d' has {t2d.numel()} entries for a vocabulary of {vocab_size}; the "
                                  "checkpoint does not match its config.json")
        marked = torch.ones(vocab_size, dtype=torch.bool)
        if draft_vocab_size is not None:
            if d2t is None:
                return  # the strict load names the missing d2t
            marked = torch.zeros(vocab_size, dtype=torch.bool)
            marked[torch.arange(d2t.numel()) + d2t.long().cpu()] = True
        if not torch.equal(marked, t2d.bool().flatten().cpu()):
            raise CheckpointError(f"{where}: 't2d' does not mark the target ids 'd2t' gives"
                                  f"{'' if draft_vocab_size is not None else ' (all of them, for the full vocabulary)'}; "
                                  "re-save the drafter (the two vocabulary maps disagree)")


@dataclass
class TargetCopies:
    """A speculators checkpoint's copies of its target's weights (`TARGET_COPIES`), kept by `load_drafter` until
    the drafter is paired with a target (`check`): `tensors` {key: tensor}, the drafter `folder`, and the
    target its config names (`speculators_config.verifier.name_or_path`, or None)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    folder: str = ""
    verifier: str | None = None

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def check(self, embed: torch.Tensor, head: torch.Tensor, draft_ids: torch.Tensor | None) -> None:
        """Compare the copies with the target's embedding / lm_head (rows at `draft_ids`, or all).

        Args:
            embed / head: the target's embedding and lm_head weights [V, H].
            draft_ids: int64 [V'] the target ids of the draft vocabulary, or None (full vocabulary).
        Raises:
            CheckpointError: a copy's shape is not the one the drafter's vocabulary and hidden size imply
                (the checkpoint is inconsistent).
            IncompatibleModelsError: a copy's relative distance to the target's weights exceeds
                `COPY_TOLERANCE`: the drafter was trained with another target.
        """
        from dflash_trt.errors import IncompatibleModelsError

        rows = head if draft_ids is None else head[draft_ids.to(head.device)]
        ours = {"embed_tokens.weight": ("embedding", embed), "lm_head.weight": ("lm_head rows", rows)}
        for key, copy in self.tensors.items():
            what, want = ours[key]
            if tuple(copy.shape) != tuple(want.shape):
                raise CheckpointError(f"drafter checkpoint {self.folder}: '{key}' (its copy of the target's {what}) has "
                                      f"shape {list(copy.shape)}, its vocabulary and hidden size imply {list(want.shape)}; "
                                      "the checkpoint is inconsistent: re-save the drafter")
            want = want.detach().float()
            distance = float((copy.to(want.device, torch.float32) - want).norm())
            if not distance <= COPY_TOLERANCE * float(want.norm()):  # NaN (a corrupt copy) is not close either
                named = f" ({self.verifier!r}, its speculators_config.verifier)" if self.verifier else ""
                raise IncompatibleModelsError(
                    f"drafter {self.folder}: its '{key}' (the target's {what}, stored by speculators) is not this "
                    f"target's: the drafter was trained with another target{named}; pair it with that target, or use a "
                    "drafter trained for this one")


def zlab_tensors(tensors: dict[str, torch.Tensor], vocab_size: int, draft_vocab_size: int | None,
                 folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split a speculators checkpoint's tensors into (the z-lab tensors, the target copies).

    The z-lab tensors are the body plus `d2t` for a reduced draft vocabulary; the target copies are
    `embed_tokens.weight` / `lm_head.weight` where the checkpoint has them (`TargetCopies`). `t2d` is
    checked against `d2t` (`check_vocab_maps`) and dropped, as are the training-only `verifier_*` tensors
    and a full-vocabulary checkpoint's identity `d2t`.

    Raises:
        CheckpointError: as `check_vocab_maps`.
    """
    check_vocab_maps(tensors.get("d2t"), tensors.get("t2d"), vocab_size, draft_vocab_size, folder)
    body = {k: v for k, v in tensors.items() if k not in TARGET_COPIES + TRAINING_ONLY + ("t2d",)}
    if draft_vocab_size is None:
        body.pop("d2t", None)
    return body, {k: tensors[k] for k in TARGET_COPIES if k in tensors}


def read_zlab(folder: str | Path, tensors: dict[str, torch.Tensor] | None = None
              ) -> tuple[dict, dict[str, torch.Tensor], TargetCopies]:
    """(z-lab config.json dict, z-lab tensors, target copies) of a drafter folder in either format.

    A z-lab folder's config and tensors are returned as they are (no copies), its `d2t` checked
    (`check_vocab_maps`); a speculators folder's are converted (`zlab_config`, `zlab_tensors`).
    `tensors`: the folder's tensors when the caller has read them already (e.g. dequantized), else they
    are read here.

    Raises:
        CheckpointError / ConfigError: as `read_config_json`, `read_tensors`, `zlab_config`, `check_vocab_maps`.
    """
    from dflash_trt.config import read_config_json
    from dflash_trt.models.loading import read_tensors

    raw = read_config_json(folder)
    tensors = read_tensors(folder) if tensors is None else tensors
    if not is_speculators(raw):
        vocab, draft_vocab = raw.get("vocab_size"), raw.get("draft_vocab_size")
        if isinstance(vocab, int) and (draft_vocab is None or isinstance(draft_vocab, int)):
            check_vocab_maps(tensors.get("d2t"), None, vocab, draft_vocab, folder)
        return raw, tensors, TargetCopies(folder=str(folder))
    cfg = zlab_config(raw, str(Path(folder) / "config.json"))
    body, copies = zlab_tensors(tensors, int(cfg.get("vocab_size") or 0), cfg.get("draft_vocab_size"), folder)
    cfg.pop(FORMAT_KEY)
    return cfg, body, TargetCopies(copies, str(folder), verifier_name(raw))


def speculators_checkpoint(zlab: dict, tensors: dict[str, torch.Tensor], head: torch.Tensor | None,
                           verifier: str | None, verifier_architectures: list[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    """The speculators config.json dict and tensors of a z-lab drafter (config dict `zlab`, tensors).

    Args:
        head: the target's lm_head weight [V, H] (needed for a reduced draft vocabulary: its rows at the
            draft ids become `lm_head.weight`, which vLLM's reader requires then); None for a full one.
        verifier / verifier_architectures: `speculators_config.verifier` (the target's name or path; None is
            written as null, which speculators reads as "no verifier to load").
    Raises:
        ConfigError: a reduced draft vocabulary without `head`.
    """
    from dflash_trt.training.vocab import draft_to_target

    dflash = dict(zlab.get("dflash_config") or {})
    block = int(zlab.get("block_size", dflash.get("block_size", 16)))
    layer_cfg = {k: v for k, v in zlab.items() if k not in _ZLAB_ONLY_KEYS}
    vocab = int(layer_cfg["vocab_size"])
    out_tensors = {k: v for k, v in tensors.items() if k != "d2t"}
    draft_vocab = zlab.get("draft_vocab_size")
    if draft_vocab is not None:
        if head is None:
            raise ConfigError("a reduced-vocabulary drafter needs the target's lm_head for the speculators format "
                              "(lm_head.weight = its rows at the draft ids); give the target")
        d2t = tensors["d2t"].long()
        ids = draft_to_target(d2t)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        dtype = next(v.dtype for v in tensors.values() if v.is_floating_point())
        out_tensors.update(d2t=d2t, t2d=t2d, **{"lm_head.weight": head.detach()[ids].to(dtype).contiguous()})
    cfg = {
        MODEL_TYPE_KEY: "dflash",
        "architectures": ["DFlashDraftModel"],
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": int(draft_vocab or vocab),
        "block_size": block,
        "mask_token_id": int(dflash["mask_token_id"]),
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in dflash["target_layer_ids"]],
        "sample_from_anchor": False,
        "sliding_window_non_causal": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }
    if dflash.get("target_hidden_size") is not None:
        cfg["target_hidden_size"] = dflash["target_hidden_size"]
    for key in ("num_target_layers", "dflash_trt"):  # extra fields, which speculators' config allows
        if zlab.get(key) is not None:
            cfg[key] = zlab[key]
    return cfg, out_tensors
