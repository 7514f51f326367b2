"""Mixture of experts: sqrt-softplus router (learned top-k or hash), clamped SwiGLU experts, a shared expert."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet

from ..config import DeepseekV4Config
from .common import linear, stacked_weight


class Gate(nn.Module):
    """Router: `weight` [experts, hidden]; `bias` [experts] float32 (selection only) on learned
    layers, or the `tid2eid` [vocab, top_k] token → experts table on hash layers."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        self.hashed = hashed
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))


class Experts(nn.Module):
    """Routed experts stacked: `w13` [experts, 2·inter, hidden] (w1 rows, then w3), `w2` [experts, hidden, inter]."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        e, i, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))


class SharedExpert(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        i, h = cfg.moe_intermediate_size, cfg.hidden_size
        self.w1, self.w3, self.w2 = linear(h, i), linear(h, i), linear(i, h)


class MoE(nn.Module):
    """`gate`, `experts`, `shared_experts` (official names)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg, hashed=layer < cfg.num_hash_layers)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg) if cfg.n_shared_experts else None

    def forward(self, x: Tensor, token_ids: Tensor, ops: KernelSet) -> Tensor:
        """x [num_tokens, hidden] (normed), token_ids [num_tokens] int64 → [num_tokens, hidden]."""
        cfg = self.cfg
        logits = ops.linear(x, self.gate.weight)
        if self.gate.hashed:
            expert_ids = self.gate.tid2eid[token_ids].long()
            weights = ops.routing_weights(ops.router_scores(logits, cfg.scoring_func), expert_ids,
                                          normalize=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor)
        else:
            expert_ids, weights = ops.route(logits, self.gate.bias, cfg.num_experts_per_tok,
                                            scoring_func=cfg.scoring_func, normalize=cfg.norm_topk_prob,
                                            scaling=cfg.routed_scaling_factor)
        out = ops.moe_experts(x, expert_ids, weights, self.experts.w13, self.experts.w2, cfg.swiglu_limit)
        if self.shared_experts is not None:
            s = self.shared_experts
            stacked_weight(s, "_w13", [s.w1, s.w3])        # w3's rows right after w1's: one GEMV on GPUs
            out = out + ops.clamped_swiglu(x, s.w1.weight, s.w3.weight, s.w2.weight, cfg.swiglu_limit)
        return out
