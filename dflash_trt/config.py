"""Frozen model configs for targets and DFlash drafters, built from Hugging Face config.json.

`TargetConfig` covers the Llama, Mistral, Qwen2 (Qwen2.5), Qwen3, Qwen3-MoE and gpt-oss decoder families; `DrafterConfig` the DFlash drafter
checkpoint format of z-lab/dflash and NVIDIA ModelOpt (DFlash paper, arXiv 2602.06036, sec. 3).
Both are immutable: tensor parallelism and quantization never edit a config in place.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dflash_trt.errors import ConfigError

SUPPORTED_TARGET_TYPES = ("llama", "qwen3", "qwen3_moe", "qwen2", "mistral", "gpt_oss")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: a drafter layer's attention: non-causal over context + block, or causal and windowed
LAYER_TYPES = ("full_attention", "sliding_attention")


def _as_dict(hf_config: Any, where: str) -> dict:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise ConfigError(f"{where} must hold one JSON object (a config.json dict or a transformers PretrainedConfig), "
                      f"got {type(hf_config).__name__}")


_NO_DEFAULT = object()


def _int(value: Any, key: str, where: str, default: Any = _NO_DEFAULT, minimum: int | None = None) -> int:
    """`value` of config.json field `key` as an int: JSON integers only (an integral float such as 16.0
    too); None or absent -> `default` when one is given. `minimum`: the smallest value taken.

    Raises:
        ConfigError: a string, a fraction, a bool, a list... ("block_size must be an integer, got '16'"),
            a value under `minimum`, or None without a default (as `_require`).
    """
    if value is None:
        if default is _NO_DEFAULT:
            raise ConfigError(f"{where} has no '{key}'; add it (see the model's HF card)")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: '{key}' must be an integer, got {value!r} ({type(value).__name__}); fix it there")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where}: '{key}' must be at least {minimum}, got {value}; fix it there")
    return value


def _swap_hint(flag: str | None, want: str) -> str:
    """The fix a config of the wrong kind names: `want` (e.g. "the target model's folder") as `flag` (the
    caller's option, e.g. "--target", "SRC"); without `flag`, the pair of a command that takes both
    --target and --drafter."""
    if flag is None:
        return "were the target and the drafter swapped? Give the drafter as --drafter and the target as --target"
    return f"give {want} as {flag}"


#: the fields each rope scaling type needs (dflash_trt.models.layers.RotaryEmbedding reads them)
ROPE_REQUIRED = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _float(value: Any, key: str, where: str, default: Any = _NO_DEFAULT, positive: bool = False) -> float:
    """`value` of config.json field `key` as a float: a JSON number (not a bool); None or absent ->
    `default` when one is given. `positive`: a finite number > 0 only (NaN, inf, 0 and below refused).

    Raises:
        ConfigError: a string, a bool, a list... naming the field, a value `positive` refuses, or None
            without a default.
    """
    if value is None:
        if default is _NO_DEFAULT:
            raise ConfigError(f"{where} has no '{key}'; add it (see the model's HF card)")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: '{key}' must be a number, got {value!r} ({type(value).__name__}); fix it there")
    if positive and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{where}: '{key}' must be a finite number > 0, got {value!r}; fix it there")
    return float(value)


def _bool(value: Any, key: str, where: str, default: bool) -> bool:
    """`value` of config.json field `key`: JSON true / false; None or absent -> `default`.

    Raises:
        ConfigError: anything else ("no", 0, "false") naming the field.
    """
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: '{key}' must be true or false, got {value!r} ({type(value).__name__}); fix it "
                          "there")
    return value


def _rope_from_hf(cfg: dict, where: str = "target config.json") -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers<5 (`rope_theta`, `rope_scaling`) or
    transformers>=5 (`rope_parameters`) config layouts. rope_scaling is None for plain RoPE.

    Raises:
        ConfigError: rope_theta not a number, rope_scaling not an object, an unsupported rope type, or a
            field its type needs missing or not a number (`ROPE_REQUIRED`).
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" in params:
        theta = _float(params["rope_theta"], "rope_parameters.rope_theta", where, positive=True)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        key = "rope_parameters"
    else:
        theta = _float(cfg.get("rope_theta"), "rope_theta", where, 10000.0, positive=True)
        raw, key = cfg.get("rope_scaling"), "rope_scaling"
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: 'rope_scaling' must be an object such as {{\"rope_type\": \"linear\", "
                              f"\"factor\": 2.0}} or null, got {raw!r}; fix it there")
        scaling = dict(raw) if raw else None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"{where}: rope scaling type '{rope_type}' is not supported; supported: "
                              f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        for field in ROPE_REQUIRED.get(rope_type, ()):
            _float(scaling.get(field), f"{key}.{field}", where, positive=True)  # present, a number > 0
        for field in ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow"):
            if scaling.get(field) is not None:
                _float(scaling[field], f"{key}.{field}", where, positive=True)
        scaling["rope_type"] = rope_type
        scaling.pop("type", None)
        if rope_type == "default":
            scaling = None
    return theta, scaling


def _target_windows(cfg: dict, model_type: str, layers: int, where: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) of a target's config.json: the window W (a query at position p sees the
    keys at positions p - W + 1 .. p) and which layers it applies to ("sliding_attention"; () = none).

    transformers' semantics (5.x, models/{qwen2,qwen3,mistral}/configuration_*.py and modeling_*.py):
    - qwen2 / qwen3: a window only with `use_sliding_window: true` (`sliding_window` is dropped otherwise);
      `layer_types` when config.json has it, else layers i >= `max_window_layers` slide;
    - mistral: `sliding_window` (null: none) on every layer (`layer_types` is ignored, as MistralModel does);
    - qwen3_moe: with `use_sliding_window: true`, `sliding_window` on every layer (Qwen3MoeModel's one mask);
    - gpt_oss: `sliding_window` (default 128) on the layers `layer_types` marks, by default the even ones
      (0, 2, ...; GptOssConfig's alternation);
    - llama: none.

    Raises:
        ConfigError: a field of the wrong type, `layer_types` of the wrong length or with unknown entries, or a
            layer marked "sliding_attention" without a window (transformers refuses it too).
    """
    if model_type == "mistral":
        window = _int(cfg.get("sliding_window"), "sliding_window", where, None, minimum=1)
        return window, ("sliding_attention",) * layers if window is not None else ()
    if model_type == "qwen3_moe":  # Qwen3MoeModel: one mask for every layer, windowed when sliding_window is set
        use = _bool(cfg.get("use_sliding_window"), "use_sliding_window", where, False)
        window = _int(cfg.get("sliding_window"), "sliding_window", where, None, minimum=1) if use else None
        return window, ("sliding_attention",) * layers if window is not None else ()
    if model_type not in ("qwen2", "qwen3", "gpt_oss"):
        return None, ()
    if model_type == "gpt_oss":  # GptOssConfig: always windowed, sliding and full layers alternating by default
        window = _int(cfg.get("sliding_window", 128), "sliding_window", where, None, minimum=1)
    else:
        use = _bool(cfg.get("use_sliding_window"), "use_sliding_window", where, False)
        window = _int(cfg.get("sliding_window"), "sliding_window", where, None, minimum=1) if use else None
    raw = cfg.get("layer_types")
    if raw is None and model_type == "gpt_oss":
        types = tuple("sliding_attention" if i % 2 == 0 and window is not None else "full_attention"
                      for i in range(layers))
    elif raw is None:
        first = _int(cfg.get("max_window_layers"), "max_window_layers", where, 28, minimum=0)
        types = tuple("sliding_attention" if window is not None and i >= first else "full_attention"
                      for i in range(layers))
    else:
        if not isinstance(raw, (list, tuple)) or len(raw) != layers or any(t not in LAYER_TYPES for t in raw):
            raise ConfigError(f"{where}: 'layer_types' must list one of {', '.join(LAYER_TYPES)} per layer "
                              f"({layers} entries), got {raw!r}; fix it there or remove it")
        types = tuple(raw)
    if window is None and "sliding_attention" in types:
        raise ConfigError(f"{where}: 'layer_types' marks layer {types.index('sliding_attention')} "
                          "'sliding_attention' but no window is set (use_sliding_window false or sliding_window "
                          "null); set use_sliding_window true and sliding_window, or make those layers "
                          "'full_attention'")
    return window, types if "sliding_attention" in types else ()


#: transformers' Qwen3MoeConfig defaults for the fields a qwen3_moe config.json may leave out
QWEN3_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": False, "decoder_sparse_step": 1}
#: transformers' GptOssConfig defaults (num_local_experts, num_experts_per_tok) and the clamp of its SwiGLU
#: (`swiglu_limit`, openai/gpt-oss-20b's config.json; transformers' GptOssExperts.limit)
GPT_OSS_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 4, "swiglu_limit": 7.0}


def _moe_fields(cfg: dict, model_type: str, where: str) -> dict:
    """The TargetConfig mixture-of-experts fields of a config.json dict: those of Qwen3MoeConfig for model_type
    "qwen3_moe" (absent ones at its defaults, `QWEN3_MOE_DEFAULTS`; the expert count as `num_experts`, or
    `num_local_experts`, the name transformers 5 writes), none for other families.

    Raises:
        ConfigError: a field of the wrong type or range, top-k above the expert count, or an mlp_only_layers
            entry that is not a layer index (named, with the valid range).
    """
    if model_type == "gpt_oss":  # every layer sparse, experts as wide as intermediate_size, top-k softmax
        d = GPT_OSS_DEFAULTS
        experts = _int(cfg.get("num_local_experts", cfg.get("num_experts")), "num_local_experts", where,
                       d["num_experts"], minimum=1)
        top_k = _int(cfg.get("num_experts_per_tok"), "num_experts_per_tok", where, d["num_experts_per_tok"], minimum=1)
        if top_k > experts:
            raise ConfigError(f"{where}: 'num_experts_per_tok' {top_k} is more than the {experts} experts "
                              "('num_local_experts'); each token is routed to at most every expert: fix it there")
        return {"num_experts": experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": _int(cfg.get("intermediate_size"), "intermediate_size", where, minimum=1),
                "norm_topk_prob": True, "attention_sinks": True,
                "swiglu_limit": _float(cfg.get("swiglu_limit"), "swiglu_limit", where, d["swiglu_limit"],
                                       positive=True)}
    if model_type != "qwen3_moe":
        return {}
    d = QWEN3_MOE_DEFAULTS
    key = "num_experts" if cfg.get("num_experts") is not None or cfg.get("num_local_experts") is None \
        else "num_local_experts"
    experts = _int(cfg.get(key), key, where, d["num_experts"], minimum=0)
    top_k = _int(cfg.get("num_experts_per_tok"), "num_experts_per_tok", where, d["num_experts_per_tok"], minimum=1)
    if experts and top_k > experts:
        raise ConfigError(f"{where}: 'num_experts_per_tok' {top_k} is more than the {experts} experts ('{key}'); each "
                          "token is routed to at most every expert: fix it there")
    layers = _int(cfg.get("num_hidden_layers"), "num_hidden_layers", where, minimum=1)
    raw = cfg.get("mlp_only_layers")
    if raw is not None and not isinstance(raw, (list, tuple)):
        raise ConfigError(f"{where}: 'mlp_only_layers' must be a list of layer indices (e.g. [0, 1]), got {raw!r}; "
                          "fix it there")
    dense = tuple(_int(i, "mlp_only_layers", where, minimum=0) for i in raw or ())
    if any(i >= layers for i in dense):
        raise ConfigError(f"{where}: 'mlp_only_layers' {list(dense)} names a layer beyond the {layers} decoder layers "
                          f"(indices 0 to {layers - 1}); fix it there")
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": _int(cfg.get("moe_intermediate_size"), "moe_intermediate_size", where,
                                      d["moe_intermediate_size"], minimum=1),
        "norm_topk_prob": _bool(cfg.get("norm_topk_prob"), "norm_topk_prob", where, d["norm_topk_prob"]),
        "decoder_sparse_step": _int(cfg.get("decoder_sparse_step"), "decoder_sparse_step", where,
                                    d["decoder_sparse_step"], minimum=1),
        "mlp_only_layers": dense,
    }


@dataclass(frozen=True)
class TargetConfig:
    """Shape and numerics of a Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / gpt-oss decoder-only target.

    `head_dim` defaults to hidden_size // num_attention_heads (Llama) when config.json omits it.
    `qk_norm` is True for Qwen3 (per-head RMSNorm on q and k before RoPE).
    `attention_bias`: biases on q/k/v/o (Llama's flag); `qkv_bias`: biases on q/k/v only (Qwen2, whose
    o_proj has none). `sliding_window` W and `layer_types`: the layers marked "sliding_attention" attend
    to the last W positions only (query position p: keys p - W + 1 .. p); () = every layer full.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=True)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    architectures: tuple[str, ...] = ()
    #: Qwen3-MoE (`qwen3_moe`; transformers' Qwen3MoeConfig names): routed experts per sparse layer (0: none,
    #: every layer dense), experts per token (top-k), each expert's MLP width, whether the top-k routing weights
    #: are renormalized to sum to 1, and which layers are sparse (`is_sparse_layer`). Unused by other families.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    #: gpt-oss (`gpt_oss`): a learned attention sink per head (`self_attn.sinks`, one more logit in each
    #: softmax denominator) and the clamp of its experts' SwiGLU (`swiglu_limit`); every layer sparse, routed by
    #: a softmax over the top-k router logits (`dflash_trt.models.moe.GptOssMoeBlock`). Unused by other families.
    attention_sinks: bool = False
    swiglu_limit: float = 0.0

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` (0-based) has a sparse mixture-of-experts MLP
        (`dflash_trt.models.moe.SparseMoeBlock`) rather than a dense one of `intermediate_size`: a layer not
        in `mlp_only_layers` whose (layer_idx + 1) is a multiple of `decoder_sparse_step` (transformers'
        Qwen3MoeDecoderLayer), in a config with experts."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def is_moe(self) -> bool:
        """Whether any decoder layer is a sparse mixture-of-experts layer."""
        return any(self.is_sparse_layer(i) for i in range(self.num_hidden_layers))

    @property
    def dense_intermediate_size(self) -> int:
        """`intermediate_size` where some decoder layer has a dense MLP, else 0 (a mixture-of-experts target
        whose every layer is sparse, e.g. Qwen3-30B-A3B, never uses that width): the width tensor parallelism
        must split."""
        dense = any(not self.is_sparse_layer(i) for i in range(self.num_hidden_layers))
        return self.intermediate_size if dense else 0

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (positions a query sees, itself included), None: full."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_hf_config(cls, hf_config: Any, flag: str | None = None, source: str | None = None) -> "TargetConfig":
        """Build from a config.json dict or a `transformers.PretrainedConfig`.

        `flag`: the option that gave the folder (e.g. "--target"), named by the fix when the config is a
        drafter's; None: a command with both --target and --drafter (the two may be swapped). `source`:
        the config.json path the messages name (default "target config.json").

        Raises:
            ConfigError: a DFlash drafter's config (swapped folders), unsupported model_type / rope type,
                a required field missing, or a field of the wrong type or range (named).
        """
        where = source or "target config.json"
        cfg = _as_dict(hf_config, where)
        model_type = cfg.get("model_type")
        if "dflash_config" in cfg or "DFlashDraftModel" in (cfg.get("architectures") or ()):
            raise ConfigError("this config.json is a DFlash drafter's (DFlashDraftModel), not a target model's: "
                              + _swap_hint(flag, "the target model's folder"))
        if model_type is None:
            raise ConfigError(f"{where} has no model_type: it is not a Hugging Face model's config.json; give the "
                              "folder of a Hugging Face model (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE or gpt-oss) as "
                              f"{flag or '--target'}")
        if model_type not in SUPPORTED_TARGET_TYPES:
            raise ConfigError(
                f"target model_type '{model_type}' is not supported; supported: {', '.join(SUPPORTED_TARGET_TYPES)}"
            )
        def size(key: str, default: Any = _NO_DEFAULT) -> int:
            return _int(cfg.get(key), key, where, default, minimum=1)

        hidden = size("hidden_size")
        heads = size("num_attention_heads")
        theta, scaling = _rope_from_hf(cfg, where)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((int(eos),) if eos is not None else ())
        kv_heads = size("num_key_value_heads", heads)
        window, layer_types = _target_windows(cfg, model_type, size("num_hidden_layers"), where)
        fixed_bias = model_type in ("qwen2", "mistral")
        gpt_oss = model_type == "gpt_oss"  # GptOssConfig's defaults: biased attention, eps 1e-5, theta 150000
        if heads % kv_heads:
            raise ConfigError(f"{where}: 'num_attention_heads' {heads} is not a multiple of 'num_key_value_heads' "
                              f"{kv_heads} (each KV head serves a whole group of query heads); fix it there")
        return cls(
            model_type=model_type,
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_hidden_layers=size("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=size("head_dim", hidden // heads),
            max_position_embeddings=size("max_position_embeddings", 2048),
            rms_norm_eps=_float(cfg.get("rms_norm_eps"), "rms_norm_eps", where, 1e-5 if gpt_oss else 1e-6, positive=True),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=_bool(cfg.get("tie_word_embeddings"), "tie_word_embeddings", where, False),
            # Qwen2 (q/k/v biases, `qkv_bias`) and Mistral have fixed biases: transformers ignores these flags there
            attention_bias=_bool(cfg.get("attention_bias"), "attention_bias", where, gpt_oss) and not fixed_bias,
            mlp_bias=_bool(cfg.get("mlp_bias"), "mlp_bias", where, False) and not fixed_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            qkv_bias=model_type == "qwen2",
            sliding_window=window if layer_types else None,
            layer_types=layer_types,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
            architectures=tuple(cfg.get("architectures") or ()),
            **_moe_fields(cfg, model_type, where),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, flag: str | None = None) -> "TargetConfig":
        """`from_hf_config` of `path`/config.json (`flag` as there)."""
        return cls.from_hf_config(read_config_json(path), flag, str(Path(path) / "config.json"))


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """The z-lab rule for which target layers feed the drafter (DFlash paper sec. 3.1).

    n == 1 -> [L // 2]; otherwise evenly spaced from layer 1 to layer L - 3 (0-indexed), i.e.
    round(1 + i * (L - 4) / (n - 1)). Qwen3-8B (L=36, n=5) -> [1, 9, 17, 25, 33].
    Id l means the OUTPUT of decoder layer l (HF hidden_states[l + 1]).

    Each layer is named once: a target with fewer than n + 3 layers has only L - 3 layers in that
    range, and gets those (4 layers, n = 5 -> [1]; z-lab's rule repeats ids there, which
    --target-layer-ids refuses and which would only widen fc with copies).

    Raises:
        ConfigError: n < 1, or n > 1 with a target of under 4 layers (no layer in 1 .. L - 3; the
            message says to give --target-layer-ids).
    """
    if num_features < 1:
        raise ConfigError("num_features must be >= 1")
    if num_features == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ConfigError(f"a target with {num_target_layers} layers is too shallow for the default feature layers "
                          "(layers 1 to num_layers - 3); give the layers with --target-layer-ids")
    span = num_target_layers - 4
    return list(dict.fromkeys(int(round(1 + i * span / (num_features - 1))) for i in range(num_features)))


@dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter (z-lab / ModelOpt format, `architectures: ["DFlashDraftModel"]`).

    fc maps the concatenated features of `target_layer_ids` (width len(ids) * target_hidden_size)
    to `hidden_size`. `layer_types[i]` is "full_attention" (non-causal over context + block) or
    "sliding_attention" (causal, windowed). `trained` is False for drafters written by
    `dflash-trt init-drafter` (recorded as `dflash_trt.untrained` in config.json).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    target_hidden_size: int
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=True)
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    model_type: str = "qwen3"
    trained: bool = True
    #: Reduced draft vocabulary (EAGLE-3 / `speculators` convention): the drafter predicts over
    #: `draft_vocab_size` target tokens; its checkpoint then carries `d2t` [draft_vocab_size] int64
    #: offsets (target id = draft id + d2t[draft id]). None: the full target vocabulary.
    draft_vocab_size: int | None = None
    #: "z-lab" or "speculators" (vLLM's format, converted on read): the file format it was read from, for
    #: messages that name its fields; not part of the drafter's identity (compare=False), never written
    checkpoint_format: str = field(default="z-lab", compare=False)

    @classmethod
    def from_hf_config(cls, hf_config: Any, flag: str | None = None, source: str | None = None) -> "DrafterConfig":
        """Build from a drafter config.json (z-lab / ModelOpt `DFlashDraftModel`, or the vLLM `speculators`
        format with `speculators_model_type: "dflash"`, converted by `dflash_trt.models.speculators.zlab_config`).

        `flag`: the option that gave the folder (e.g. "SRC", "--init"), named by the fix when the config
        is a model's; None: a command with both --target and --drafter (the two may be swapped).
        `source`: the config.json path the messages name (default "drafter config.json").

        Raises:
            ConfigError: a model's config without dflash_config (swapped folders), a speculators config
                `zlab_config` refuses (another algorithm, a missing field), missing
                dflash_config.target_layer_ids / mask_token_id, wrong shapes, or a field of the wrong type
                or range (named).
        """
        from dflash_trt.models.speculators import FORMAT_KEY, is_speculators, zlab_config

        where = source or "drafter config.json"
        cfg = _as_dict(hf_config, where)
        if is_speculators(cfg):  # vLLM `speculators` format: the same drafter, other field names
            cfg = zlab_config(cfg, where)
        raw = cfg.get("dflash_config")
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: 'dflash_config' must be an object such as {{\"target_layer_ids\": [1, 8], "
                              f"\"mask_token_id\": 0}}, got {raw!r}; fix it there")
        dflash = dict(raw or {})
        layer_ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        if layer_ids is None:
            arch = ", ".join(cfg.get("architectures") or ())
            if not dflash and arch and "DFlashDraftModel" not in arch:
                raise ConfigError(f"this config.json is a {arch} model's, not a DFlash drafter's (no dflash_config): "
                                  + _swap_hint(flag, "a DFlash drafter's folder"))
            raise ConfigError(f"{where} has no dflash_config.target_layer_ids; add the target layers whose hidden "
                              "states feed the drafter")
        mask = dflash.get("mask_token_id", cfg.get("mask_token_id"))
        if mask is None:
            raise ConfigError(f"{where} has no dflash_config.mask_token_id; add the mask token id")
        def size(key: str, default: Any = _NO_DEFAULT) -> int:
            return _int(cfg.get(key), key, where, default, minimum=1)

        hidden = size("hidden_size")
        heads = size("num_attention_heads")
        layers = size("num_hidden_layers")
        theta, scaling = _rope_from_hf(cfg, where)
        raw_types = cfg.get("layer_types")
        if raw_types is not None and (not isinstance(raw_types, (list, tuple))
                                      or not all(isinstance(t, str) for t in raw_types)):
            raise ConfigError(f"{where}: 'layer_types' must be a list of one string per layer (e.g. "
                              f"[\"full_attention\"]), got {raw_types!r}; fix it there")
        layer_types = tuple(raw_types or ("full_attention",) * layers)
        if len(layer_types) != layers:
            raise ConfigError(f"{where}: 'layer_types' has {len(layer_types)} entries for {layers} layers; give one "
                              "per layer")
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ConfigError(f"{where}: 'layer_types' holds {', '.join(map(repr, unknown))}; each must be one of "
                              f"{', '.join(LAYER_TYPES)}")
        meta = cfg.get("dflash_trt") or {}
        if not isinstance(meta, Mapping):
            raise ConfigError(f"{where}: 'dflash_trt' (dflash-trt's own notes) must be an object, got {meta!r}; fix it "
                              "there or remove it")
        if not isinstance(layer_ids, (list, tuple)):
            raise ConfigError(f"{where}: 'dflash_config.target_layer_ids' must be a list of integers, got "
                              f"{layer_ids!r}; fix it there")
        ids = tuple(_int(i, "dflash_config.target_layer_ids", where) for i in layer_ids)
        if not ids:
            raise ConfigError(f"{where}: 'dflash_config.target_layer_ids' is empty; list the target layers whose "
                              "hidden states the drafter reads (the ones it was trained with), e.g. [1, 8, 14, 20, 27]")
        return cls(
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=size("num_key_value_heads", heads),
            head_dim=size("head_dim", hidden // heads),
            vocab_size=size("vocab_size"),
            block_size=_int(cfg.get("block_size", dflash.get("block_size")), "block_size", where, 16, minimum=2),
            mask_token_id=_int(mask, "mask_token_id" if cfg.get(FORMAT_KEY) == "speculators" else
                               "dflash_config.mask_token_id", where),
            target_layer_ids=ids,
            num_target_layers=_int(cfg.get("num_target_layers"), "num_target_layers", where, 0),
            target_hidden_size=_int(dflash.get("target_hidden_size", meta.get("target_hidden_size")),
                                    "dflash_config.target_hidden_size", where, hidden),
            max_position_embeddings=size("max_position_embeddings", 32768),
            rms_norm_eps=_float(cfg.get("rms_norm_eps"), "rms_norm_eps", where, 1e-6, positive=True),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=_bool(cfg.get("attention_bias"), "attention_bias", where, False),
            layer_types=layer_types,
            sliding_window=_int(cfg.get("sliding_window"), "sliding_window", where, None, minimum=1),
            model_type=str(cfg.get("model_type", "qwen3")),
            trained=not bool(meta.get("untrained", False)),
            draft_vocab_size=_int(cfg.get("draft_vocab_size"), "draft_vocab_size", where, None, minimum=1),
            checkpoint_format=cfg.get(FORMAT_KEY, "z-lab"),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, flag: str | None = None) -> "DrafterConfig":
        """`from_hf_config` of `path`/config.json (`flag` as there)."""
        return cls.from_hf_config(read_config_json(path), flag, str(Path(path) / "config.json"))

    @property
    def fc_in_features(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    def to_hf_dict(self) -> dict:
        """The config.json of this drafter in the z-lab / ModelOpt format."""
        out = {
            "architectures": ["DFlashDraftModel"],
            "model_type": self.model_type,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "attention_bias": self.attention_bias,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }
        if self.target_hidden_size != self.hidden_size:
            out["dflash_config"]["target_hidden_size"] = self.target_hidden_size
        if not self.trained:
            out["dflash_trt"] = {"untrained": True}
        if self.draft_vocab_size is not None:
            out["draft_vocab_size"] = self.draft_vocab_size
        return out

    def replace(self, **changes: Any) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)


def read_config_json(path: str | Path) -> dict:
    """Read `path/config.json` (or `path` itself when it is a file).

    Raises:
        CheckpointError: the folder or its config.json does not exist or is not JSON.
    """
    from dflash_trt.errors import CheckpointError

    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not p.exists():
        raise CheckpointError(f"{p}: no such folder; pass the path of a Hugging Face checkpoint folder")
    if file.is_dir():
        raise CheckpointError(f"{file} is a folder, not a config.json file; a Hugging Face checkpoint folder holds its "
                              "config as a JSON file there")
    if not file.is_file():
        raise CheckpointError(f"{p}: no config.json in this folder; is it a Hugging Face checkpoint?")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        from dflash_trt.models.default import cached_copy_fix

        fix = cached_copy_fix(file) or "re-save or re-download it (a download or copy cut short leaves a truncated file)"
        raise CheckpointError(f"{file}: not valid JSON ({exc}); {fix}") from exc
