"""DeepseekV4Config: the model's hyper-parameters, read from a model folder's config.json.

Accepts the official checkpoint field names (`compress_ratios`, `num_hash_layers`,
`qk_rope_head_dim`, `rope_scaling`) and Hugging Face transformers' names (`layer_types`,
`compress_rates`, `mlp_layer_types`, `partial_rotary_factor`, `rope_parameters`). Unknown fields
and unsupported values raise `ConfigError` naming the key; nothing from the folder is executed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from deepinfer.kernels.reference import YarnScaling

SLIDING, CSA, HCA = "sliding", "csa", "hca"
_HF_LAYER_TYPES = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
_OFFICIAL_RATIOS = {0: SLIDING, 4: CSA, 128: HCA}

# Fields a config.json may carry that do not change inference (or are checked elsewhere).
_IGNORED_KEYS = frozenset({
    "architectures", "torch_dtype", "dtype", "transformers_version", "initializer_range", "use_cache",
    "attention_dropout", "router_aux_loss_coef", "output_router_logits", "router_jitter_noise",
    "topk_method", "pad_token_id", "_name_or_path", "output_attentions", "output_hidden_states",
    "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "tie_word_embeddings_",
    "n_group", "topk_group", "ep_size", "first_k_dense_replace", "moe_layer_freq", "kv_lora_rank",
    "qk_nope_head_dim", "v_head_dim", "max_window_layers", "use_sliding_window", "num_key_value_heads",
    "hidden_act", "attention_bias", "mlp_bias", "model_type", "quantization_config", "expert_dtype",
    "compress_rate_csa", "compress_rate_hca", "rope_scaling", "rope_parameters", "layer_types",
    "compress_ratios", "compress_rates", "mlp_layer_types", "num_hash_layers", "qk_rope_head_dim",
    "partial_rotary_factor", "intermediate_size", "num_local_experts",
})


class ConfigError(ValueError):
    """An unsupported or inconsistent config value; the message names the key."""


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """How the checkpoint's weights are stored (dequantised to the model dtype on load)."""

    fp8_block: int = 128                  # FP8 weight block edge
    expert_format: str = "fp8"            # "fp4" (MXFP4 experts) or "fp8"


@dataclass(frozen=True, slots=True)
class DeepseekV4Config:
    """DeepSeek-V4 hyper-parameters (defaults: V4-Flash). Per-layer lists have num_hidden_layers entries."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    attention_types: tuple[str, ...] = ()          # per layer: "sliding" | "csa" | "hca"
    compress_ratios: tuple[int, ...] = ()          # per layer: 0 for sliding
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnScaling | None = None                # YaRN of the compress rope (ratio > 0 layers)
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_hash_layers: int = 3
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 0
    dspark_block_size: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    tie_word_embeddings: bool = False
    quant: QuantConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV4Config:
        """Build from a config.json mapping (official or transformers field names)."""
        return cls(**_normalise(raw))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> DeepseekV4Config:
        """Read `<model_dir>/config.json` (plain JSON; nothing in the folder is executed)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} does not exist: a model folder needs a config.json")
        with path.open(encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _normalise(raw: dict[str, Any]) -> dict[str, Any]:
    raw = dict(raw)
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ConfigError(f"model_type={model_type!r} is not supported (only 'deepseek_v4')")
    if "text_config" in raw or "vision_config" in raw:
        raise ConfigError("text_config/vision_config: composite (V4.1) configs are not supported")
    own = {f.name for f in fields(DeepseekV4Config)} - {"attention_types", "yarn", "quant", "extra"}
    unknown = sorted(k for k in raw if k not in own and k not in _IGNORED_KEYS and not k.startswith("dspark_"))
    if unknown:
        raise ConfigError(f"unsupported config field(s): {', '.join(unknown)}")
    for key, want in (("num_key_value_heads", 1), ("attention_bias", False), ("mlp_bias", False)):
        if key in raw and raw[key] != want:
            raise ConfigError(f"{key}={raw[key]!r} is not supported (must be {want!r})")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={raw['hidden_act']!r} is not supported (must be 'silu')")
    out: dict[str, Any] = {k: v for k, v in raw.items() if k in own}
    n = int(raw.get("num_hidden_layers", 43))
    out["attention_types"], out["compress_ratios"] = _layer_schedule(raw, n)
    out["num_hash_layers"] = _num_hash_layers(raw, n)
    if "partial_rotary_factor" in raw and "qk_rope_head_dim" not in raw:
        out["qk_rope_head_dim"] = int(round(raw.get("head_dim", 512) * raw["partial_rotary_factor"]))
    if "intermediate_size" in raw and "moe_intermediate_size" not in raw:
        out["moe_intermediate_size"] = raw["intermediate_size"]
    out.update(_rope(raw))
    eos = raw.get("eos_token_id", 1)
    out["eos_token_id"] = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
    out["quant"] = _quant(raw)
    for key in ("dspark_target_layer_ids",):
        if key in out:
            out[key] = tuple(out[key])
    out["extra"] = {k: v for k, v in raw.items() if k.startswith("dspark_") and k not in own}
    if out["extra"]:
        raise ConfigError(f"unsupported config field(s): {', '.join(sorted(out['extra']))}")
    return out


def _layer_schedule(raw: dict[str, Any], n: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if "layer_types" in raw and raw["layer_types"] is not None:
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        rates.update(raw.get("compress_rates") or {})
        if "compress_rate_csa" in raw:
            rates["compressed_sparse_attention"] = raw["compress_rate_csa"]
        if "compress_rate_hca" in raw:
            rates["heavily_compressed_attention"] = raw["compress_rate_hca"]
        types, ratios = [], []
        for i, name in enumerate(list(raw["layer_types"])[:n]):
            if name not in _HF_LAYER_TYPES:
                raise ConfigError(f"layer_types[{i}]={name!r} must be one of {sorted(_HF_LAYER_TYPES)}")
            types.append(_HF_LAYER_TYPES[name])
            ratios.append(0 if name == "sliding_attention" else int(rates[name]))
        return tuple(types), tuple(ratios)
    if "compress_ratios" in raw:
        types, ratios = [], []
        for i, r in enumerate(list(raw["compress_ratios"])[:n]):   # trailing MTP entries are dropped
            if r not in _OFFICIAL_RATIOS:
                raise ConfigError(f"compress_ratios[{i}]={r!r} must be one of {sorted(_OFFICIAL_RATIOS)}")
            types.append(_OFFICIAL_RATIOS[r])
            ratios.append(int(r))
        return tuple(types), tuple(ratios)
    raise ConfigError("config needs `compress_ratios` (official) or `layer_types` (transformers)")


def _num_hash_layers(raw: dict[str, Any], n: int) -> int:
    if raw.get("mlp_layer_types") is not None:
        kinds = list(raw["mlp_layer_types"])[:n]
        count = sum(1 for k in kinds if k == "hash_moe")
        if kinds[:count] != ["hash_moe"] * count or any(k not in ("hash_moe", "moe") for k in kinds):
            raise ConfigError("mlp_layer_types must be 'hash_moe' for a leading run of layers, then 'moe'")
        return count
    return int(raw.get("num_hash_layers", 3))


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main, comp = params.get("main") or {}, params["compress"]
        out: dict[str, Any] = {}
        if "rope_theta" in main:
            out["rope_theta"] = float(main["rope_theta"])
        if "rope_theta" in comp:
            out["compress_rope_theta"] = float(comp["rope_theta"])
        out["yarn"] = _yarn(comp, raw)
        return out
    scaling = raw.get("rope_scaling") or (params if isinstance(params, dict) else None)
    return {"yarn": _yarn(scaling, raw) if scaling else None}


def _yarn(spec: dict[str, Any] | None, raw: dict[str, Any]) -> YarnScaling | None:
    if not spec:
        return None
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"rope_scaling.type={kind!r} is not supported (only 'yarn' or 'default')")
    attention_factor = spec.get("attention_factor", 1.0)
    if attention_factor not in (None, 1.0):
        raise ConfigError(f"rope_scaling.attention_factor={attention_factor!r} must be 1.0 for DeepSeek-V4")
    original = spec.get("original_max_position_embeddings")
    factor = spec.get("factor")
    if original is None:
        raise ConfigError("rope_scaling.original_max_position_embeddings is required for yarn")
    if factor is None:
        factor = raw.get("max_position_embeddings", 1048576) / original
    return YarnScaling(factor=float(factor), original_max_position_embeddings=int(original),
                       beta_fast=float(spec.get("beta_fast", 32)), beta_slow=float(spec.get("beta_slow", 1)))


def _quant(raw: dict[str, Any]) -> QuantConfig | None:
    qc = raw.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method={method!r} is not supported (only 'fp8')")
    block = qc.get("weight_block_size", [128, 128])
    if len(block) != 2 or block[0] != block[1]:
        raise ConfigError(f"quantization_config.weight_block_size={block!r} must be square, e.g. [128, 128]")
    expert = qc.get("expert_dtype", raw.get("expert_dtype", "fp8"))
    if expert not in ("fp4", "fp8"):
        raise ConfigError(f"expert_dtype={expert!r} must be 'fp4' or 'fp8'")
    return QuantConfig(fp8_block=int(block[0]), expert_format=expert)


def _positive(cfg: DeepseekV4Config, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be an integer >= 1")


def _validate(cfg: DeepseekV4Config) -> None:
    _positive(cfg, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
              "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
              "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "hc_mult",
              "hc_sinkhorn_iters")
    n = cfg.num_hidden_layers
    if len(cfg.attention_types) != n or len(cfg.compress_ratios) != n:
        raise ConfigError(f"layer schedule has {len(cfg.attention_types)} entries, num_hidden_layers={n}")
    for i, (kind, ratio) in enumerate(zip(cfg.attention_types, cfg.compress_ratios)):
        if kind not in (SLIDING, CSA, HCA) or (kind == SLIDING) != (ratio == 0) or ratio < 0:
            raise ConfigError(f"layer {i}: attention type {kind!r} with compress ratio {ratio} is inconsistent")
    if not (0 < cfg.qk_rope_head_dim <= cfg.head_dim and cfg.qk_rope_head_dim % 2 == 0):
        raise ConfigError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even and in (0, head_dim={cfg.head_dim}]")
    if cfg.num_attention_heads % cfg.o_groups:
        raise ConfigError(f"o_groups={cfg.o_groups} must divide num_attention_heads={cfg.num_attention_heads}")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ConfigError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be <= n_routed_experts")
    if cfg.n_shared_experts not in (0, 1):
        raise ConfigError(f"n_shared_experts={cfg.n_shared_experts} must be 0 or 1")
    if cfg.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ConfigError(f"scoring_func={cfg.scoring_func!r} must be sqrtsoftplus, sigmoid or softmax")
    if not 0 <= cfg.num_hash_layers <= n:
        raise ConfigError(f"num_hash_layers={cfg.num_hash_layers} must be in [0, {n}]")
    if not (cfg.rms_norm_eps > 0 and math.isfinite(cfg.rms_norm_eps)):
        raise ConfigError(f"rms_norm_eps={cfg.rms_norm_eps} must be > 0")
    if cfg.tie_word_embeddings:
        raise ConfigError("tie_word_embeddings=True is not supported for DeepSeek-V4")
