"""DeepseekV41Config: DeepSeek-V4.1 hyper-parameters (reference/deepseek-v4-spec.md §1.2).

Reads the released composite config (`model_type: deepseek_v41`: the text model under
`text_config`, a `vision_config` that is accepted and ignored — the engine is text-only — and
`quantization_config` at the top level) and the flat `deepseek_v41_text` config transformers
writes. Official and transformers field names are accepted (`engram_pad_token_id` /
`engram_pad_id`, `rope_scaling` / `rope_parameters`, `num_local_experts`, `intermediate_size`);
absent layer lists get transformers' defaults (the released schedule for 40 layers, else the
scaled pattern: 2 window-only layers, a ratio-2 half, a ratio-1 half; a KV source at the start of
each same-ratio run; index sources = KV sources; candidate source = the last KV source). Every value
is checked; a bad one raises `ConfigError` naming the field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any

from deepinfer.kernels.reference import YarnScaling

from .config_checks import (
    SIZE_FIELDS,
    SLIDING,
    ConfigError,
    boolean,
    check_bounds,
    integer,
    number,
    quant_config,
    rope_fields,
)

__all__ = ["CSA2", "DeepseekV41Config", "parse_v41"]

CSA2 = "csa2"
V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
_RELEASED_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
_RELEASED_KV_SOURCES = (2, 8, 14, 20)
_RELEASED_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)
_log = logging.getLogger("deepinfer.model")

# transformers' generic PreTrainedConfig fields (written when not at their default), at either level.
_GENERIC = frozenset({
    "architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "output_attentions",
    "output_hidden_states", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "finetuning_task", "use_cache", "initializer_range", "pad_token_id", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "_attn_implementation_autoset", "_commit_hash",
})
# Fields that do not change inference (training knobs, bookkeeping, values checked elsewhere).
_IGNORED = _GENERIC | frozenset({
    "architectures", "torch_dtype", "dtype", "transformers_version", "initializer_range", "use_cache",
    "attention_dropout", "router_aux_loss_coef", "output_router_logits", "router_jitter_noise", "topk_method",
    "pad_token_id", "_name_or_path", "output_attentions", "output_hidden_states", "return_dict", "model_type",
    "quantization_config", "expert_dtype", "rope_scaling", "rope_parameters", "layer_types", "hidden_act",
    "attention_bias", "num_key_value_heads", "engram_pad_token_id", "intermediate_size", "num_local_experts",
    "image_token_id", "chunk_size_feed_forward", "is_encoder_decoder",
})


@dataclass(frozen=True, slots=True)
class DeepseekV41Config:
    """DeepSeek-V4.1 hyper-parameters (defaults: V4.1-Flash). Per-layer tuples have
    num_hidden_layers entries; layer-id lists are sorted."""

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = _RELEASED_RATIOS       # per layer: 0 window only, 1 or 2 CSA2
    kv_source_layer_ids: tuple[int, ...] = _RELEASED_KV_SOURCES
    index_source_layer_ids: tuple[int, ...] = _RELEASED_INDEX_SOURCES
    candidate_source_layer_id: int = 20                        # −1: no second index level
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnScaling | None = None
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    max_position_embeddings: int = 1048576
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_vocab_size: int = 16000000
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    dspark_block_size: int | None = 5
    dspark_noise_token_id: int | None = 128799
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int | None = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = (1,)
    tie_word_embeddings: bool = False
    quant: Any = None                                          # config.QuantConfig | None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _validate(self)

    # --- what V4 code and the engine read -------------------------------------------------------
    @property
    def num_hash_layers(self) -> int:
        return 0                               # Engram replaces hash routing

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def attention_types(self) -> tuple[str, ...]:
        return tuple(SLIDING if r == 0 else CSA2 for r in self.compress_ratios)

    # --- the CSA2 roles of a layer ----------------------------------------------------------------
    def kv_source_of(self, layer: int) -> int | None:
        """The KV source whose compressed KV layer `layer` attends to (the closest at or before it)."""
        if self.compress_ratios[layer] == 0:
            return None
        return max((s for s in self.kv_source_layer_ids if s <= layer), default=None)

    def key_source_of(self, layer: int) -> int | None:
        """The layer whose index keys index source `layer` scores: the closest at or before it that is
        both a KV source and an index source (only those project keys)."""
        return max((s for s in self.kv_source_layer_ids if s <= layer and s in self.index_source_layer_ids),
                   default=None)

    @property
    def num_encoder_layers(self) -> int:
        """Layers before the CED decoder (the first ratio-1 layer); their window rings are the
        stored state region. All layers when there is no ratio-1 layer."""
        return next((i for i, r in enumerate(self.compress_ratios) if r == 1), self.num_hidden_layers)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV41Config:
        """Build from a composite (`deepseek_v41`) or flat (`deepseek_v41_text`) config mapping."""
        return cls(**parse_v41(raw))


def parse_v41(raw: dict[str, Any]) -> dict[str, Any]:
    """DeepseekV41Config keyword arguments from a config.json mapping (see the module docstring)."""
    raw, quant_raw = _text_fields(dict(raw))
    own = {f.name for f in fields(DeepseekV41Config)} - {"yarn", "quant", "extra"}
    _check_supported(raw, own)
    out: dict[str, Any] = {k: v for k, v in raw.items() if k in own}
    for alias, name in (("intermediate_size", "moe_intermediate_size"), ("num_local_experts", "n_routed_experts"),
                        ("engram_pad_token_id", "engram_pad_id")):
        if alias in raw and name not in raw:
            out[name] = raw[alias]
    n = integer(raw.get("num_hidden_layers", 40), "num_hidden_layers")
    nextn = integer(raw.get("num_nextn_predict_layers", 3), "num_nextn_predict_layers", 0)
    out.update(_schedule(raw, n, nextn))
    for key in ("engram_layer_ids", "engram_num_embeddings"):
        out[key] = tuple(_ints(raw.get(key) or [], key))
    if "engram_num_embeddings" not in raw or raw["engram_num_embeddings"] is None:
        out["engram_num_embeddings"] = (0,) * len(out["engram_layer_ids"])
    rope: dict[str, Any] = {k: raw[k] for k in ("rope_parameters", "rope_scaling", "max_position_embeddings")
                            if k in raw}
    out.update(rope_fields(rope))  # shared with V4 (same spellings)
    eos = raw.get("eos_token_id", 1)
    out["eos_token_id"] = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    expert_dtype = raw.get("expert_dtype")
    if quant_raw:
        quant_raw = dict(_object(quant_raw, "quantization_config"))
        if expert_dtype is not None and "expert_dtype" not in quant_raw:
            quant_raw["expert_dtype"] = expert_dtype
    out["quant"] = quant_config({"quantization_config": quant_raw} if quant_raw else {})
    return out


def _text_fields(raw: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(the text model's fields, the quantization_config) of a flat `deepseek_v41_text` config, or of a
    composite `deepseek_v41` one's `text_config` (its own BOS / EOS / tie fields filling the gaps)."""
    model_type = raw.get("model_type")
    quant_raw = raw.get("quantization_config")
    if model_type != "deepseek_v41" and "text_config" not in raw:
        if model_type != "deepseek_v41_text":
            raise ConfigError(f"model_type={model_type!r} must be 'deepseek_v41' or 'deepseek_v41_text'")
        return raw, quant_raw
    unknown = sorted(set(raw) - _GENERIC - {"text_config", "vision_config", "image_token_id",
                                            "quantization_config", "model_type"})
    if unknown:
        raise ConfigError(f"unsupported config field(s): {', '.join(unknown)}")
    if "vision_config" in raw:
        _log.info("vision_config ignored: deepinfer serves the text model of DeepSeek-V4.1 only")
    text = raw.get("text_config")
    if text is None:
        text = {}
    if not isinstance(text, dict):
        raise ConfigError(f"text_config={text!r} must be a JSON object")
    text = dict(text)
    if text.get("model_type", "deepseek_v41_text") != "deepseek_v41_text":
        raise ConfigError(f"text_config.model_type={text['model_type']!r} must be 'deepseek_v41_text'")
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
        if key in raw and key not in text:
            text[key] = raw[key]
    return text, quant_raw if quant_raw is not None else text.get("quantization_config")


def _check_supported(raw: dict[str, Any], own: set[str]) -> None:
    unknown = sorted(k for k in raw if k not in own and k not in _IGNORED)
    if unknown:
        raise ConfigError(f"unsupported config field(s): {', '.join(unknown)}")
    for key, want in (("num_key_value_heads", 1), ("attention_bias", False)):
        if key in raw and raw[key] != want:
            raise ConfigError(f"{key}={raw[key]!r} is not supported (must be {want!r})")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={raw['hidden_act']!r} is not supported (must be 'silu')")
    if raw.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"topk_method={raw['topk_method']!r} is not supported (must be 'noaux_tc')")


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{name}={value!r} must be a JSON object")
    return value


def _ints(value: Any, name: str) -> list[int]:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{name}={value!r} must be a list of integers")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{name}[{i}]={v!r} must be an integer")
    return list(value)


def _schedule(raw: dict[str, Any], n: int, nextn: int) -> dict[str, Any]:
    """compress_ratios (trailing draft entries cut) and the source lists, with transformers' defaults."""
    ratios = _compress_ratios(raw.get("compress_ratios"), n, nextn)
    if raw.get("kv_source_layer_ids") is not None:
        kv = _ints(raw["kv_source_layer_ids"], "kv_source_layer_ids")
    elif ratios == list(_RELEASED_RATIOS[:n]) and n == len(_RELEASED_RATIOS):
        kv = list(_RELEASED_KV_SOURCES)
    else:
        kv = [i for i in range(n) if ratios[i] > 0 and (i == 0 or ratios[i - 1] != ratios[i])]
    if raw.get("index_source_layer_ids") is not None:
        index = _ints(raw["index_source_layer_ids"], "index_source_layer_ids")
    else:
        index = list(_RELEASED_INDEX_SOURCES) if kv == list(_RELEASED_KV_SOURCES) else list(kv)
    candidate = _candidate_source(raw.get("candidate_source_layer_id"), kv)
    if raw.get("dspark_target_layer_ids") is not None:
        targets = _ints(raw["dspark_target_layer_ids"], "dspark_target_layer_ids")
    else:
        targets = sorted([i for i in range(n) if i not in kv][-3:])
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        want = ["shared_compressed_attention" if i in kv else "sliding_attention" for i in range(n)]
        if not isinstance(layer_types, list) or list(layer_types[:n]) != want:
            raise ConfigError(f"layer_types={layer_types!r} disagrees with kv_source_layer_ids={kv} "
                              f"(expected {want})")
    return {"compress_ratios": tuple(ratios), "kv_source_layer_ids": tuple(kv), "index_source_layer_ids":
            tuple(index), "candidate_source_layer_id": candidate, "dspark_target_layer_ids": tuple(targets)}


def _compress_ratios(given: Any, n: int, nextn: int) -> list[int]:
    """The n layers' ratios: as given (draft layers' trailing zeros cut), else transformers' default."""
    if given is None:
        if n == len(_RELEASED_RATIOS):
            ratios = list(_RELEASED_RATIOS)
        else:
            slide = min(2, n)
            enc = max(0, (n - slide + 1) // 2)
            ratios = [0] * slide + [2] * enc + [1] * max(0, n - slide - enc)
    else:
        ratios = _ints(given, "compress_ratios")
        if len(ratios) < n:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries, num_hidden_layers={n}")
        if len(ratios) > n + nextn:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries, more than num_hidden_layers + "
                              f"num_nextn_predict_layers = {n + nextn}")
        for i, r in enumerate(ratios[n:]):
            if r != 0:
                raise ConfigError(f"compress_ratios[{n + i}]={r} must be 0 (a draft layer is window-only)")
        ratios = ratios[:n]
    for i, r in enumerate(ratios):
        if r not in (0, 1, 2):
            raise ConfigError(f"compress_ratios[{i}]={r!r} must be 0, 1 or 2 for DeepSeek-V4.1")
    return ratios


def _candidate_source(candidate: Any, kv: list[int]) -> int:
    """candidate_source_layer_id as given (negative: none, -1), else the last KV source."""
    if candidate is None:
        return kv[-1] if kv else -1
    if isinstance(candidate, bool) or not isinstance(candidate, int):
        raise ConfigError(f"candidate_source_layer_id={candidate!r} must be an integer")
    return max(candidate, -1)


_SIZES = SIZE_FIELDS + ("candidate_topk_blocks", "candidate_block_size", "engram_vocab_size", "engram_n_heads",
                       "engram_head_dim", "engram_compressed_vocab_size", "dspark_n_routed_experts",
                       "dspark_num_experts_per_tok")
_POSITIVE_REALS = ("rope_theta", "compress_rope_theta", "routed_scaling_factor", "hc_eps", "rms_norm_eps",
                   "gate_temp")


def _validate(cfg: DeepseekV41Config) -> None:
    for name in _SIZES:
        integer(getattr(cfg, name), name)
    for name in _POSITIVE_REALS:
        number(getattr(cfg, name), name)
    check_bounds(cfg)
    n, vocab = cfg.num_hidden_layers, cfg.vocab_size
    integer(cfg.num_experts_per_tok, "num_experts_per_tok", 1, cfg.n_routed_experts)
    integer(cfg.n_shared_experts, "n_shared_experts", 0, 1)     # V4.1 always has its one shared expert
    number(cfg.swiglu_limit, "swiglu_limit", above=-1.0)
    if cfg.swiglu_limit < 0:
        raise ConfigError(f"swiglu_limit={cfg.swiglu_limit!r} must be >= 0 (0: no clamp)")
    integer(cfg.num_nextn_predict_layers, "num_nextn_predict_layers", 0)
    integer(cfg.engram_max_ngram_size, "engram_max_ngram_size", 2)
    integer(cfg.engram_pad_id, "engram_pad_id", 0, vocab - 1)
    if cfg.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ConfigError(f"scoring_func={cfg.scoring_func!r} must be sqrtsoftplus, sigmoid or softmax")
    boolean(cfg.norm_topk_prob, "norm_topk_prob")
    if boolean(cfg.tie_word_embeddings, "tie_word_embeddings"):
        raise ConfigError("tie_word_embeddings=True is not supported for DeepSeek-V4.1")
    _validate_sources(cfg)
    rope = integer(cfg.qk_rope_head_dim, "qk_rope_head_dim")
    if rope % 2 or rope > cfg.head_dim or rope > cfg.index_head_dim:
        raise ConfigError(f"qk_rope_head_dim={rope} must be even and <= head_dim={cfg.head_dim} and "
                          f"index_head_dim={cfg.index_head_dim}")
    if cfg.num_attention_heads % cfg.o_groups:
        raise ConfigError(f"o_groups={cfg.o_groups} must divide num_attention_heads={cfg.num_attention_heads}")
    _validate_engram(cfg)
    _layer_list(cfg.dspark_target_layer_ids, "dspark_target_layer_ids", n, ordered=False)
    _validate_ids(cfg)


def _validate_sources(cfg: DeepseekV41Config) -> None:
    """The layer schedule: compress ratios, KV and index sources, the candidate source."""
    n = cfg.num_hidden_layers
    if len(cfg.compress_ratios) != n:
        raise ConfigError(f"compress_ratios has {len(cfg.compress_ratios)} entries, num_hidden_layers={n}")
    for i, r in enumerate(cfg.compress_ratios):
        if isinstance(r, bool) or r not in (0, 1, 2):
            raise ConfigError(f"compress_ratios[{i}]={r!r} must be 0, 1 or 2")
    _layer_list(cfg.kv_source_layer_ids, "kv_source_layer_ids", n)
    _layer_list(cfg.index_source_layer_ids, "index_source_layer_ids", n)
    for name in ("kv_source_layer_ids", "index_source_layer_ids"):
        for layer in getattr(cfg, name):
            if cfg.compress_ratios[layer] == 0:
                raise ConfigError(f"{name} has layer {layer}, whose compress_ratios entry is 0")
    for layer in cfg.index_source_layer_ids:
        if not any(s <= layer for s in cfg.kv_source_layer_ids):
            raise ConfigError(f"index_source_layer_ids has layer {layer} with no kv_source_layer_ids entry at or "
                              "before it (nothing publishes index keys for it)")
    for layer, r in enumerate(cfg.compress_ratios):
        if r and cfg.kv_source_of(layer) is None:
            raise ConfigError(f"compress_ratios[{layer}]={r} but no kv_source_layer_ids entry is at or before "
                              f"layer {layer}")
    c = cfg.candidate_source_layer_id
    if isinstance(c, bool) or not isinstance(c, int) or c < -1 or (c >= 0 and c not in cfg.index_source_layer_ids):
        raise ConfigError(f"candidate_source_layer_id={c!r} must be -1 (off) or one of index_source_layer_ids "
                          f"{list(cfg.index_source_layer_ids)}")


def _validate_engram(cfg: DeepseekV41Config) -> None:
    _layer_list(cfg.engram_layer_ids, "engram_layer_ids", cfg.num_hidden_layers)
    if len(cfg.engram_num_embeddings) != len(cfg.engram_layer_ids):
        raise ConfigError(f"engram_num_embeddings has {len(cfg.engram_num_embeddings)} entries, engram_layer_ids "
                          f"{len(cfg.engram_layer_ids)}")
    if cfg.engram_layer_ids:
        if cfg.engram_head_dim % 32 and cfg.quant is not None:
            raise ConfigError(f"engram_head_dim={cfg.engram_head_dim} must be a multiple of 32 (FP8 rows)")
        for i, rows in enumerate(cfg.engram_num_embeddings):
            integer(rows, f"engram_num_embeddings[{i}]")


def _validate_ids(cfg: DeepseekV41Config) -> None:
    """YaRN, the special token ids, the draft head's sizes and the quantisation block."""
    vocab = cfg.vocab_size
    if cfg.yarn is not None:
        number(cfg.yarn.factor, "rope_scaling.factor")
        integer(cfg.yarn.original_max_position_embeddings, "rope_scaling.original_max_position_embeddings")
    if cfg.bos_token_id is not None:
        integer(cfg.bos_token_id, "bos_token_id", 0, vocab - 1)
    for i, token_id in enumerate(cfg.eos_token_id):
        integer(token_id, f"eos_token_id[{i}]", 0, vocab - 1)
    for name in ("dspark_block_size", "dspark_markov_rank"):
        if getattr(cfg, name) is not None:
            integer(getattr(cfg, name), name)
    if cfg.dspark_noise_token_id is not None:
        integer(cfg.dspark_noise_token_id, "dspark_noise_token_id", 0)   # transformers' default may exceed a tiny vocab
    if cfg.quant is not None:
        integer(cfg.quant.fp8_block, "quantization_config.weight_block_size")


def _layer_list(ids: tuple[int, ...], name: str, n: int, *, ordered: bool = True) -> None:
    for i, layer in enumerate(ids):
        integer(layer, f"{name}[{i}]", 0, n - 1)
    if ordered and list(ids) != sorted(set(ids)):
        raise ConfigError(f"{name}={list(ids)} must be increasing without repeats")
