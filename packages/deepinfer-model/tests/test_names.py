"""Checkpoint key spellings → the official names the model uses."""

from __future__ import annotations

import pytest
from hf_twin import hf_model

from deepinfer.model import DeepseekV4Config, DeepseekV4ForCausalLM
from deepinfer.model.names import expert_part, to_official

SPELLINGS = [
    # (official, transformers in memory, what save_pretrained writes)
    ("embed.weight", "model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight", "head.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn", "model.hc_head.hc_fn"),
    ("layers.1.attn.kv_norm.weight", "model.layers.1.self_attn.kv_norm.weight", "model.layers.1.attn.norm.weight"),
    ("layers.1.attn.compressor.norm.weight", "model.layers.1.self_attn.compressor.kv_norm.weight",
     "model.layers.1.attn.compressor.norm.weight"),
    ("layers.1.attn.indexer.compressor.ape", "model.layers.1.self_attn.compressor.indexer.position_bias",
     "model.layers.1.attn.indexer.compressor.ape"),
    ("layers.1.attn.indexer.weights_proj.weight",
     "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
     "model.layers.1.attn.indexer.weights_proj.weight"),
    ("layers.2.attn.attn_sink", "model.layers.2.self_attn.sinks", "model.layers.2.attn.attn_sink"),
    ("layers.2.hc_ffn_base", "model.layers.2.ffn_hc.base", "model.layers.2.hc_ffn_base"),
    ("layers.2.ffn.gate.bias", "model.layers.2.mlp.gate.e_score_correction_bias", "model.layers.2.ffn.gate.bias"),
    ("layers.2.ffn.shared_experts.w3.weight", "model.layers.2.mlp.shared_experts.up_proj.weight",
     "model.layers.2.ffn.shared_experts.w3.weight"),
    ("layers.2.ffn.experts.w13", "model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.ffn.experts.w13"),
]


@pytest.mark.parametrize(("official", "in_memory", "saved"), SPELLINGS)
def test_every_spelling_maps_to_the_official_name(official: str, in_memory: str, saved: str) -> None:
    assert to_official(official) == official
    assert to_official(in_memory) == official
    assert to_official(saved) == official
    assert to_official("model." + official) == official


def test_every_transformers_parameter_maps_to_one_of_ours() -> None:
    hf, raw = hf_model(seed=0)
    ours = set(DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(raw)).state_dict())
    assert {to_official(k) for k in hf.state_dict()} == ours


def test_draft_and_per_expert_keys() -> None:
    assert to_official("mtp.0.attn.norm.weight") == "mtp.0.attn.norm.weight"         # draft heads keep theirs
    assert expert_part(to_official("model.layers.3.ffn.experts.17.w3.weight")) == ("layers.3.ffn.experts", 17, "w3")
    assert expert_part("layers.3.ffn.experts.17.w1.scale") == ("layers.3.ffn.experts", 17, "w1.scale")
    assert expert_part("layers.3.ffn.shared_experts.w1.weight") is None
