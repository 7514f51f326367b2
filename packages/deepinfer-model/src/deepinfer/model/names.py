"""Checkpoint key names → the model's parameter names.

Three spellings reach us: the official checkpoint's (`layers.3.attn.wq_a.weight`, per-expert
`layers.3.ffn.experts.17.w1.weight`), transformers' in-memory names (`model.layers.3.self_attn.
q_a_proj.weight`, stacked `model.layers.3.mlp.experts.gate_up_proj`), and what transformers'
`save_pretrained` writes: official names under a `model.` prefix (`model.embed_tokens.weight`,
`model.hc_head.hc_fn`, `head.weight`, per-expert `model.layers.3.ffn.experts.17.w1.weight`) with
the attention KV norm as `attn.norm` and, for DeepSeek-V4.1, the Engram tables at model level
(`model.engram_tables.{layer}.weight`, with a `….weight_scale_inv` beside it). The model uses the
official names, with routed experts stacked per layer (`layers.{i}.ffn.experts.w13` = w1 rows then w3
rows, `…experts.w2`) and each Engram table in its layer (`layers.{layer}.engram.embed.weight`).
"""

from __future__ import annotations

import re

# transformers → official, applied in order to a key without its "model." prefix. No official key
# contains any of these patterns, so official keys pass through unchanged.
_HF_TO_OFFICIAL: tuple[tuple[str, str], ...] = (
    (r"^embed_tokens\.", "embed."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.mlp\.experts\.gate_up_proj$", ".ffn.experts.w13"),
    (r"\.mlp\.experts\.down_proj$", ".ffn.experts.w2"),
    (r"\.mlp\.shared_experts\.gate_proj\.", ".ffn.shared_experts.w1."),
    (r"\.mlp\.shared_experts\.up_proj\.", ".ffn.shared_experts.w3."),
    (r"\.mlp\.shared_experts\.down_proj\.", ".ffn.shared_experts.w2."),
    (r"\.mlp\.", ".ffn."),
    (r"^(layers\.\d+\.attn)\.norm\.", r"\1.kv_norm."),          # save_pretrained's KV norm
    (r"^engram_tables\.(\d+)\.", r"layers.\1.engram.embed."),      # save_pretrained's V4.1 Engram tables
)
_COMPILED = tuple((re.compile(pattern), repl) for pattern, repl in _HF_TO_OFFICIAL)
# Words that occur in transformers' spellings (and in save_pretrained's `attn.norm`) but in no
# official key: a key without any of them is official already and skips the patterns.
_HF_WORDS = re.compile(r"embed_tokens|engram_tables\.|hc_head\.|layernorm|_hc\.|self_attn|"
                       r"compressor\.(?:kv_proj|gate_proj|position_bias|kv_norm)|\.attn\.(?:q_a|q_b|kv_proj|o_a|o_b|sinks|norm\.)|\.mlp\.")
_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")


def to_official(key: str) -> str:
    """Map one key (any of the three spellings) to its official name; official keys pass through."""
    if key.startswith("model."):
        key = key[len("model."):]
    if key == "lm_head.weight":
        return "head.weight"
    if _HF_WORDS.search(key) is None:
        return key
    for pattern, repl in _COMPILED:
        key = pattern.sub(repl, key)
    return key


def expert_part(key: str) -> tuple[str, int, str] | None:
    """For an official per-expert key, (layer prefix, expert id, "w1" | "w2" | "w3"); else None.
    Also for the float32 block scale `….wN.scale` of an expert kept in FP8: part "w1.scale" etc."""
    m = _EXPERT.match(key)
    if not m:
        return None
    return m.group(1), int(m.group(2)), m.group(3) if m.group(4) == "weight" else f"{m.group(3)}.scale"


def is_draft_key(key: str) -> bool:
    """MTP / DSpark draft-head weights (`mtp.{k}.…`), kept aside for speculative decoding."""
    return key.startswith("mtp.")
