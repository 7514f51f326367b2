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
from typing import TYPE_CHECKING, Any

from deepinfer.kernels.reference import YarnScaling

from .config_checks import CSA, HCA, SLIDING, ConfigError, integer, number, validate

if TYPE_CHECKING:
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
            from .config_v41 import DeepseekV41Config

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
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ConfigError(f"model_type={model_type!r} is not supported (only 'deepseek_v4', "
                          f"'deepseek_v41' or 'deepseek_v41_text')")
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
    n = integer(raw.get("num_hidden_layers", 43), "num_hidden_layers")
    out["attention_types"], out["compress_ratios"] = _layer_schedule(raw, n)
    out["num_hash_layers"] = _num_hash_layers(raw, n)
    if "partial_rotary_factor" in raw and "qk_rope_head_dim" not in raw:
        factor = number(raw["partial_rotary_factor"], "partial_rotary_factor", at_most=1.0)
        out["qk_rope_head_dim"] = int(round(integer(raw.get("head_dim", 512), "head_dim") * factor))
    for alias, name in (("intermediate_size", "moe_intermediate_size"), ("num_local_experts", "n_routed_experts")):
        if alias in raw and name not in raw:
            out[name] = integer(raw[alias], alias)
    out.update(_rope(raw))
    eos = raw.get("eos_token_id", 1)
    out["eos_token_id"] = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    out["quant"] = _quant(raw)
    if "dspark_target_layer_ids" in out:
        out["dspark_target_layer_ids"] = tuple(_list(out["dspark_target_layer_ids"], "dspark_target_layer_ids"))
    out["extra"] = {k: v for k, v in raw.items() if k.startswith("dspark_") and k not in own}
    if out["extra"]:
        raise ConfigError(f"unsupported config field(s): {', '.join(sorted(out['extra']))}")
    return out


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{name}={value!r} must be a list")
    return list(value)


def _dict(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{name}={value!r} must be a JSON object")
    return value


def _layer_schedule(raw: dict[str, Any], n: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if "layer_types" in raw and raw["layer_types"] is not None:
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        rates.update(_dict(raw.get("compress_rates") or {}, "compress_rates"))
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


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main = _dict(params.get("main") or {}, "rope_parameters.main")
        comp = params["compress"]
        out: dict[str, Any] = {}
        if "rope_theta" in main:
            out["rope_theta"] = number(main["rope_theta"], "rope_parameters.main.rope_theta")
        if "rope_theta" in comp:
            out["compress_rope_theta"] = number(comp["rope_theta"], "rope_parameters.compress.rope_theta")
        out["yarn"] = _yarn(comp, raw, "rope_parameters.compress")
        return out
    if raw.get("rope_scaling"):
        return {"yarn": _yarn(_dict(raw["rope_scaling"], "rope_scaling"), raw, "rope_scaling")}
    if params is not None:
        return {"yarn": _yarn(_dict(params, "rope_parameters"), raw, "rope_parameters")}
    return {"yarn": None}


def _yarn(spec: dict[str, Any], raw: dict[str, Any], where: str) -> YarnScaling | None:
    if not spec:
        return None
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"{where}.type={kind!r} is not supported (only 'yarn' or 'default')")
    attention_factor = spec.get("attention_factor", 1.0)
    if attention_factor not in (None, 1.0):
        raise ConfigError(f"{where}.attention_factor={attention_factor!r} must be 1.0 for DeepSeek-V4")
    if spec.get("original_max_position_embeddings") is None:
        raise ConfigError(f"{where}.original_max_position_embeddings is required for yarn")
    original = integer(spec["original_max_position_embeddings"], f"{where}.original_max_position_embeddings")
    if spec.get("factor") is None:
        factor = integer(raw.get("max_position_embeddings", 1048576), "max_position_embeddings") / original
    else:
        factor = number(spec["factor"], f"{where}.factor")
    return YarnScaling(factor=factor, original_max_position_embeddings=original,
                       beta_fast=number(spec.get("beta_fast", 32), f"{where}.beta_fast"),
                       beta_slow=number(spec.get("beta_slow", 1), f"{where}.beta_slow"))


def _quant(raw: dict[str, Any]) -> QuantConfig | None:
    qc = raw.get("quantization_config")
    if not qc:
        return None
    qc = _dict(qc, "quantization_config")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method={method!r} is not supported (only 'fp8')")
    block = qc.get("weight_block_size", [128, 128])
    if not isinstance(block, list | tuple) or len(block) != 2 or block[0] != block[1]:
        raise ConfigError(f"quantization_config.weight_block_size={block!r} must be square, e.g. [128, 128]")
    expert = qc.get("expert_dtype", raw.get("expert_dtype", "fp8"))
    if expert not in ("fp4", "fp8"):
        raise ConfigError(f"expert_dtype={expert!r} must be 'fp4' or 'fp8'")
    return QuantConfig(fp8_block=integer(block[0], "quantization_config.weight_block_size"), expert_format=expert)
