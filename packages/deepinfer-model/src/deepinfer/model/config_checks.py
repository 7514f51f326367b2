"""Range checks of DeepseekV4Config values: every numeric field against its allowed range, with the
field's name in the message (`ConfigError`). Used by `DeepseekV4Config.__post_init__` and, for the
transformers spellings that are converted before the dataclass sees them (`partial_rotary_factor`,
`rope_parameters.main.rope_theta`, `compress_rates`…), by the parser in `config`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import DeepseekV4Config

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
_POSITIVE_REALS = ("rope_theta", "compress_rope_theta", "routed_scaling_factor", "swiglu_limit", "hc_eps",
                   "rms_norm_eps")
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
