"""DeepseekV4Config: the model's hyper-parameters, read from a model folder's config.json.

Accepts the official checkpoint field names (`compress_ratios`, `num_hash_layers`,
`qk_rope_head_dim`, `rope_scaling`) and Hugging Face transformers' names (`layer_types`,
`compress_rates`, `mlp_layer_types`, `partial_rotary_factor`, `rope_parameters`). Unknown fields
and unsupported values raise `ConfigError` naming the key; nothing from the folder is executed.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from deepinfer.kernels.reference import YarnScaling

from .config_checks import (
    CSA,
    HCA,
    SIZE_FIELDS,
    SLIDING,
    ConfigError,
    QuantConfig,
    boolean,
    check_bounds,
    integer,
    json_dict,
    number,
    quant_config,
    rope_fields,
)
from .config_v41 import DeepseekV41Config

V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")

__all__ = ["CSA", "HCA", "SLIDING", "ConfigError", "DeepseekV4Config", "QuantConfig"]
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
        validate(self)

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV4Config | DeepseekV41Config:
        """Build from a config.json mapping (official or transformers field names). A DeepSeek-V4.1
        config (`model_type` deepseek_v41 / deepseek_v41_text, or a `text_config`) gives a
        `DeepseekV41Config` (see config_v41)."""
        if isinstance(raw, dict) and (raw.get("model_type") in V41_MODEL_TYPES or "text_config" in raw):
            return DeepseekV41Config.from_dict(raw)
        return cls(**_normalise(raw))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> DeepseekV4Config | DeepseekV41Config:
        """Read `<model_dir>/config.json` (plain JSON; nothing in the folder is executed).

        Raises:
            ConfigError: the file is missing, unreadable, not UTF-8, not JSON or not a JSON object, or
                a field is unsupported or out of range; the message starts with the file's path.
        """
        path = Path(model_dir) / "config.json"
        raw = read_json_object(path, ConfigError, what="a model folder needs a config.json")
        try:
            return cls.from_dict(raw)
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be read as a regular file ("does not exist", "is a symlink loop", "is a
    directory", "is a FIFO", ...), or None when it can. Checked before opening: opening a FIFO
    would block until something writes to it."""
    try:
        mode = path.stat().st_mode                    # follows symlinks
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "is a symlink loop"
        if err.errno == errno.ENAMETOOLONG:
            return "has a name too long for the file system"
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"is a symlink to {os.readlink(path)!r}, which does not exist" if path.is_symlink() \
                else "does not exist"
        return f"cannot be read: {err.strerror or err}"
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    if stat.S_ISFIFO(mode):
        return "is a FIFO (named pipe), not a file"
    if not stat.S_ISREG(mode):
        return "is not a regular file (a socket or a device)"
    return None


def read_json_object(path: Path, error: type[Exception], *, what: str) -> dict[str, Any]:
    """The JSON object in `path`; `error` naming the path and the fault otherwise (`what` says why the
    file is needed, for a missing one)."""
    problem = file_problem(path)
    if problem == "does not exist":
        raise error(f"{path} does not exist: {what}")
    if problem is not None:
        raise error(f"{path} {problem}")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise error(f"{path}: cannot be read: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text (invalid byte at offset {err.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{path}: not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except RecursionError:
        raise error(f"{path}: not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise error(f"{path}: must hold a JSON object, got a JSON {_json_kind(data)}")
    return data


def _json_kind(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def _normalise(raw: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a JSON object, got {type(raw).__name__}")
    raw = dict(raw)
    own = {f.name for f in fields(DeepseekV4Config)} - {"attention_types", "yarn", "quant", "extra"}
    _check_supported(raw, own)
    out: dict[str, Any] = {k: v for k, v in raw.items() if k in own}
    n = integer(raw.get("num_hidden_layers", 43), "num_hidden_layers")
    out["attention_types"], out["compress_ratios"] = _layer_schedule(raw, n)
    out["num_hash_layers"] = _num_hash_layers(raw, n)
    if "partial_rotary_factor" in raw and "qk_rope_head_dim" not in raw:
        factor = number(raw["partial_rotary_factor"], "partial_rotary_factor", at_most=1.0)
        out["qk_rope_head_dim"] = int(round(integer(raw.get("head_dim", 512), "head_dim") * factor))
    for alias, name in (("intermediate_size", "moe_intermediate_size"), ("num_local_experts", "n_routed_experts")):
        if alias in raw and name not in raw:
            out[name] = integer(raw[alias], alias)
    out.update(rope_fields(raw))
    eos = raw.get("eos_token_id", 1)
    out["eos_token_id"] = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    out["quant"] = quant_config(raw)
    if "dspark_target_layer_ids" in out:
        out["dspark_target_layer_ids"] = tuple(_list(out["dspark_target_layer_ids"], "dspark_target_layer_ids"))
    out["extra"] = {k: v for k, v in raw.items() if k.startswith("dspark_") and k not in own}
    if out["extra"]:
        raise ConfigError(f"unsupported config field(s): {', '.join(sorted(out['extra']))}")
    return out


def _check_supported(raw: dict[str, Any], own: set[str]) -> None:
    """Refuse another model type, a composite config, unknown fields and the architecture options V4
    does not have."""
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ConfigError(f"model_type={model_type!r} is not supported (only 'deepseek_v4', "
                          f"'deepseek_v41' or 'deepseek_v41_text')")
    if "text_config" in raw or "vision_config" in raw:
        raise ConfigError("text_config/vision_config: composite (V4.1) configs are not supported")
    unknown = sorted(k for k in raw if k not in own and k not in _IGNORED_KEYS and not k.startswith("dspark_"))
    if unknown:
        raise ConfigError(f"unsupported config field(s): {', '.join(unknown)}")
    for key, want in (("num_key_value_heads", 1), ("attention_bias", False), ("mlp_bias", False)):
        if key in raw and raw[key] != want:
            raise ConfigError(f"{key}={raw[key]!r} is not supported (must be {want!r})")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={raw['hidden_act']!r} is not supported (must be 'silu')")


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{name}={value!r} must be a list")
    return list(value)


def _layer_schedule(raw: dict[str, Any], n: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if "layer_types" in raw and raw["layer_types"] is not None:
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        rates.update(json_dict(raw.get("compress_rates") or {}, "compress_rates"))
        if "compress_rate_csa" in raw:
            rates["compressed_sparse_attention"] = raw["compress_rate_csa"]
        if "compress_rate_hca" in raw:
            rates["heavily_compressed_attention"] = raw["compress_rate_hca"]
        names = _list(raw["layer_types"], "layer_types")
        if len(names) < n:
            raise ConfigError(f"layer_types has {len(names)} entries, num_hidden_layers={n}")
        types, ratios = [], []
        for i, name in enumerate(names[:n]):
            if not isinstance(name, str) or name not in _HF_LAYER_TYPES:
                raise ConfigError(f"layer_types[{i}]={name!r} must be one of {sorted(_HF_LAYER_TYPES)}")
            types.append(_HF_LAYER_TYPES[name])
            ratios.append(0 if name == "sliding_attention" else integer(rates.get(name), f"compress_rates.{name}"))
        return tuple(types), tuple(ratios)
    if "compress_ratios" in raw:
        given = _list(raw["compress_ratios"], "compress_ratios")
        if len(given) < n:
            raise ConfigError(f"compress_ratios has {len(given)} entries, num_hidden_layers={n}")
        types, ratios = [], []
        for i, r in enumerate(given[:n]):   # trailing MTP entries are dropped
            if isinstance(r, bool) or not isinstance(r, int) or r not in _OFFICIAL_RATIOS:
                raise ConfigError(f"compress_ratios[{i}]={r!r} must be one of {sorted(_OFFICIAL_RATIOS)}")
            types.append(_OFFICIAL_RATIOS[r])
            ratios.append(r)
        return tuple(types), tuple(ratios)
    raise ConfigError("config needs `compress_ratios` (official) or `layer_types` (transformers)")


def _num_hash_layers(raw: dict[str, Any], n: int) -> int:
    if raw.get("mlp_layer_types") is not None:
        kinds = _list(raw["mlp_layer_types"], "mlp_layer_types")[:n]
        count = sum(1 for k in kinds if k == "hash_moe")
        if kinds[:count] != ["hash_moe"] * count or any(k not in ("hash_moe", "moe") for k in kinds):
            raise ConfigError("mlp_layer_types must be 'hash_moe' for a leading run of layers, then 'moe'")
        return count
    return integer(raw.get("num_hash_layers", 3), "num_hash_layers", 0, n)


_POSITIVE_REALS = ("rope_theta", "compress_rope_theta", "routed_scaling_factor", "swiglu_limit", "hc_eps",
                   "rms_norm_eps")


def validate(cfg: DeepseekV4Config) -> None:
    """Every field of `cfg` in its allowed range; raises ConfigError naming the first bad one."""
    for name in SIZE_FIELDS:
        integer(getattr(cfg, name), name)
    for name in _POSITIVE_REALS:
        number(getattr(cfg, name), name)
    check_bounds(cfg)
    n, vocab = cfg.num_hidden_layers, cfg.vocab_size
    integer(cfg.num_experts_per_tok, "num_experts_per_tok", 1, cfg.n_routed_experts)
    integer(cfg.n_shared_experts, "n_shared_experts", 0, 1)
    integer(cfg.num_hash_layers, "num_hash_layers", 0, n)
    integer(cfg.num_nextn_predict_layers, "num_nextn_predict_layers", 0)
    _schedule(cfg)
    rope = integer(cfg.qk_rope_head_dim, "qk_rope_head_dim")
    if rope % 2 or rope > cfg.head_dim:
        raise ConfigError(f"qk_rope_head_dim={rope} must be even and in (0, head_dim={cfg.head_dim}]")
    if CSA in cfg.attention_types and rope > cfg.index_head_dim:
        raise ConfigError(f"qk_rope_head_dim={rope} must be <= index_head_dim={cfg.index_head_dim} "
                          f"(CSA layers rotate the index queries too)")
    if cfg.num_attention_heads % cfg.o_groups:
        raise ConfigError(f"o_groups={cfg.o_groups} must divide num_attention_heads={cfg.num_attention_heads}")
    if cfg.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ConfigError(f"scoring_func={cfg.scoring_func!r} must be sqrtsoftplus, sigmoid or softmax")
    boolean(cfg.norm_topk_prob, "norm_topk_prob")
    if boolean(cfg.tie_word_embeddings, "tie_word_embeddings"):
        raise ConfigError("tie_word_embeddings=True is not supported for DeepSeek-V4")
    if cfg.yarn is not None:
        number(cfg.yarn.factor, "rope_scaling.factor")
        integer(cfg.yarn.original_max_position_embeddings, "rope_scaling.original_max_position_embeddings")
        number(cfg.yarn.beta_fast, "rope_scaling.beta_fast")
        number(cfg.yarn.beta_slow, "rope_scaling.beta_slow")
    if cfg.bos_token_id is not None:
        integer(cfg.bos_token_id, "bos_token_id", 0, vocab - 1)
    for i, token_id in enumerate(cfg.eos_token_id):
        integer(token_id, f"eos_token_id[{i}]", 0, vocab - 1)
    _dspark(cfg)
    if cfg.quant is not None:
        integer(cfg.quant.fp8_block, "quantization_config.weight_block_size")


def _schedule(cfg: DeepseekV4Config) -> None:
    n = cfg.num_hidden_layers
    if len(cfg.attention_types) != n or len(cfg.compress_ratios) != n:
        raise ConfigError(f"layer schedule has {len(cfg.attention_types)} entries, num_hidden_layers={n}")
    for i, (kind, ratio) in enumerate(zip(cfg.attention_types, cfg.compress_ratios)):
        if isinstance(ratio, bool) or not isinstance(ratio, int):
            raise ConfigError(f"layer {i}: compress ratio {ratio!r} must be an integer")
        if kind not in (SLIDING, CSA, HCA) or (kind == SLIDING) != (ratio == 0) or ratio < 0:
            raise ConfigError(f"layer {i}: attention type {kind!r} with compress ratio {ratio} is inconsistent")


def _dspark(cfg: DeepseekV4Config) -> None:
    if cfg.dspark_block_size is not None:
        integer(cfg.dspark_block_size, "dspark_block_size")
    if cfg.dspark_markov_rank is not None:
        integer(cfg.dspark_markov_rank, "dspark_markov_rank")
    if cfg.dspark_noise_token_id is not None:
        integer(cfg.dspark_noise_token_id, "dspark_noise_token_id", 0, cfg.vocab_size - 1)
    for i, layer in enumerate(cfg.dspark_target_layer_ids):
        integer(layer, f"dspark_target_layer_ids[{i}]", 0, cfg.num_hidden_layers - 1)
