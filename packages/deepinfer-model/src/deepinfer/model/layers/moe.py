"""Mixture of experts: sqrt-softplus router (learned top-k or hash), clamped SwiGLU experts, a shared expert."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet, repack_mxfp4_for_decode
from deepinfer.kernels.reference import quant_fp8_block, quant_mxfp4

from ..config import ConfigError, DeepseekV4Config
from ..config_v41 import DeepseekV41Config
from .common import linear, stacked_weight
from .moe_ep import ExpertParallel


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


EXPERT_DTYPES = (None, "fp8", "fp4")


def quantise_expert_matrix(w: Tensor, expert_dtype: str, fp8_block: int) -> tuple[Tensor, Tensor]:
    """One float expert matrix → (weight, scale) in `expert_dtype` ("fp8": `quant_fp8_block`;
    "fp4": `quant_mxfp4`)."""
    return quant_fp8_block(w, fp8_block) if expert_dtype == "fp8" else quant_mxfp4(w)


class Experts(nn.Module):
    """Routed experts stacked: `w13` [experts, 2·inter, hidden] (w1 rows, then w3), `w2` [experts, hidden, inter].

    `expert_dtype` keeps them quantised in memory, with the scales alongside:
    - "fp8": FP8 e4m3 (half of bf16's bytes), float32 block scales `w13_scale` [experts, 2·inter / b,
      hidden / b] and `w2_scale` [experts, hidden / b, inter / b] (b = the checkpoint's FP8 block, else
      128); run through `moe_experts_fp8`.
    - "fp4": MXFP4 (about a quarter), `w13` [experts, 2·inter, hidden / 2] and `w2` [experts, hidden,
      inter / 2] uint8 (two e2m1 codes per byte), uint8-coded e8m0 scales per 32 inputs `w13_scale`
      [experts, 2·inter, hidden / 32], `w2_scale` [experts, hidden, inter / 32]; run through
      `moe_experts_mxfp4`.

    Under expert parallelism (`moe_ep`) the module holds this rank's physical expert slots only:
    `num_experts` rows instead of the config's `n_routed_experts`.

    `mxfp4_packed` ("fp4" only): w13 / w2 hold their codes re-packed for the expert kernels' `packed`
    decoder (`repack_mxfp4_for_decode`, same shapes; `repack_for_decode_`), not in the checkpoint's
    layout; the ops get `packed=True`.
    """

    def __init__(self, cfg: DeepseekV4Config | DeepseekV41Config, expert_dtype: str | None = None,
                 num_experts: int | None = None, *, mxfp4_packed: bool = False) -> None:
        super().__init__()
        e = cfg.n_routed_experts if num_experts is None else num_experts
        i, h = cfg.moe_intermediate_size, cfg.hidden_size
        if expert_dtype not in EXPERT_DTYPES:
            raise ConfigError(f"expert_dtype={expert_dtype!r} must be one of {EXPERT_DTYPES}")
        if mxfp4_packed and expert_dtype != "fp4":
            raise ValueError(f"mxfp4_packed needs expert_dtype 'fp4', got {expert_dtype!r}")
        self.expert_dtype = expert_dtype
        self.mxfp4_packed = mxfp4_packed
        self.fp8_block = cfg.quant.fp8_block if cfg.quant else 128
        if expert_dtype is None:
            self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
            self.w2 = nn.Parameter(torch.empty(e, h, i))
            return
        group = self.fp8_block if expert_dtype == "fp8" else 32
        if i % group or h % group:
            raise ConfigError(f"{expert_dtype} experts need moe_intermediate_size={i} and hidden_size={h} divisible "
                              f"by the {'FP8 block' if expert_dtype == 'fp8' else 'MXFP4 group'} {group}")
        if expert_dtype == "fp8":
            shapes = {"w13": (e, 2 * i, h), "w2": (e, h, i), "w13_scale": (e, 2 * i // group, h // group),
                      "w2_scale": (e, h // group, i // group)}
            dtypes = {"w13": torch.float8_e4m3fn, "w2": torch.float8_e4m3fn}
        else:
            shapes = {"w13": (e, 2 * i, h // 2), "w2": (e, h, i // 2), "w13_scale": (e, 2 * i, h // group),
                      "w2_scale": (e, h, i // group)}
            dtypes = dict.fromkeys(shapes, torch.uint8)
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtypes.get(name, torch.float32)),
                                             requires_grad=False))

    @property
    def param_names(self) -> tuple[str, ...]:
        """The stacked tensors, each with one row per expert: w13, w2, then their scales if quantised."""
        return ("w13", "w2") if self.expert_dtype is None else ("w13", "w2", "w13_scale", "w2_scale")

    def forward(self, x: Tensor, expert_ids: Tensor, weights: Tensor, limit: float, ops: KernelSet) -> Tensor:
        """x [num_tokens, hidden]; expert_ids, weights [num_tokens, top_k] → [num_tokens, hidden]."""
        if self.expert_dtype is None:
            return ops.moe_experts(x, expert_ids, weights, self.w13, self.w2, limit)
        if self.expert_dtype == "fp8":
            return ops.moe_experts_fp8(x, expert_ids, weights, self.w13, self.w13_scale, self.w2, self.w2_scale,
                                       limit, self.fp8_block)
        return ops.moe_experts_mxfp4(x, expert_ids, weights, self.w13, self.w13_scale, self.w2, self.w2_scale, limit,
                                     packed=self.mxfp4_packed)

    def repack_for_decode_(self) -> None:
        """Re-pack the MXFP4 codes of w13 and w2 in place, expert by expert, for the `packed` decoder
        (`repack_mxfp4_for_decode`; scales unchanged) and set `mxfp4_packed`. No-op if already packed.

        Raises:
            ValueError: the experts are not "fp4"."""
        if self.expert_dtype != "fp4":
            raise ValueError(f"repack_for_decode_ needs expert_dtype 'fp4', got {self.expert_dtype!r}")
        if self.mxfp4_packed:
            return
        with torch.no_grad():
            for w in (self.w13, self.w2):
                for e in range(w.shape[0]):
                    w[e].copy_(repack_mxfp4_for_decode(w[e]))
        self.mxfp4_packed = True

    def quantise_(self, e: int, w13: Tensor, w2: Tensor) -> None:
        """Store expert `e` from float matrices w13 [2·inter, hidden], w2 [hidden, inter] in this
        module's quantised format (`quant_fp8_block` / `quant_mxfp4`, re-packed if `mxfp4_packed`)."""
        if self.expert_dtype is None:
            raise ValueError("quantise_ needs quantised experts (expert_dtype 'fp8' or 'fp4')")
        with torch.no_grad():
            for name, w in (("w13", w13), ("w2", w2)):
                q, s = quantise_expert_matrix(w, self.expert_dtype, self.fp8_block)
                getattr(self, name)[e].copy_(repack_mxfp4_for_decode(q) if self.mxfp4_packed else q)
                getattr(self, f"{name}_scale")[e].copy_(s)

    def randomise_quantised_(self, inter: int, hidden: int, std: float, generator: torch.Generator) -> None:
        """Fill every expert with N(0, std²) float matrices (w13, then w2, per expert), quantised into
        this module's format: the random init of quantised experts (init_weights, dummy weights)."""
        device = self.w13.device
        for e in range(self.w13.shape[0]):
            self.quantise_(e, torch.empty(2 * inter, hidden, device=device).normal_(0.0, std, generator=generator),
                           torch.empty(hidden, inter, device=device).normal_(0.0, std, generator=generator))


class SharedExpert(nn.Module):
    def __init__(self, cfg: DeepseekV4Config | DeepseekV41Config) -> None:
        super().__init__()
        i, h = cfg.moe_intermediate_size, cfg.hidden_size
        self.w1, self.w3, self.w2 = linear(h, i), linear(h, i), linear(i, h)


class MoE(nn.Module):
    """`gate`, `experts`, `shared_experts` (official names).

    `ep` (set by `moe_ep_setup.apply_expert_parallel`, None otherwise): the routed experts run expert
    parallel — `experts` holds this rank's slots and tokens travel by all-to-all (variable splits in
    prefill, fixed-capacity buffers in decode steps).
    """

    def __init__(self, cfg: DeepseekV4Config, layer: int, expert_dtype: str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ep: ExpertParallel | None = None
        self.gate = Gate(cfg, hashed=layer < cfg.num_hash_layers)
        self.experts = Experts(cfg, expert_dtype)
        self.shared_experts = SharedExpert(cfg) if cfg.n_shared_experts else None

    def forward(self, x: Tensor, token_ids: Tensor, ops: KernelSet, *, decode_step: bool = False) -> Tensor:
        """x [num_tokens, hidden] (normed), token_ids [num_tokens] int64 → [num_tokens, hidden].
        `decode_step` (`ForwardBatch.decode_step`): under expert parallelism, exchange through the
        fixed-capacity buffers (`moe_ep_fixed`); no effect without `ep`."""
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
        if self.ep is None:
            out = self.experts(x, expert_ids, weights, cfg.swiglu_limit, ops)
        else:
            out = self.ep.run(x, expert_ids, weights, self.experts, cfg.swiglu_limit, ops, decode_step=decode_step)
        if self.shared_experts is not None:
            s = self.shared_experts
            stacked_weight(s, "_w13", [s.w1, s.w3])        # w3's rows right after w1's: one GEMV on GPUs
            out = out + ops.clamped_swiglu(x, s.w1.weight, s.w3.weight, s.w2.weight, cfg.swiglu_limit)
        return out
