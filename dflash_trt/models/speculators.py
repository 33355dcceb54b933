"""DFlash drafters in the vLLM `speculators` checkpoint format: read them, write them.

Source: vllm-project/speculators (`DFlashSpeculatorConfig`, `speculators_model_type: "dflash"`,
`DFlashDraftModel.save_pretrained`, its z-lab converter) and vLLM's reader of that format
(`vllm/transformers_utils/configs/speculators/algos.py`, `update_dflash`). The drafter network is the
same as the z-lab one (DFLASH.md sec. 3); only the files say it differently:

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
from pathlib import Path

import torch

from dflash_trt.errors import CheckpointError, ConfigError

MODEL_TYPE_KEY = "speculators_model_type"
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


def zlab_config(cfg: Mapping, where: str = "drafter config.json") -> dict:
    """The z-lab config.json dict (what `DrafterConfig.from_hf_config` reads) of a speculators DFlash config.

    Raises:
        ConfigError: another speculators algorithm (e.g. eagle3), no `transformer_layer_config` object, no
            `aux_hidden_state_layer_ids` (or an id < 1: index 0 is the embedding output), no `mask_token_id`,
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
    if cfg.get("sample_from_anchor"):
        raise ConfigError(f"{where}: 'sample_from_anchor' is true: the drafter also predicts at the block's first "
                          "position, a layout DFlash (and dflash-trt) does not have; use a drafter trained with "
                          "sample_from_anchor false")
    out = {k: v for k, v in layer_cfg.items() if k not in _ZLAB_ONLY_KEYS}
    if cfg.get("sliding_window_non_causal") and "sliding_attention" in (out.get("layer_types") or ()):
        raise ConfigError(f"{where}: 'sliding_window_non_causal' is true, but dflash-trt's sliding_attention layers "
                          "attend causally (as z-lab's); use a drafter trained with it false")
    dflash = {"mask_token_id": mask, "target_layer_ids": [i - 1 for i in aux]}
    if cfg.get("target_hidden_size") is not None:
        dflash["target_hidden_size"] = cfg["target_hidden_size"]
    out.update(architectures=["DFlashDraftModel"], dflash_config=dflash)
    for key in ("block_size", "num_target_layers", "dflash_trt"):  # the last two: written by dflash-trt only
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    draft_vocab = cfg.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != out.get("vocab_size"):
        out["draft_vocab_size"] = draft_vocab
    return out


def verifier_name(cfg: Mapping) -> str | None:
    """The target a speculators config names (`speculators_config.verifier.name_or_path`), or None."""
    spec = cfg.get("speculators_config")
    verifier = spec.get("verifier") if isinstance(spec, Mapping) else None
    name = verifier.get("name_or_path") if isinstance(verifier, Mapping) else None
    return name if isinstance(name, str) else None


def zlab_tensors(tensors: dict[str, torch.Tensor], vocab_size: int, draft_vocab_size: int | None,
                 folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split a speculators checkpoint's tensors into (the z-lab tensors, the target copies).

    The z-lab tensors are the body plus `d2t` for a reduced draft vocabulary; the target copies are
    `embed_tokens.weight` / `lm_head.weight` where the checkpoint has them (`check_target_copies`).
    `t2d` is checked against `d2t` and dropped, as are the training-only `verifier_*` tensors.

    Raises:
        CheckpointError: `t2d` does not mark exactly the target ids `d2t` gives, or a full-vocabulary
            checkpoint's `d2t` is not all zeros (naming the folder and key).
    """
    body = {k: v for k, v in tensors.items() if k not in TARGET_COPIES + TRAINING_ONLY + ("t2d",)}
    copies = {k: tensors[k] for k in TARGET_COPIES if k in tensors}
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if draft_vocab_size is None:
        if d2t is not None and bool(d2t.ne(0).any()):
            raise CheckpointError(f"drafter checkpoint {folder}: 'd2t' maps ids, but draft_vocab_size equals the vocabulary "
                                  "size; the checkpoint does not match its config.json")
        body.pop("d2t", None)
    elif t2d is not None and d2t is not None:
        marked = torch.zeros(vocab_size, dtype=torch.bool)
        ids = torch.arange(d2t.numel()) + d2t.long()
        if t2d.numel() != vocab_size or ids.min() < 0 or ids.max() >= vocab_size:
            raise CheckpointError(f"drafter checkpoint {folder}: 't2d' / 'd2t' do not fit a vocabulary of {vocab_size}; "
                                  "the checkpoint does not match its config.json")
        marked[ids] = True
        if not torch.equal(marked, t2d.bool().flatten()):
            raise CheckpointError(f"drafter checkpoint {folder}: 't2d' does not mark the target ids 'd2t' gives; "
                                  "re-save the drafter (the two vocabulary maps disagree)")
    return body, copies


def check_target_copies(copies: dict[str, torch.Tensor], embed: torch.Tensor, head: torch.Tensor,
                        draft_ids: torch.Tensor | None, where: str) -> None:
    """Check a speculators drafter's copies of the target's embedding / lm_head rows against the target.

    Args:
        copies: {"embed_tokens.weight": [V, H], "lm_head.weight": [V' or V, H]} (either may be absent).
        embed / head: the target's embedding and lm_head weights [V, H].
        draft_ids: int64 [V'] the target ids of the draft vocabulary, or None (full vocabulary).
        where: names the drafter in the message.
    Raises:
        IncompatibleModelsError: a copy's shape differs from the target's, or its relative distance to the
            target's weights exceeds `COPY_TOLERANCE`: the drafter was trained with another target.
    """
    from dflash_trt.errors import IncompatibleModelsError

    ours = {"embed_tokens.weight": embed, "lm_head.weight": head if draft_ids is None else head[draft_ids.to(head.device)]}
    for key, copy in copies.items():
        want = ours[key]
        far = copy.shape != want.shape
        if not far:
            want = want.detach().float()
            far = float((copy.to(want.device, torch.float32) - want).norm()) > COPY_TOLERANCE * float(want.norm())
        if far:
            raise IncompatibleModelsError(
                f"{where}: its '{key}' (the target's {'embedding' if key.startswith('embed') else 'lm_head rows'}, "
                "stored by speculators) is not this target's: the drafter was trained with another target; pair it "
                "with the target named by its speculators_config.verifier")


def read_zlab(folder: str | Path, tensors: dict[str, torch.Tensor] | None = None
              ) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(z-lab config.json dict, z-lab tensors, target copies) of a drafter folder in either format.

    A z-lab folder's config and tensors are returned as they are (no copies); a speculators folder's are
    converted (`zlab_config`, `zlab_tensors`). `tensors`: the folder's tensors when the caller has
    read them already (e.g. dequantized), else they are read here.

    Raises:
        CheckpointError / ConfigError: as `read_config_json`, `read_tensors`, `zlab_config`, `zlab_tensors`.
    """
    from dflash_trt.config import read_config_json
    from dflash_trt.models.loading import read_tensors

    raw = read_config_json(folder)
    tensors = read_tensors(folder) if tensors is None else tensors
    if not is_speculators(raw):
        return raw, tensors, {}
    cfg = zlab_config(raw, str(Path(folder) / "config.json"))
    body, copies = zlab_tensors(tensors, int(cfg.get("vocab_size") or 0), cfg.get("draft_vocab_size"), folder)
    return cfg, body, copies


def speculators_checkpoint(zlab: dict, tensors: dict[str, torch.Tensor], head: torch.Tensor | None,
                           verifier: str, verifier_architectures: list[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    """The speculators config.json dict and tensors of a z-lab drafter (config dict `zlab`, tensors).

    Args:
        head: the target's lm_head weight [V, H] (needed for a reduced draft vocabulary: its rows at the
            draft ids become `lm_head.weight`, which vLLM's reader requires then); None for a full one.
        verifier / verifier_architectures: `speculators_config.verifier` (the target's name or path).
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
