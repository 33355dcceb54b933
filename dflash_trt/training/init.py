"""Initialise a drafter from its target's own decoder layers (a lever of TRAINING_NOTES.md).

The default drafter has the target's exact layer shapes (hidden size, heads, head_dim, MLP), so
drafter layer i can start as a copy of target layer `source_layers[i]` (by default the target's
top layers): q/k/v/o projections, MLP and both layer norms. What the target lacks is set so the
copy behaves like the original from the first step:
- `fc` selects the target feature that feeds the first copied layer (the output of layer
  source_layers[0] - 1) when that layer id is among `target_layer_ids`, else the last feature;
  `hidden_norm` takes that layer's input_layernorm weight, so the context K/V of drafter layer 0
  start as the target's own K/V of that layer;
- `q_norm` / `k_norm` (Qwen3-style per-head RMSNorm; a Llama target has none) get the mean per-head
  RMS of the target's own q / k on the given features, so attention logits keep their scale;
- the final `norm` is the target's final norm (its lm_head follows);
- a sparse mixture-of-experts source layer (Qwen3-MoE, gpt-oss) has no dense MLP to copy: the drafter
  layer's MLP keeps its initial gate/up_proj and a zero down_proj, so the copy starts as the target layer's
  attention alone and training grows its MLP. A gpt-oss layer's attention sinks and biases have no place in
  the drafter (z-lab's format): its copy starts near, not at, the target's attention.
Random weights (`init_drafter`) remain available (`init="random"`).
"""

from __future__ import annotations

import torch

from dflash_trt.errors import ConfigError
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.moe import MoeBlock
from dflash_trt.models.target import TargetModel


def default_source_layers(num_target_layers: int, num_drafter_layers: int) -> list[int]:
    """The target's top `num_drafter_layers` layers, in order.

    Raises:
        ConfigError: more drafter layers than the target has (each copies a distinct target layer).
    """
    if num_drafter_layers > num_target_layers:
        raise ConfigError(f"a drafter of {num_drafter_layers} layers cannot start as copies of the target's top "
                          f"layers: the target has only {num_target_layers}; use at most {num_target_layers} drafter "
                          "layers, or random initial weights (init='random')")
    return list(range(num_target_layers - num_drafter_layers, num_target_layers))


def _copy_shape_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ConfigError(f"cannot initialise {name} from the target: shape {list(src.shape)} != {list(dst.shape)}; "
                          "use init='random' for a drafter whose layers differ from the target's")
    dst.copy_(src)


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, target: TargetModel, source_layers: list[int] | None = None,
                     calibration_features: torch.Tensor | None = None) -> list[int]:
    """Copy target decoder layers into `drafter` in place; returns the source layer ids used.

    Weights and norms only: a drafter has no q/k/v biases (z-lab's format, `attention_bias` false), so a Qwen2
    target's are left out and its copied layers start near, not at, the target's (training starts from there).

    Args:
        calibration_features: [N, fc_in] target features of some tokens (float), used to set
            q_norm / k_norm to the target's mean per-head q / k RMS; None leaves them at 1.
    Raises:
        ConfigError: a source layer id out of range, more drafter layers than the target has (the
            default source layers, `default_source_layers`), or layer shapes that differ from the target's.
    """
    cfg, tcfg = drafter.config, target.config
    src_ids = list(source_layers) if source_layers is not None else default_source_layers(
        tcfg.num_hidden_layers, cfg.num_hidden_layers)
    if len(src_ids) != cfg.num_hidden_layers or not all(0 <= i < tcfg.num_hidden_layers for i in src_ids):
        raise ConfigError(f"source layers {src_ids} must be {cfg.num_hidden_layers} ids in [0, {tcfg.num_hidden_layers})")
    tlayers = target.model.layers
    for dl, si in zip(drafter.layers, src_ids):
        tl = tlayers[si]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _copy_shape_checked(getattr(dl.self_attn, name).weight, getattr(tl.self_attn, name).weight, name)
        if isinstance(tl.mlp, MoeBlock):  # no dense copy of experts: the MLP branch starts silent
            dl.mlp.down_proj.weight.zero_()
        else:
            for name in ("gate_proj", "up_proj", "down_proj"):
                _copy_shape_checked(getattr(dl.mlp, name).weight, getattr(tl.mlp, name).weight, name)
        dl.input_layernorm.weight.copy_(tl.input_layernorm.weight)
        dl.post_attention_layernorm.weight.copy_(tl.post_attention_layernorm.weight)
        if tl.self_attn.q_norm is not None:
            dl.self_attn.q_norm.weight.copy_(tl.self_attn.q_norm.weight)
            dl.self_attn.k_norm.weight.copy_(tl.self_attn.k_norm.weight)
    drafter.norm.weight.copy_(target.model.norm.weight)
    ids = list(cfg.target_layer_ids)
    pick = ids.index(src_ids[0] - 1) if (src_ids[0] - 1) in ids else len(ids) - 1
    h, th = cfg.hidden_size, cfg.target_hidden_size
    drafter.fc.weight.zero_()
    if h == th:
        drafter.fc.weight[:, pick * th : (pick + 1) * th] = torch.eye(h)
    drafter.hidden_norm.weight.copy_(tlayers[src_ids[0]].input_layernorm.weight)
    if calibration_features is not None and tlayers[src_ids[0]].self_attn.q_norm is None:
        x = calibration_features[:, pick * th : (pick + 1) * th].float()
        for dl, si in zip(drafter.layers, src_ids):
            xin = tlayers[si].input_layernorm(x)
            for proj, norm, heads in ((dl.self_attn.q_proj, dl.self_attn.q_norm, cfg.num_attention_heads),
                                      (dl.self_attn.k_proj, dl.self_attn.k_norm, cfg.num_key_value_heads)):
                y = proj(xin).view(x.shape[0], heads, cfg.head_dim)
                norm.weight.fill_(float(y.pow(2).mean(-1).sqrt().mean()))
    return src_ids
