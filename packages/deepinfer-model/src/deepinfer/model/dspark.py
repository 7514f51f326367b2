"""DSpark draft head of DeepSeek-V4-Flash-DSpark / -0731 and DeepSeek-V4.1-Flash (spec §2.8,
§2.9.8): parallel drafting of a whole block in one forward, then a sequential low-rank Markov
correction.

V4.1 differences (the same class, chosen by the target's config): the captured features are the
hc-means of the streams *entering* the target layers; stages use single-pass mHC (the block starts
from the stream-0 pre-mix, the head collapses with the last FFN pre-mix, no `hc_head`), no per-head
q norm, MXFP8 window rows (the target's window codec), their own MoE (`dspark_n_routed_experts`,
top `dspark_num_experts_per_tok`, V4.1 router), and the Markov factors are named
`markov_head.embed` / `markov_head.head`.

Context. The target's forward captures the hc-mean of the outputs of `dspark_target_layer_ids`
(`DeepseekV4ForCausalLM.attach_draft` turns the capture on; off, it costs one `if`), projects it once
(`main_x = main_norm(main_proj(concat))`, stage 0's weights) and writes, for every stage, the key
`rope(kv_norm(wkv(main_x)))` of each position into that stage's own window ring (`mtp.{i}.window`
in the model's cache spec: `sliding_window + max_backtracking` rows, slot = position mod ring
length). Rejected positions are never read and get overwritten by the next forward: no copy back.

Draft. Input per sequence: [anchor, noise × (k − 1)] at positions a … a + k − 1 (anchor = the token
the target just sampled, at position a; k = `dspark_block_size`). Each stage is a window-only V4
block (ratio 0, main RoPE, mHC sites, the backbone's MoE) whose attention writes the block's keys
into its ring and lets every block query see the `sliding_window` committed positions a − W … a − 1
plus all k block keys (bidirectional inside the block). The last stage collapses with its learned
`hc_head`, then `norm` and the target's shared `head` give base logits U_j. Sequentially, from
out_0 = anchor: e_j = markov_w1[out_j], logits_j = U_j + markov_w2 · e_j, out_{j+1} = sample(logits_j),
and the confidence sigmoid(proj([x_j; e_j])) predicts that draft's acceptance (x_j = the collapsed,
pre-norm hidden). Draft j is the guess for position a + j + 1.

Names: the official `mtp.{i}.…` keys (`mtp.0.main_proj`, `mtp.0.main_norm`; last stage `norm`,
`hc_head_*`, `markov_head.markov_w1/markov_w2`, `confidence_head.proj`), experts stacked per stage
as the backbone's (`mtp.{i}.ffn.experts.w13` / `.w2`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet, kernels_for
from deepinfer.kernels.reference import dequant_fp8_block, dequant_mxfp4

from .batch import ForwardBatch
from .cache import ModelCache, StateSpec
from .checkpoint import WeightError
from .config import ConfigError
from .config_v41 import DeepseekV41Config
from .layers.common import matmul_t
from .layers.dspark_stage import DraftStage
from .layers.moe import Experts
from .model import keeps_fp32
from .model_v41 import keeps_fp32_v41

Sampler = Callable[[int, Tensor], Tensor]     # (draft index j, logits [num_seqs, vocab]) -> ids [num_seqs]
_STAGE = re.compile(r"^mtp\.(\d+)\.")
_EXPERT = re.compile(r"^(mtp\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


@dataclass(frozen=True, slots=True)
class DraftProposal:
    """One draft block per sequence; draft j is the guess for position anchor_position + j + 1."""

    token_ids: Tensor     # [num_seqs, k] int64
    logits: Tensor        # [num_seqs, k, vocab] float32, the Markov-corrected logits each draft was drawn from
    confidence: Tensor    # [num_seqs, k] float32, predicted acceptance probability of each draft


def greedy_sampler(step: int, logits: Tensor) -> Tensor:
    """The default draft sampler: argmax of each row."""
    return logits.argmax(dim=-1)


class DSparkDraft(nn.Module):
    """The draft head over a target `DeepseekV4ForCausalLM` or `DeepseekV41ForCausalLM` (whose `embed`
    and `head` it shares).

    Args:
        target: the target model (its config carries the `dspark_*` fields).
        num_stages: draft blocks `mtp.0 … mtp.{num_stages − 1}` (count them in the checkpoint:
            `num_stages_in`; V4-0731's config says 1 where the checkpoint has 3).
        expert_dtype: the stages' routed experts kept "fp8" / "fp4" in memory, None = model dtype.
        block_size: drafts per proposal, k (default `dspark_block_size`; the engine passes its
            `num_speculative_tokens`).
    Raises:
        ConfigError: the config lacks a DSpark field, the noise token is outside the vocabulary, or
            num_stages / block_size < 1.
    """

    def __init__(self, target: nn.Module, num_stages: int, *, expert_dtype: str | None = None,
                 block_size: int | None = None) -> None:
        super().__init__()
        cfg = target.cfg
        for name in ("dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank"):
            if getattr(cfg, name) is None:
                raise ConfigError(f"{name} is not set: the config has no DSpark draft head")
        if not cfg.dspark_target_layer_ids:
            raise ConfigError("dspark_target_layer_ids is empty: the config has no DSpark draft head")
        if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size or num_stages < 1:
            raise ConfigError(f"dspark_noise_token_id={cfg.dspark_noise_token_id} outside the vocabulary "
                              f"[0, {cfg.vocab_size}) or num_stages={num_stages} < 1")
        self.cfg, self.block_size, self.expert_dtype = cfg, block_size or cfg.dspark_block_size, expert_dtype
        if block_size is not None and block_size < 1:
            raise ConfigError(f"block_size={block_size} must be >= 1")
        self.v41 = isinstance(cfg, DeepseekV41Config)
        self.__dict__["target"] = target               # shared embed / head; not a submodule (names stay mtp.*)
        device, dtype = target.embed.weight.device, target.embed.weight.dtype
        self.codec = target.codecs().window if self.v41 else None
        with torch.device(device):
            self.mtp = nn.ModuleList(DraftStage(cfg, i, num_stages, expert_dtype, self.codec)
                                     for i in range(num_stages))
        for name, p in self.named_parameters():
            if p.dtype.is_floating_point and p.dtype != torch.float8_e4m3fn and not self._keeps_fp32(name):
                p.data = p.data.to(dtype)

    @property
    def num_stages(self) -> int:
        return len(self.mtp)

    def ring_names(self) -> tuple[str, ...]:
        return tuple(f"mtp.{i}.window" for i in range(self.num_stages))

    def state_specs(self, max_backtracking: int, dtype: torch.dtype) -> tuple[StateSpec, ...]:
        """The stages' window rings (dropped state: rebuilt from the target's features).

        Raises:
            ValueError: max_backtracking < block_size + 1 (a verify step writes block_size + 1
                positions past the committed ones; they must not reach a live window row).
        """
        if max_backtracking < self.block_size + 1:
            raise ValueError(f"max_backtracking={max_backtracking} must be >= dspark_block_size + 1 = "
                             f"{self.block_size + 1} for the DSpark rings")
        rows = self.cfg.sliding_window + max_backtracking
        if self.codec is not None:
            shape, dtype = (rows, self.codec.row_dim), self.codec.dtype
        else:
            shape = (rows, self.cfg.head_dim)
        return tuple(StateSpec(name, shape, dtype, False, self.cfg.sliding_window) for name in self.ring_names())

    def write_context(self, features: Tensor, batch: ForwardBatch, cache: ModelCache, ops: KernelSet) -> None:
        """Project the captured target features [num_tokens, hidden · num_targets] and write every
        stage's key of each token into its ring (the target forward calls this)."""
        target, stage0 = self.target, self.mtp[0]
        main_x = ops.rms_norm(ops.linear(features, stage0.main_proj.weight), stage0.main_norm.weight,
                              self.cfg.rms_norm_eps)
        for i, stage in enumerate(self.mtp):
            ring = cache.state[f"mtp.{i}.window"]
            kv = stage.attn.keys(main_x, batch.positions, ops, target.main_inv_freq, self._kv_quant)
            _write_ring(ring, stage.attn.encode(kv, ring), batch)

    @torch.no_grad()
    def propose(self, anchor_ids: Tensor, anchor_positions: Tensor, state_slots: Tensor, cache: ModelCache, *,
                sample: Sampler = greedy_sampler, ops: KernelSet | None = None) -> DraftProposal:
        """Draft k = block_size tokens per sequence in one forward, then the Markov walk.

        Args:
            anchor_ids: [num_seqs] int64, the token the target just sampled for each sequence.
            anchor_positions: [num_seqs] int64, its position (= tokens committed before it); the
                rings must hold the target's features of every position before it.
            state_slots: [num_seqs] int64 state slots.
            sample: picks draft j from the corrected logits (default argmax; deepinfer.spec's
                `DraftSampler` for seeded temperature sampling).
        Returns:
            the drafts, their logits and confidences; the rings now hold the block's keys at
            positions anchor … anchor + k − 1, overwritten by the next target forward.
        """
        cfg, target = self.cfg, self.target
        ops = ops or kernels_for(anchor_ids.device)
        num_seqs, k = anchor_ids.shape[0], self.block_size
        tokens = torch.full((num_seqs, k), cfg.dspark_noise_token_id, dtype=torch.int64, device=anchor_ids.device)
        tokens[:, 0] = anchor_ids
        tokens = tokens.flatten()
        h = target.embed(tokens).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre_mix = None
        if self.v41:                                       # identity pre-mix: stream 0
            pre_mix = torch.zeros(h.shape[0], cfg.hc_mult, dtype=torch.float32, device=h.device)
            pre_mix[:, 0] = 1.0
        for i, stage in enumerate(self.mtp):
            h, pre_mix = stage(h, pre_mix, tokens, anchor_positions, state_slots, cache.state[f"mtp.{i}.window"], ops,
                               target.main_inv_freq, self._kv_quant)
        last = self.mtp[-1]
        if self.v41:
            x = ops.hc_collapse(h, pre_mix)
        else:
            x = ops.hc_head(h, last.hc_head_fn, last.hc_head_scale, last.hc_head_base, hc_eps=cfg.hc_eps,
                            norm_eps=cfg.rms_norm_eps)
        base = matmul_t(ops.rms_norm(x, last.norm.weight, cfg.rms_norm_eps), target.head.weight, ops).float()
        base, x = base.view(num_seqs, k, -1), x.view(num_seqs, k, -1).float()
        markov, proj = last.markov_head, last.confidence_head.proj.weight.float()
        prev, drafts, logits, confidence = anchor_ids, [], [], []
        for j in range(k):
            e = markov.embedding(prev)
            step_logits = base[:, j] + matmul_t(e, markov.projection.weight, ops).float()
            confidence.append(torch.sigmoid(torch.cat((x[:, j], e.float()), dim=-1) @ proj.t()).squeeze(-1))
            prev = sample(j, step_logits)
            drafts.append(prev)
            logits.append(step_logits)
        return DraftProposal(torch.stack(drafts, 1), torch.stack(logits, 1), torch.stack(confidence, 1))

    def _keeps_fp32(self, name: str) -> bool:
        """As the backbone (`keeps_fp32` / `keeps_fp32_v41`), and the confidence projection, which runs
        in float32."""
        return (keeps_fp32_v41 if self.v41 else keeps_fp32)(name) or "confidence_head" in name

    @property
    def _kv_quant(self) -> bool:
        return bool(getattr(self.target, "kv_quant", False))

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Random weights for tests: normal(0, std) matrices, unit norms and mHC scales, zero biases."""
        gen = torch.Generator(device=self.mtp[0].hc_attn_fn.device).manual_seed(seed)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if not p.dtype.is_floating_point or p.dtype == torch.float8_e4m3fn:
                continue
            if "norm" in name or name.endswith("_scale"):
                p.fill_(1.0)
            elif leaf in ("attn_sink", "bias") or name.endswith("_base"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)

    @torch.no_grad()
    def load_weights(self, tensors: Mapping[str, Tensor]) -> None:
        """Fill the stages from official `mtp.{i}.…` tensors (e.g. `model.draft_weights`): float, FP8
        e4m3 or packed MXFP4 with their `….scale` (dequantised here, FP8 blocks of the config's
        `weight_block_size`); per-expert `ffn.experts.{e}.w1/w2/w3` or stacked `w13` / `w2`.

        Raises:
            WeightError: a key this head does not have, a scale without its weight, a shape that
                differs, or a missing tensor.
        """
        tensors = _dequantised(tensors, self.cfg.quant.fp8_block if self.cfg.quant else 128)
        state = self.state_dict()
        filled: set[str] = set()
        per_expert: dict[tuple[str, int], dict[str, Tensor]] = {}
        for key, value in tensors.items():
            hit = _EXPERT.match(key)
            if hit is not None:
                per_expert.setdefault((hit.group(1), int(hit.group(2))), {})[hit.group(3)] = value
                continue
            if key not in state:
                raise WeightError(f"unexpected draft weight {key!r} (shape {tuple(value.shape)})")
            if tuple(value.shape) != tuple(state[key].shape):
                raise WeightError(f"draft weight {key!r}: shape {tuple(value.shape)} != expected "
                                  f"{tuple(state[key].shape)}")
            state[key].copy_(value.to(state[key].dtype))
            filled.add(key)
        for (prefix, expert), parts in per_expert.items():
            experts = self.get_submodule(prefix)
            num_experts, rows, cols = experts.w13.shape
            if set(parts) != {"w1", "w2", "w3"} or expert >= num_experts:
                raise WeightError(f"draft expert {prefix}.{expert}: needs w1, w2 and w3 "
                                  f"(got {sorted(parts)}; {num_experts} experts)")
            w13 = torch.cat((parts["w1"], parts["w3"]))
            if tuple(w13.shape) != (rows, self.cfg.hidden_size):
                raise WeightError(f"draft expert {prefix}.{expert}: w1/w3 shape {tuple(parts['w1'].shape)}")
            _fill_expert(experts, expert, w13, parts["w2"])
            filled.update({f"{prefix}.w13", f"{prefix}.w2", f"{prefix}.w13_scale", f"{prefix}.w2_scale"})
        missing = sorted(k for k in state if k not in filled)
        if missing:
            raise WeightError("missing draft weight(s): " + ", ".join(missing[:5])
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))

    @classmethod
    def from_model(cls, target: nn.Module, *, expert_dtype: str | None = None,
                   block_size: int | None = None) -> DSparkDraft:
        """The draft head of a loaded target, from its `draft_weights` (the `mtp.*` tensors).

        Raises:
            WeightError: the checkpoint has no `mtp.*` tensors, or they do not fit this head.
            ConfigError: the config has no DSpark fields.
        """
        num_stages = num_stages_in(target.draft_weights)
        if num_stages == 0:
            raise WeightError("the checkpoint has no mtp.* draft weights (needed for speculative decoding)")
        draft = cls(target, num_stages, expert_dtype=expert_dtype, block_size=block_size)
        draft.load_weights(target.draft_weights)
        return draft.eval()


def _dequantised(tensors: Mapping[str, Tensor], block: int) -> dict[str, Tensor]:
    """Float values of every weight; each scale is consumed by its weight (`stem.weight` + `stem.scale`,
    or a stacked `name` + `name_scale`)."""
    out: dict[str, Tensor] = {}
    scales = {}
    for key in tensors:
        if key.endswith(".weight") and key[:-len("weight")] + "scale" in tensors:
            scales[key] = key[:-len("weight")] + "scale"
        elif key.endswith((".experts.w13", ".experts.w2")) and key + "_scale" in tensors:
            scales[key] = key + "_scale"
    for key, value in tensors.items():
        if key in scales.values():
            continue
        scale = tensors[scales[key]] if key in scales else None
        if scale is None:
            if value.dtype == torch.float8_e4m3fn or key.endswith((".scale", ".w13_scale", ".w2_scale")):
                raise WeightError(f"draft weight {key!r}: an FP8 weight without its scale, or a scale without "
                                  "its weight")
            out[key] = value
        else:
            try:
                out[key] = _dequant(value, scale, block)
            except ValueError as err:
                raise WeightError(f"draft weight {key!r}: {err}") from None
    return out


def _dequant(value: Tensor, scale: Tensor, block: int) -> Tensor:
    """FP8 e4m3 (block scales) or packed MXFP4 (e8m0 per 32) → float; stacked experts one by one."""
    if value.dim() == 3:
        return torch.stack([_dequant(v, s, block) for v, s in zip(value, scale)])
    if value.dtype == torch.float8_e4m3fn:
        return dequant_fp8_block(value, scale, block)
    return dequant_mxfp4(value, scale)


def num_stages_in(tensors: Mapping[str, Tensor]) -> int:
    """Draft stages in a set of `mtp.{i}.…` tensors (1 + the largest i; 0 when there are none)."""
    stages = [int(m.group(1)) for key in tensors if (m := _STAGE.match(key))]
    return max(stages) + 1 if stages else 0


def _fill_expert(experts: Experts, expert: int, w13: Tensor, w2: Tensor) -> None:
    if experts.expert_dtype is None:
        experts.w13[expert].copy_(w13)
        experts.w2[expert].copy_(w2)
    else:
        experts.quantise_(expert, w13.to(experts.w13_scale.device), w2.to(experts.w13_scale.device))


def _write_ring(ring: Tensor, kv: Tensor, batch: ForwardBatch) -> None:
    """Write each token's key at (its slot, position mod ring length); of a chunk longer than the ring
    only the last ring-length rows (the others would be overwritten anyway)."""
    ring_len = ring.shape[1]
    if batch.uniform_decode:
        ring[batch.state_slots, batch.positions % ring_len] = kv.to(ring.dtype)
        return
    for i in range(batch.num_seqs):
        a, b = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
        a = max(a, b - ring_len)
        ring[batch.state_slots[i], batch.positions[a:b] % ring_len] = kv[a:b].to(ring.dtype)
