"""DeepSeek-V4 causal LM over an engine batch (packed variable-length tokens + paged cache)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet, kernels_for
from deepinfer.kernels.reference import rope_inv_freq

from .batch import ForwardBatch
from .cache import CacheSpec, ModelCache, PagedStreamSpec, StateSpec
from .causal_lm import DraftHead
from .config import CSA, SLIDING, ConfigError, DeepseekV4Config
from .layers.attention import Attention
from .layers.common import RMSNorm, add_hc_site_params, matmul_t
from .layers.moe import Experts, MoE
from .layers.moe_ep_setup import shard_experts


class Block(nn.Module):
    """Attention and MoE, each wrapped by an mHC site (`hc_attn_*`, `hc_ffn_*`)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, expert_dtype: str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        mix = (2 + cfg.hc_mult) * cfg.hc_mult
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.ffn = MoE(cfg, layer, expert_dtype)
        add_hc_site_params(self, mix, cfg.hc_mult * cfg.hidden_size)

    def _site(self, h: Tensor, site: str, ops: KernelSet) -> tuple[Tensor, Tensor, Tensor]:
        cfg = self.cfg
        return ops.hc_pre(h, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_scale"),
                          getattr(self, f"hc_{site}_base"), sinkhorn_iters=cfg.hc_sinkhorn_iters,
                          hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)

    def forward(self, h: Tensor, batch: ForwardBatch, cache: ModelCache, ops: KernelSet, inv_freq: Tensor,
                kv_quant: bool) -> Tensor:
        eps = self.cfg.rms_norm_eps
        x, post, comb = self._site(h, "attn", ops)
        x = self.attn(ops.rms_norm(x, self.attn_norm.weight, eps), batch, cache, ops, inv_freq, kv_quant)
        h = ops.hc_post(x, h, post, comb)
        x, post, comb = self._site(h, "ffn", ops)
        x = self.ffn(ops.rms_norm(x, self.ffn_norm.weight, eps), batch.token_ids, ops,
                     decode_step=batch.decode_step)
        return ops.hc_post(x, h, post, comb)


class DeepseekV4ForCausalLM(nn.Module):
    """The V4 backbone and LM head. Parameter names are the official checkpoint's (`embed`,
    `layers.{i}.…`, `hc_head_*`, `norm`, `head`), except routed experts, which are stacked per layer
    (`layers.{i}.ffn.experts.w13` / `.w2`).

    Args:
        cfg: the model config.
        kv_quant: apply the official FP8/FP4 fake-quantisation to cached KV and index keys
            (off = transformers' numerics).
        expert_dtype: keep the routed experts quantised in memory: "fp8" (e4m3, float32 block scales)
            or "fp4" (MXFP4); None = the model dtype. See `layers.moe.Experts`.
    """

    def __init__(self, cfg: DeepseekV4Config, *, kv_quant: bool = False, expert_dtype: str | None = None) -> None:
        super().__init__()
        if kv_quant:
            _check_kv_quant(cfg)
        self.cfg, self.kv_quant, self.expert_dtype = cfg, kv_quant, expert_dtype
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, expert_dtype) for i in range(cfg.num_hidden_layers))
        self.hc_head_fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("main_inv_freq", torch.empty(cfg.qk_rope_head_dim // 2), persistent=False)
        self.register_buffer("compress_inv_freq", torch.empty(cfg.qk_rope_head_dim // 2), persistent=False)
        self.reset_rope()
        self.draft_weights: dict[str, Tensor] = {}   # mtp.* tensors, for the draft head (spec decoding)
        self.__dict__["draft"] = None     # an attached DraftHead (not a submodule: names stay the checkpoint's)

    def attach_draft(self, draft: DraftHead | None) -> None:
        """Attach a DSpark draft head (or detach with None): from then on every forward captures the
        outputs of `dspark_target_layer_ids` and writes the draft stages' window rings, and
        `cache_spec` declares those rings. Without a draft the forward captures nothing."""
        self.__dict__["draft"] = draft

    def reset_rope(self) -> None:
        """(Re)compute the RoPE frequency buffers on the model's device (after `to_empty`)."""
        cfg, device = self.cfg, self.main_inv_freq.device
        if device.type == "meta":
            return
        self.main_inv_freq.copy_(rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, None))
        self.compress_inv_freq.copy_(rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.yarn))

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Random initialisation (normal(0, std) matrices, unit norms, zero biases/sinks, hash table
        drawn uniformly), deterministic for a seed. Used by tests and the tiny-model recipe."""
        gen = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if ".experts." in name and self.expert_dtype is not None:
                continue                                  # quantised per expert below
            if "norm" in name:
                p.fill_(1.0)
            elif leaf in ("ape", "attn_sink", "bias") or name.endswith("_base"):
                p.zero_()
            elif name.endswith("_scale"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
        for module in self.modules():
            if isinstance(module, Experts) and module.expert_dtype is not None:
                module.randomise_quantised_(self.cfg.moe_intermediate_size, self.cfg.hidden_size, std, gen)
        for name, b in self.named_buffers():
            if name.endswith("tid2eid"):
                b.random_(0, self.cfg.n_routed_experts, generator=gen)

    def cache_spec(self, block_size: int, max_backtracking: int = 0, dtype: torch.dtype | None = None) -> CacheSpec:
        """What this model keeps per sequence (see deepinfer.model.cache).

        Args:
            block_size: tokens per paged block; a multiple of every compress ratio.
            max_backtracking: spare ring slots for rejected draft tokens.
            dtype: element type of KV rows (default: the model's parameter dtype).
        """
        cfg = self.cfg
        dtype = dtype or self.embed.weight.dtype
        for i, r in enumerate(cfg.compress_ratios):
            if r and block_size % r:
                raise ValueError(f"block_size={block_size} must be a multiple of layer {i}'s compress ratio {r}")
        if max_backtracking < 0:
            raise ValueError(f"max_backtracking={max_backtracking} must be >= 0")
        streams, stored, dropped = [], [], []
        for i, (kind, r) in enumerate(zip(cfg.attention_types, cfg.compress_ratios)):
            stored.append(StateSpec(f"layers.{i}.window", (cfg.sliding_window + max_backtracking, cfg.head_dim),
                                    dtype, True, cfg.sliding_window))
            if kind == SLIDING:
                continue
            streams.append(PagedStreamSpec(f"layers.{i}.kv", cfg.head_dim, r, dtype))
            mult = 2 if kind == CSA else 1
            ring = mult * r + max_backtracking
            live = r if kind == CSA else 0          # at a boundary: the previous window (CSA) or nothing
            for part in ("kv", "gate"):
                dropped.append(StateSpec(f"layers.{i}.compressor.{part}", (ring, mult * cfg.head_dim), torch.float32,
                                         False, live))
            if kind == CSA:
                streams.append(PagedStreamSpec(f"layers.{i}.index_k", cfg.index_head_dim, r, dtype))
                for part in ("kv", "gate"):
                    dropped.append(StateSpec(f"layers.{i}.indexer.{part}", (ring, 2 * cfg.index_head_dim),
                                             torch.float32, False, live))
        if self.draft is not None:
            dropped.extend(self.draft.state_specs(max_backtracking, dtype))
        return CacheSpec(block_size, tuple(streams), tuple(stored + dropped))

    def forward(self, batch: ForwardBatch, cache: ModelCache, ops: KernelSet | None = None) -> Tensor:
        """Run one step; writes this step's KV/state into `cache`.

        Args:
            ops: the kernels to run (default: `kernels_for` the batch's device); the engine passes
                `kernels_for(device, batch_invariant=True)` with `EngineArgs.batch_invariant`, and then
                each sequence's logits are bitwise the same whatever else is in the batch.

        Returns:
            logits [len(batch.logits_indices), vocab] float32 for the requested rows.
        """
        cfg = self.cfg
        ops = ops or kernels_for(batch.token_ids.device)
        h = self.embed(batch.token_ids).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        draft = self.draft
        features = {}
        for layer, block in enumerate(self.layers):
            inv_freq = self.main_inv_freq if cfg.compress_ratios[layer] == 0 else self.compress_inv_freq
            h = block(h, batch, cache, ops, inv_freq, self.kv_quant)
            if draft is not None and layer in cfg.dspark_target_layer_ids:
                features[layer] = h.mean(dim=1)            # V4 DSpark: hc-mean of the target layers' outputs
        if draft is not None:
            draft.write_context(torch.cat([features[i] for i in cfg.dspark_target_layer_ids], dim=-1), batch, cache,
                                ops)
        h = h[batch.logits_indices]
        x = ops.hc_head(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, hc_eps=cfg.hc_eps,
                        norm_eps=cfg.rms_norm_eps)
        x = ops.rms_norm(x, self.norm.weight, cfg.rms_norm_eps)
        return matmul_t(x, self.head.weight, ops).float()        # model-dtype GEMM, float32 logits


def keeps_fp32(name: str) -> bool:
    """Parameters and buffers the model keeps in float32 whatever its compute dtype (norm weights,
    mHC, sinks, compressor position bias, router bias, FP8 expert scales) — or int64 (the hash table)."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("ape", "attn_sink", "bias", "tid2eid", "w13_scale", "w2_scale") or "norm" in name \
        or name.startswith("hc_head_") or ".hc_" in name


def build_model(cfg: DeepseekV4Config, *, device: torch.device | str, dtype: torch.dtype,
                kv_quant: bool = False, expert_dtype: str | None = None,
                local_experts: Sequence[Sequence[int]] | None = None) -> DeepseekV4ForCausalLM:
    """An uninitialised model allocated directly on `device`: matrices in `dtype`, `keeps_fp32`
    tensors in float32 (the hash table int64). Fill it with `load_state_dict(..., assign=True)` or
    `init_weights`. `local_experts`: one EP rank's expert slots per MoE layer (`moe_ep_setup.shard_experts`);
    only those are allocated."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, kv_quant=kv_quant, expert_dtype=expert_dtype)
    if local_experts is not None:
        shard_experts(model, local_experts)
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            target = torch.float32 if keeps_fp32(prefix + name) else dtype
            if p.dtype in (torch.float8_e4m3fn, torch.uint8):
                target = p.dtype                          # quantised experts stay so
            module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=target, device=device),
                                                    requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is None:
                continue
            target = b.dtype if (b.dtype == torch.int64 or name.endswith("inv_freq")) else dtype
            module._buffers[name] = torch.empty(b.shape, dtype=target, device=device)
    model.reset_rope()
    return model


def _check_kv_quant(cfg: DeepseekV4Config) -> None:
    """kv_quant's official numerics need FP8 blocks of 64 over the KV's nope dims and, on CSA
    layers, a power-of-two index head (Hadamard rotation) in FP4 blocks of 32."""
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    if nope <= 0 or nope % 64:
        raise ConfigError(f"kv_quant=True needs head_dim - qk_rope_head_dim = {cfg.head_dim} - "
                          f"{cfg.qk_rope_head_dim} = {nope} to be a positive multiple of 64 (the FP8 block)")
    index = cfg.index_head_dim
    if CSA in cfg.attention_types and (index & (index - 1) or index % 32):
        raise ConfigError(f"kv_quant=True needs index_head_dim={index} to be a power of two >= 32 (Hadamard "
                          "rotation, FP4 block of 32)")
