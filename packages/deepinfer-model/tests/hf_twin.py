"""Tiny random DeepSeek-V4 models built with transformers (the oracle) and their DeepInfer twins."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DeepseekV4Config as HFConfig
from transformers import DeepseekV4ForCausalLM as HFModel

from deepinfer.model import DeepseekV4Config, DeepseekV4ForCausalLM, ForwardBatch, ModelCache
from deepinfer.model.names import to_official

BASE: dict[str, Any] = dict(
    vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
    head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4,
    n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=48, num_hash_layers=1,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "sliding_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=8, hc_mult=2, hc_sinkhorn_iters=3, index_n_heads=2, index_head_dim=16, index_topk=64,
    max_position_embeddings=256, num_nextn_predict_layers=0, rope_theta=10000.0, compress_rope_theta=160000.0,
)


def hf_model(seed: int = 0, **overrides: Any) -> tuple[HFModel, dict[str, Any]]:
    """A transformers model with every default-inert parameter perturbed (sinks, position bias,
    mHC base/scale, router bias, hash table), float32, eval mode."""
    raw = {**BASE, **overrides}
    torch.manual_seed(seed)
    model = HFModel(HFConfig(**raw)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("sinks") or name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith(".base") or name.endswith("hc_base"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith(".scale") or name.endswith("hc_scale"):
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("tid2eid"):
                experts = raw["n_routed_experts"]
                p.copy_(torch.stack([torch.randperm(experts, generator=gen)[: p.shape[1]] for _ in range(p.shape[0])]))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
    return model, raw


def twin(hf: HFModel, raw: dict[str, Any], **kwargs: Any) -> DeepseekV4ForCausalLM:
    """Our model with the transformers model's weights (through the key-name mapping)."""
    cfg = DeepseekV4Config.from_dict(raw)
    model = DeepseekV4ForCausalLM(cfg, **kwargs)
    state = {to_official(k): v for k, v in hf.state_dict().items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def hf_logits(hf: HFModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids]), use_cache=False).logits[0].float()


class Runner:
    """Drives our model over a cache with exact-fit block tables, one sequence per slot."""

    def __init__(self, model: DeepseekV4ForCausalLM, block_size: int = 16, num_blocks: int = 64, num_slots: int = 8):
        self.model = model
        self.block_size = block_size
        self.cache = ModelCache.allocate(model.cache_spec(block_size), num_blocks, num_slots)
        self.next_block = 1
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def _table(self, slot: int, length: int) -> list[int]:
        table = self.tables.setdefault(slot, [])
        while len(table) * self.block_size < length:
            table.append(self.next_block)
            self.next_block += 1
        return table

    def step(self, chunks: dict[int, list[int]], logits: str = "all") -> list[torch.Tensor]:
        """Feed each slot its next tokens; returns per-slot logits rows."""
        slots = list(chunks)
        starts = [self.lengths.get(s, 0) for s in slots]
        tables = [self._table(s, st + len(chunks[s])) for s, st in zip(slots, starts)]
        batch = ForwardBatch.build([chunks[s] for s in slots], starts, tables, slots, logits=logits)
        with torch.no_grad():
            out = self.model(batch, self.cache)
        for s in slots:
            self.lengths[s] = self.lengths.get(s, 0) + len(chunks[s])
        if logits == "last":
            return list(out)
        return [out[batch.cu_seqlens[i]: batch.cu_seqlens[i + 1]] for i in range(len(slots))]
