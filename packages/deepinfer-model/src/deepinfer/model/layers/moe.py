"""Mixture of experts: sqrt-softplus router (learned top-k or hash), clamped SwiGLU experts, a shared expert."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet

from ..config import ConfigError, DeepseekV4Config
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
    """Routed experts stacked: `w13` [experts, 2·inter, hidden] (w1 rows, then w3), `w2` [experts, hidden, inter].

    With `fp8_block` set they stay FP8 e4m3 in memory (half the bytes of bf16), with float32 block
    scales `w13_scale` [experts, 2·inter / b, hidden / b] and `w2_scale` [experts, hidden / b, inter / b]
    (b = fp8_block), and run through `moe_experts_fp8`."""

    def __init__(self, cfg: DeepseekV4Config, fp8_block: int | None = None) -> None:
        super().__init__()
        e, i, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.fp8_block = fp8_block
        if fp8_block is None:
            self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
            self.w2 = nn.Parameter(torch.empty(e, h, i))
            return
        if (2 * i) % fp8_block or i % fp8_block or h % fp8_block:
            raise ConfigError(f"fp8 experts need moe_intermediate_size={i} and hidden_size={h} divisible by the "
                              f"FP8 block {fp8_block}")
        fp8 = torch.float8_e4m3fn
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=fp8), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=fp8), requires_grad=False)
        self.w13_scale = nn.Parameter(torch.empty(e, 2 * i // fp8_block, h // fp8_block), requires_grad=False)
        self.w2_scale = nn.Parameter(torch.empty(e, h // fp8_block, i // fp8_block), requires_grad=False)

    def forward(self, x: Tensor, expert_ids: Tensor, weights: Tensor, limit: float, ops: KernelSet) -> Tensor:
        """x [num_tokens, hidden]; expert_ids, weights [num_tokens, top_k] → [num_tokens, hidden]."""
        if self.fp8_block is None:
            return ops.moe_experts(x, expert_ids, weights, self.w13, self.w2, limit)
        return ops.moe_experts_fp8(x, expert_ids, weights, self.w13, self.w13_scale, self.w2, self.w2_scale, limit,
                                   self.fp8_block)


class SharedExpert(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        i, h = cfg.moe_intermediate_size, cfg.hidden_size
        self.w1, self.w3, self.w2 = linear(h, i), linear(h, i), linear(i, h)


class MoE(nn.Module):
    """`gate`, `experts`, `shared_experts` (official names)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, fp8_block: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg, hashed=layer < cfg.num_hash_layers)
        self.experts = Experts(cfg, fp8_block)
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
        out = self.experts(x, expert_ids, weights, cfg.swiglu_limit, ops)
        if self.shared_experts is not None:
            s = self.shared_experts
            stacked_weight(s, "_w13", [s.w1, s.w3])        # w3's rows right after w1's: one GEMV on GPUs
            out = out + ops.clamped_swiglu(x, s.w1.weight, s.w3.weight, s.w2.weight, cfg.swiglu_limit)
        return out
