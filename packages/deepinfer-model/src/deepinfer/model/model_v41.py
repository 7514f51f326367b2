"""DeepSeek-V4.1 causal LM over an engine batch (spec §2.9): CSA2 attention, Engram, single-pass mHC,
V4.1 MoE (router temperature, no hash layers), bf16 norms, no `hc_head`.

Cache (`cache_spec`): every layer keeps a window ring of MXFP8 rows; only the KV sources have paged
streams — `layers.{s}.kv` (FP4 rows, e4m3 scales) and `layers.{s}.index_k` (FP4 rows, UE8M0
scales), one row per `ratio` tokens — and every layer with a ratio reads its source's streams by
name (shared regions, no copy). The state slot holds, from low to high address, the window rings of
the encoder layers (stored: saved with the sequence), then the dropped region: the decoder layers'
rings, the ratio-2 compressor rings and the Engram token history.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet, kernels_for
from deepinfer.kernels.reference import rope_inv_freq

from .batch import ForwardBatch
from .cache import CacheSpec, ModelCache, PagedStreamSpec, StateSpec
from .causal_lm import DraftHead
from .ced import DEFAULT_KEEP_TOKENS, Frozen, Truncation, TruncationPlan, check_truncation, first_consumer_layer
from .config_checks import ConfigError
from .config_v41 import DeepseekV41Config
from .layers import csa2_decode
from .layers.common import RMSNorm, add_hc_site_params, matmul_t
from .layers.csa2 import Attention
from .layers.csa2_decode import Published
from .layers.engram import HISTORY, Engram, EngramHasher, table_rows
from .layers.moe import Experts, SharedExpert
from .layers.v41_codecs import Codecs


class Gate(nn.Module):
    """Router: `weight` [experts, hidden], selection biases `bias` (text) and `bias_vl` (image
    tokens; unused by this text-only engine) [experts] float32."""

    def __init__(self, cfg: DeepseekV41Config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))


class MoE(nn.Module):
    """`gate`, `experts` (stacked as V4's), `shared_experts` (always one, whatever `n_shared_experts`
    says, as in the released model and transformers). Router logits in float32, divided by
    `gate_temp`; the weights are renormalised only when more than one expert is picked; a
    `swiglu_limit` of 0 means no clamp."""

    def __init__(self, cfg: DeepseekV41Config, expert_dtype: str | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg)
        self.experts = Experts(cfg, expert_dtype)
        self.shared_experts = SharedExpert(cfg)
        self.limit = cfg.swiglu_limit or float("inf")

    def forward(self, x: Tensor, ops: KernelSet) -> Tensor:
        cfg = self.cfg
        logits = x.float() @ self.gate.weight.float().t() / cfg.gate_temp
        expert_ids, weights = ops.route(logits, self.gate.bias, cfg.num_experts_per_tok, scoring_func=cfg.scoring_func,
                                        normalize=cfg.norm_topk_prob and cfg.num_experts_per_tok > 1,
                                        scaling=cfg.routed_scaling_factor)
        s = self.shared_experts
        return self.experts(x, expert_ids, weights, self.limit, ops) + ops.clamped_swiglu(
            x, s.w1.weight, s.w3.weight, s.w2.weight, self.limit)


class Block(nn.Module):
    """Engram (on its layers), attention and MoE, each sublayer collapsed with the pre-mix of the
    site before it (single-pass mHC)."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, expert_dtype: str | None, fp8_engram: bool) -> None:
        super().__init__()
        self.cfg = cfg
        mix = (2 + cfg.hc_mult) * cfg.hc_mult
        self.engram = Engram(cfg, layer, fp8_engram) if layer in cfg.engram_layer_ids else None
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.ffn = MoE(cfg, expert_dtype)
        add_hc_site_params(self, mix, cfg.hc_mult * cfg.hidden_size)

    def _mixes(self, h: Tensor, site: str, ops: KernelSet) -> tuple[Tensor, Tensor, Tensor]:
        cfg = self.cfg
        return ops.hc_mixes(h, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_scale"),
                        getattr(self, f"hc_{site}_base"), sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
                        norm_eps=cfg.rms_norm_eps)

    def forward(self, h: Tensor, pre_mix: Tensor, hash_ids: Tensor | None, batch: ForwardBatch, cache: ModelCache,
                ops: KernelSet, inv_freq: Tensor, codecs: Codecs, published: Published,
                frozen: Frozen | None = None) -> tuple[Tensor, Tensor]:
        """`frozen`: rows left out of this (compact, truncated) batch whose window KV this layer still
        writes, from their state at the first consumer layer (see `ced`)."""
        eps = self.cfg.rms_norm_eps
        if self.engram is not None:
            assert hash_ids is not None, "an Engram layer needs the step's hash ids"
            h = self.engram(h, hash_ids[:, self.engram.index], ops)
        attn_pre, post, comb = self._mixes(h, "attn", ops)
        x = ops.rms_norm(ops.hc_collapse(h, pre_mix), self.attn_norm.weight, eps)
        prefix = None
        if frozen is not None:
            prefix = (ops.rms_norm(ops.hc_collapse(frozen.h, frozen.pre_mix), self.attn_norm.weight, eps),
                      frozen.positions, frozen.cu)
        h = ops.hc_expand(self.attn(x, batch, cache, ops, inv_freq, codecs, published, prefix), h, post, comb)
        ffn_pre, post, comb = self._mixes(h, "ffn", ops)
        x = ops.rms_norm(ops.hc_collapse(h, attn_pre), self.ffn_norm.weight, eps)
        return ops.hc_expand(self.ffn(x, ops), h, post, comb), ffn_pre


class DeepseekV41ForCausalLM(nn.Module):
    """The V4.1 backbone and LM head. Parameter names are the official checkpoint's (`embed`,
    `layers.{i}.…`, `norm`, `head`), with routed experts stacked per layer as in V4.

    Args:
        cfg: the model config.
        expert_dtype: routed experts kept "fp8" or "fp4" in memory, None = the model dtype.
        engram_on_host: keep the Engram tables in host memory (pinned when the model is on CUDA) and
            copy only the rows a step needs; False keeps them with the model.
        fp8_engram: keep the Engram tables as FP8 rows with e8m0 scales (as the checkpoint stores them).
        token_map: [vocab] int64 compressed token ids for Engram hashing (`bind_token_map` later
            otherwise; a forward of a model with Engram layers needs it).
    """

    def __init__(self, cfg: DeepseekV41Config, *, expert_dtype: str | None = None, engram_on_host: bool = False,
                 fp8_engram: bool = False, token_map: Tensor | None = None) -> None:
        super().__init__()
        if cfg.engram_layer_ids:
            need = table_rows(cfg)
            for k, (rows, want) in enumerate(zip(cfg.engram_num_embeddings, need)):
                if rows < want:
                    raise ConfigError(f"engram_num_embeddings[{k}]={rows} is below the {want} rows that the "
                                      "prime buckets of its layer address")
        self.cfg, self.expert_dtype, self.engram_on_host = cfg, expert_dtype, engram_on_host
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, expert_dtype, fp8_engram) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("main_inv_freq", torch.empty(cfg.qk_rope_head_dim // 2), persistent=False)
        self.register_buffer("compress_inv_freq", torch.empty(cfg.qk_rope_head_dim // 2), persistent=False)
        self.reset_rope()
        self.hasher: EngramHasher | None = None
        self.truncation = Truncation()
        if token_map is not None:
            self.bind_token_map(token_map)
        self.draft_weights: dict[str, Tensor] = {}   # mtp.* tensors (DSpark stages), for deepinfer-spec
        self.__dict__["draft"] = None     # an attached DraftHead (not a submodule: names stay the checkpoint's)

    def attach_draft(self, draft: DraftHead | None) -> None:
        """Attach a DSpark draft head (or detach with None): every forward then captures the streams
        entering `dspark_target_layer_ids` and writes the draft stages' window rings, and `cache_spec`
        declares those rings. Without a draft the forward captures nothing."""
        self.__dict__["draft"] = draft

    def bind_token_map(self, token_map: Tensor) -> None:
        """Use `token_map` ([vocab] int64, see `engram_vocab`) for Engram hashing.

        Raises:
            ConfigError: its number of distinct ids is not `engram_compressed_vocab_size`.
        """
        self.hasher = EngramHasher(self.cfg, token_map) if self.cfg.engram_layer_ids else None

    def set_prefill_truncation(self, mode: str, keep_tokens: int = DEFAULT_KEEP_TOKENS) -> None:
        """CED / YOCO prefill truncation (`ced`): "off", "compact" or "mask" (the engine's
        `EngineArgs.yoco_prefill_truncation_mode` / `yoco_prefill_keep_tokens`).

        Raises:
            ConfigError: a bad mode or count, or a model that breaks docs/design.md §8's constraints (no
                layer after the last KV source, an Engram layer after it, DSpark targets on both sides).
        """
        truncation = Truncation(mode, keep_tokens)
        check_truncation(self.cfg, truncation)
        self.truncation = truncation

    def reset_rope(self) -> None:
        """(Re)compute the RoPE frequency buffers on the model's device (after `to_empty`)."""
        cfg, device = self.cfg, self.main_inv_freq.device
        if device.type == "meta":
            return
        self.main_inv_freq.copy_(rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, None))
        self.compress_inv_freq.copy_(rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.yarn))

    def place_engram_tables(self) -> None:
        """Move the Engram tables to host memory (pinned when the model is on CUDA) if `engram_on_host`."""
        if not self.engram_on_host:
            return
        cuda = self.embed.weight.device.type == "cuda"
        for block in self.layers:
            if block.engram is not None:
                for name, p in list(block.engram.embed._parameters.items()):
                    host = p.detach().cpu()
                    block.engram.embed._parameters[name] = nn.Parameter(host.pin_memory() if cuda else host,
                                                                        requires_grad=False)

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Random initialisation for tests and dummy models: normal(0, std) matrices, unit norms,
        Engram q/k weights and mHC scales, zero biases, sinks and mHC bases; deterministic per seed."""
        gen = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if (".experts." in name and self.expert_dtype is not None) or p.dtype in (torch.uint8,
                                                                                       torch.float8_e4m3fn):
                continue
            if "norm" in name or leaf in ("q_weight", "k_weight") or name.endswith("_scale"):
                p.fill_(1.0)
            elif leaf in ("attn_sink", "bias", "bias_vl") or name.endswith("_base"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
        for module in self.modules():
            if isinstance(module, Experts) and module.expert_dtype is not None:
                module.randomise_quantised_(self.cfg.moe_intermediate_size, self.cfg.hidden_size, std, gen)

    def codecs(self, dtype: torch.dtype | None = None, ops: KernelSet | None = None) -> Codecs:
        """The cache row formats; `ops` quantises and dequantises them (default: the reference ops)."""
        return Codecs.for_model(self.cfg, dtype or self.embed.weight.dtype, ops)

    def cache_spec(self, block_size: int, max_backtracking: int = 0, dtype: torch.dtype | None = None) -> CacheSpec:
        """What this model keeps per sequence (see the module docstring).

        Args:
            block_size: tokens per paged block; a multiple of every compress ratio.
            max_backtracking: spare ring slots for rejected draft tokens (a multi-token decode of up
                to q tokens per row needs q − 1; a DSpark draft asks for its block size + 1).
            dtype: element type of rows a packed format cannot hold (default: the parameter dtype).
        """
        cfg = self.cfg
        codecs = self.codecs(dtype)
        if any(r and block_size % r for r in cfg.compress_ratios):
            raise ValueError(f"block_size={block_size} must be a multiple of every compress ratio")
        if max_backtracking < 0:
            raise ValueError(f"max_backtracking={max_backtracking} must be >= 0")
        ring = cfg.sliding_window + max_backtracking
        encoder = cfg.num_encoder_layers
        stored: list[StateSpec] = []
        dropped: list[StateSpec] = []
        streams: list[PagedStreamSpec] = []
        for i in range(cfg.num_hidden_layers):
            region = StateSpec(f"layers.{i}.window", (ring, codecs.window.row_dim), codecs.window.dtype, i < encoder,
                               cfg.sliding_window)
            (stored if i < encoder else dropped).append(region)
        for s in cfg.kv_source_layer_ids:
            r = cfg.compress_ratios[s]
            streams.append(PagedStreamSpec(f"layers.{s}.kv", codecs.kv.row_dim, r, codecs.kv.dtype))
            if s in cfg.index_source_layer_ids:             # only sources that index project keys
                streams.append(PagedStreamSpec(f"layers.{s}.index_k", codecs.index.row_dim, r, codecs.index.dtype))
            if r > 1:
                for part in ("kv", "gate"):
                    dropped.append(StateSpec(f"layers.{s}.compressor.{part}", (r + max_backtracking, cfg.head_dim),
                                             torch.float32, False, 0))       # its windows close at a boundary
        if cfg.engram_layer_ids:
            dropped.append(StateSpec(HISTORY, (cfg.engram_max_ngram_size - 1 + max_backtracking,), torch.int64,
                                     False, cfg.engram_max_ngram_size - 1))
        if self.draft is not None:
            dropped.extend(self.draft.state_specs(max_backtracking, dtype))
        return CacheSpec(block_size, tuple(streams), tuple(stored + dropped))

    def forward(self, batch: ForwardBatch, cache: ModelCache, ops: KernelSet | None = None) -> Tensor:
        """Run one step; writes this step's KV/state into `cache`.

        A uniform decode batch (`ForwardBatch.decode`, or `ForwardBatch.multi_decode`: the verify rows of
        speculative decoding as one virtual sequence per token) runs the static-shape path
        (`layers.csa2_decode`, CUDA-graph safe), any other batch the per-sequence path; both give the
        same logits and leave the same cache.

        Returns:
            logits [len(batch.logits_indices), vocab] float32 for the requested rows.
        Raises:
            ValueError: the model has Engram layers but no token map (`bind_token_map`), prefill
                truncation is on and logits of a row outside a sequence's tail are asked for, or a
                multi-token decode batch's max_query_len needs longer state rings than the cache has
                (`cache_spec(max_backtracking >= max_query_len − 1)`; nothing is written then).
            RuntimeError: a step that is not a uniform decode called while a CUDA graph is captured.
        """
        cfg = self.cfg
        if batch.max_query_len > 1:
            csa2_decode.check_rings(cfg, cache, batch.max_query_len)
        if not batch.uniform_decode and batch.token_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("only a uniform decode step of DeepSeek-V4.1 can be captured in a CUDA graph (the "
                               "per-sequence path reads positions on the host)")
        ops = ops or kernels_for(batch.token_ids.device)
        hash_ids = None
        if cfg.engram_layer_ids:
            if self.hasher is None:
                raise ValueError("this DeepSeek-V4.1 model has Engram layers: bind_token_map(...) first (load_model "
                                 "builds the map from the folder's tokenizer)")
            hash_ids = self.hasher(batch, cache.state[HISTORY])
        h = self.embed(batch.token_ids).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre_mix = torch.zeros(h.shape[0], cfg.hc_mult, dtype=torch.float32, device=h.device)
        pre_mix[:, 0] = 1.0
        codecs = self.codecs(ops=ops)
        published = Published([None] * batch.num_seqs, [None] * batch.num_seqs)
        plan = TruncationPlan.plan(batch, self.truncation)
        start_truncation = first_consumer_layer(cfg) if plan is not None else -1
        frozen = kept = None
        draft, features, feature_batch = self.draft, {}, batch
        for layer, block in enumerate(self.layers):
            inv_freq = self.main_inv_freq if cfg.compress_ratios[layer] == 0 else self.compress_inv_freq
            if plan is not None and layer == start_truncation:
                if self.truncation.mode == "compact":
                    batch, h, pre_mix, frozen = plan.compact(batch, h, pre_mix, published)
                else:
                    kept = (h, pre_mix)
            if draft is not None and layer in cfg.dspark_target_layer_ids:
                features[layer], feature_batch = h.mean(dim=1), batch   # V4.1 DSpark: streams entering the layer
            h, pre_mix = block(h, pre_mix, hash_ids, batch, cache, ops, inv_freq, codecs, published, frozen)
            if kept is not None and plan is not None:   # mask mode: rows outside the tails keep their layer-S state
                h = torch.where(plan.in_tail[:, None, None], h, kept[0])
                pre_mix = torch.where(plan.in_tail[:, None], pre_mix, kept[1])
        if draft is not None:             # targets lie on one side of a truncation: one batch for all
            draft.write_context(torch.cat([features[i] for i in cfg.dspark_target_layer_ids], dim=-1), feature_batch,
                                cache, ops)
        rows = batch.logits_indices
        x = ops.rms_norm(ops.hc_collapse(h[rows], pre_mix[rows]), self.norm.weight, cfg.rms_norm_eps)
        return matmul_t(x, self.head.weight, ops).float()


def keeps_fp32_v41(name: str) -> bool:
    """Tensors a V4.1 model keeps in float32 whatever its dtype: mHC, sinks, router biases, FP8 expert
    scales (the norms follow the model dtype, as the checkpoint stores them in bf16)."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("attn_sink", "bias", "bias_vl", "w13_scale", "w2_scale") or ".hc_" in name


def build_model_v41(cfg: DeepseekV41Config, *, device: torch.device | str, dtype: torch.dtype,
                    expert_dtype: str | None = None, engram_on_host: bool = False,
                    fp8_engram: bool = False) -> DeepseekV41ForCausalLM:
    """An uninitialised V4.1 model allocated on `device` (see `model.build_model`)."""
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(cfg, expert_dtype=expert_dtype, engram_on_host=engram_on_host,
                                       fp8_engram=fp8_engram)
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            target = torch.float32 if keeps_fp32_v41(prefix + name) else dtype
            if p.dtype in (torch.float8_e4m3fn, torch.uint8):
                target = p.dtype
            module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=target, device=device),
                                                    requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                target = b.dtype if (b.dtype == torch.int64 or name.endswith("inv_freq")) else dtype
                module._buffers[name] = torch.empty(b.shape, dtype=target, device=device)
    model.reset_rope()
    return model
