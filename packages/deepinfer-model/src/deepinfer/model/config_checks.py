"""What the V4 and V4.1 configs share (`config`, `config_v41`): range checks of one value with the
field's name in the message (`ConfigError`; `integer`, `number`, `boolean`), the attention kinds, the
integer size fields, and the parsing of the spellings both accept — `rope_fields` (the main and
compress RoPE, YaRN) and `quant_config` (`QuantConfig`). `DeepseekV4Config`'s own checks are
`config.validate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from deepinfer.kernels.reference import YarnScaling

SLIDING, CSA, HCA = "sliding", "csa", "hca"


class ConfigError(ValueError):
    """An unsupported or inconsistent config value; the message names the key."""


def integer(value: Any, name: str, lo: int = 1, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi] (hi None = unbounded), else ConfigError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        allowed = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ConfigError(f"{name}={value!r} must be an integer {allowed}")
    return value


def number(value: Any, name: str, *, above: float = 0.0, at_most: float | None = None) -> float:
    """`value` as a finite float in (above, at_most], else ConfigError naming `name` (JSON may
    spell NaN and Infinity, so finiteness is checked, not assumed)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > above
    if not ok or (at_most is not None and value > at_most):
        allowed = f"in ({above:g}, {at_most:g}]" if at_most is not None else f"> {above:g}"
        raise ConfigError(f"{name}={value!r} must be a finite number {allowed}")
    return float(value)


def boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be true or false")
    return value


# Integer size fields (each >= 1) of V4; V4.1 checks these and its own (config_v41).
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
               "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
               "n_routed_experts", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters",
               "max_position_embeddings")
# Upper bounds of fields whose absurd values load but then hang or silently ruin generation: each
# Sinkhorn iteration runs in every layer of every step (the reference uses 20), and an RMSNorm epsilon
# past 1 dwarfs unit-scale activations (1e308 makes every hidden state ~0: empty output).
MAX_SINKHORN_ITERS = 1000
MAX_NORM_EPS = 1.0
# Token ids are int32 throughout, and an embedding row per id is allocated before any weight is read:
# a vocabulary past 2**24 (over 100 times DeepSeek's 129,280) is a typo, not a model.
MAX_VOCAB_SIZE = 2**24


def check_bounds(cfg: Any) -> None:
    """The fields both versions bound from above (V4 and V4.1 configs)."""
    integer(cfg.hc_sinkhorn_iters, "hc_sinkhorn_iters", 1, MAX_SINKHORN_ITERS)
    integer(cfg.vocab_size, "vocab_size", 1, MAX_VOCAB_SIZE)
    number(cfg.rms_norm_eps, "rms_norm_eps", at_most=MAX_NORM_EPS)


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """How the checkpoint's weights are stored (dequantised to the model dtype on load)."""

    fp8_block: int = 128                  # FP8 weight block edge
    expert_format: str = "fp8"            # "fp4" (MXFP4 experts) or "fp8"


def json_dict(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{name}={value!r} must be a JSON object")
    return value


def rope_fields(raw: dict[str, Any]) -> dict[str, Any]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main = json_dict(params.get("main") or {}, "rope_parameters.main")
        comp = params["compress"]
        out: dict[str, Any] = {}
        if "rope_theta" in main:
            out["rope_theta"] = number(main["rope_theta"], "rope_parameters.main.rope_theta")
        if "rope_theta" in comp:
            out["compress_rope_theta"] = number(comp["rope_theta"], "rope_parameters.compress.rope_theta")
        out["yarn"] = _yarn(comp, raw, "rope_parameters.compress")
        return out
    if raw.get("rope_scaling"):
        return {"yarn": _yarn(json_dict(raw["rope_scaling"], "rope_scaling"), raw, "rope_scaling")}
    if params is not None:
        return {"yarn": _yarn(json_dict(params, "rope_parameters"), raw, "rope_parameters")}
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


def quant_config(raw: dict[str, Any]) -> QuantConfig | None:
    qc = raw.get("quantization_config")
    if not qc:
        return None
    qc = json_dict(qc, "quantization_config")
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
