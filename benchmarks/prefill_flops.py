"""Analytic FLOP and byte count of a DeepSeek-V4 prefill, per op class, from the config alone.

    costs = prefill_costs(cfg, chunks=[(0, 8192)], expert_dtype="fp8")
    costs["moe_routed"].flops, costs["moe_routed"].bytes

A prompt runs as chunks (start position, tokens); each chunk is one forward of one sequence. FLOPs
count multiply-adds as 2 and nothing else of the softmaxes, top-k or Sinkhorn's divisions except
where a formula below says so. Bytes are the floor of METHOD.md: each operand read once and each
result written once per op (weights, activations, the cache rows the op needs), not the gathered
copies or float32 intermediates an implementation may add — the time those take shows up as the
gap between measured time and floor. Formulas, with T = chunk tokens, p = a query's position,
n(p) = p + 1 (tokens visible to it), a = activation bytes, w = weight bytes per parameter:

- attn_proj: 2·T·(D·R + R·H·d + D·d + H·d·O + G·O·D)  (wq_a, wq_b, wkv, wo_a grouped, wo_b)
- attn_core: Σ_p 4·H·d·keys(p); keys = min(W, n) + {CSA: min(k_idx, n // r); HCA: n // r; else 0}
- indexer:   2·T·(R·Hi·di + D·Hi) + Σ_p 2·Hi·(di + 1)·(n // r)   (CSA layers: wq_b, weights_proj, scores)
- compressor: 2·T·D·2·c·(d + {CSA: di}) + 2·c·r·width per emitted entry (c = 2 overlapping, else 1),
  and the emitted entries' norm and RoPE
- router: 2·T·D·E;  moe_routed: 6·T·k·D·I;  moe_shared: 6·T·s·D·I
- mhc: per site 2·T·hc·D·(mix + 2) + 4·T·hc²·iters (hc_pre) and 2·T·hc·D·(hc + 1) (hc_post), two sites
- norm_rope: 4 FLOPs per normed element, 3 per rotated element
- embed_head: the embedding rows (bytes only: T·D·a read, T·hc·D·a written) and, for the last token
  of each chunk, hc_head, the final norm and 2·D·V of the LM head
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.model import DeepseekV4Config

CSA, HCA = "csa", "hca"

# Op classes, in the order the report prints them.
CLASSES: tuple[str, ...] = (
    "moe_routed", "moe_shared", "router", "attn_proj", "attn_core", "indexer", "compressor", "mhc",
    "norm_rope", "embed_head",
)

# Bytes per stored routed-expert weight: bf16; FP8 e4m3 plus a float32 scale per 128 × 128 block;
# MXFP4 (two e2m1 codes a byte) plus a one-byte e8m0 scale per 32 inputs.
EXPERT_WEIGHT_BYTES = {None: 2.0, "fp8": 1.0 + 4.0 / (128 * 128), "fp4": 0.5 + 1.0 / 32}


@dataclass(frozen=True, slots=True)
class OpCost:
    """FLOPs and floor bytes of one op class over a forward (or a sum of forwards)."""

    flops: float
    bytes: float

    def __add__(self, other: OpCost) -> OpCost:
        return OpCost(self.flops + other.flops, self.bytes + other.bytes)


ZERO = OpCost(0.0, 0.0)


def sum_floor_div(lo: int, hi: int, r: int, cap: int | None = None) -> int:
    """Σ_{m=lo}^{hi} min(cap, m // r) for 0 <= lo <= hi + 1 (cap None: no cap), in closed form."""
    def prefix(n: int) -> int:                   # Σ_{m=0}^{n} m // r
        if n < 0:
            return 0
        q, rem = divmod(n, r)
        return r * q * (q - 1) // 2 + q * (rem + 1)
    if cap is not None and hi >= cap * r:
        split = max(lo, cap * r)                 # from here on m // r >= cap
        return sum_floor_div(lo, split - 1, r) + cap * (hi - split + 1)
    return prefix(hi) - prefix(lo - 1)


def sum_min(lo: int, hi: int, cap: int) -> int:
    """Σ_{m=lo}^{hi} min(cap, m) for 0 <= lo <= hi + 1."""
    below = max(0, min(hi, cap) - lo + 1)        # terms m < cap ... m <= cap give m
    first = lo
    last = lo + below - 1
    return (first + last) * below // 2 + cap * (hi - lo + 1 - below)


def _gemm(tokens: int, dim_in: int, dim_out: int, act: float, weight: float) -> OpCost:
    """One [tokens, dim_in] × [dim_in, dim_out] projection: weight, input and output moved once."""
    return OpCost(2.0 * tokens * dim_in * dim_out,
                  dim_in * dim_out * weight + tokens * (dim_in + dim_out) * act)


def _elementwise(elements: float, flops_each: float, act: float) -> OpCost:
    """An elementwise pass: each element read and written once."""
    return OpCost(elements * flops_each, 2.0 * elements * act)


def layer_costs(cfg: DeepseekV4Config, layer: int, start: int, tokens: int, *, act_bytes: float = 2.0,
                weight_bytes: float = 2.0, expert_dtype: str | None = None) -> dict[str, OpCost]:
    """Costs of layer `layer` for one sequence's chunk of `tokens` queries at positions start … start + tokens − 1.

    Args:
        act_bytes: bytes of an activation / cache element (bf16: 2).
        weight_bytes: bytes of a dense weight (bf16: 2); routed experts take EXPERT_WEIGHT_BYTES[expert_dtype].
    Returns:
        class name (CLASSES, less embed_head) → OpCost.
    """
    kind, r = cfg.attention_types[layer], cfg.compress_ratios[layer]
    t, a, w = tokens, act_bytes, weight_bytes
    dim, heads, hd, rope = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
    lo, hi = start + 1, start + tokens           # n(p) = p + 1 over the chunk
    end_entries = (start + tokens) // r if r else 0
    costs = dict.fromkeys(CLASSES[:-1], ZERO)

    costs["attn_proj"] = (_gemm(t, dim, cfg.q_lora_rank, a, w) + _gemm(t, cfg.q_lora_rank, heads * hd, a, w)
                          + _gemm(t, dim, hd, a, w) + _gemm(t, cfg.o_groups * cfg.o_lora_rank, dim, a, w))
    # wo_a is block-diagonal: each of the G groups maps its H·d / G inputs to O outputs.
    grouped_out = cfg.o_groups * cfg.o_lora_rank
    costs["attn_proj"] += OpCost(2.0 * t * heads * hd * cfg.o_lora_rank,
                                 heads * hd * cfg.o_lora_rank * w + t * (heads * hd + grouped_out) * a)
    keys = sum_min(lo, hi, cfg.sliding_window)
    if kind == CSA:
        keys += sum_floor_div(lo, hi, r, cfg.index_topk)
    elif kind == HCA:
        keys += sum_floor_div(lo, hi, r)
    window_rows = min(cfg.sliding_window - 1, start) + tokens
    costs["attn_core"] = OpCost(4.0 * heads * hd * keys,
                                (2 * t * heads * hd + (window_rows + end_entries) * hd) * a)

    norm_elems = 2 * t * dim + t * (cfg.q_lora_rank + heads * hd + hd)      # attn/ffn norms, q_norm, q heads, kv
    rope_elems = t * (2 * heads + 1) * rope                                  # q, kv, output (inverse)
    if r:
        overlap = 2 if kind == CSA else 1
        widths = [hd] + ([cfg.index_head_dim] if kind == CSA else [])
        emitted = end_entries - start // r
        comp = ZERO
        for width in widths:
            proj = _gemm(t, dim, 2 * overlap * width, a, w)
            pool = OpCost(2.0 * overlap * r * width * emitted, (t * 2 * overlap * width + emitted * width) * a)
            entry_norm_rope = _elementwise(emitted * width, 4.0, a) + _elementwise(emitted * rope, 3.0, a)
            comp += proj + pool + entry_norm_rope
        costs["compressor"] = comp
    if kind == CSA:
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        scored = sum_floor_div(lo, hi, r)
        scores = OpCost(2.0 * ih * (idim + 1) * scored,
                        (t * ih * idim + end_entries * idim) * a + t * ih * 4 + t * cfg.index_topk * 4)
        costs["indexer"] = _gemm(t, cfg.q_lora_rank, ih * idim, a, w) + _gemm(t, dim, ih, a, w) + scores
        rope_elems += t * ih * rope

    costs["router"] = _gemm(t, dim, cfg.n_routed_experts, a, w)
    inter, top_k, num_experts = cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.n_routed_experts
    touched = num_experts * (1 - (1 - top_k / num_experts) ** t)     # expected distinct experts (uniform routing)
    costs["moe_routed"] = OpCost(6.0 * t * top_k * dim * inter,
                                 touched * 3 * dim * inter * EXPERT_WEIGHT_BYTES[expert_dtype] + 2 * t * dim * a)
    shared = cfg.n_shared_experts
    costs["moe_shared"] = OpCost(6.0 * t * shared * dim * inter, shared * 3 * dim * inter * w + 2 * t * dim * a)

    hc, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
    pre = OpCost(2.0 * t * hc * dim * (mix + 2) + 4.0 * t * hc * hc * cfg.hc_sinkhorn_iters,
                 t * hc * dim * a + mix * hc * dim * 4 + t * dim * a)
    post = OpCost(2.0 * t * hc * dim * (hc + 1), (t * dim + 2 * t * hc * dim) * a)
    costs["mhc"] = OpCost(2 * (pre.flops + post.flops), 2 * (pre.bytes + post.bytes))
    costs["norm_rope"] = _elementwise(norm_elems, 4.0, a) + _elementwise(rope_elems, 3.0, a)
    return costs


def head_costs(cfg: DeepseekV4Config, rows: int, *, act_bytes: float = 2.0, weight_bytes: float = 2.0) -> OpCost:
    """hc_head, the final norm and the LM head for `rows` logits rows (float32 logits)."""
    dim, hc = cfg.hidden_size, cfg.hc_mult
    collapse = OpCost(2.0 * rows * hc * dim * (hc + 1), rows * hc * dim * act_bytes + hc * hc * dim * 4)
    norm = _elementwise(rows * dim, 4.0, act_bytes)
    head = OpCost(2.0 * rows * dim * cfg.vocab_size, cfg.vocab_size * dim * weight_bytes
                  + rows * (dim * act_bytes + cfg.vocab_size * 4))
    return collapse + norm + head


def prefill_costs(cfg: DeepseekV4Config, chunks: Sequence[tuple[int, int]], *, expert_dtype: str | None = None,
                  act_bytes: float = 2.0, weight_bytes: float = 2.0) -> dict[str, OpCost]:
    """Costs of one sequence's prefill run as `chunks` [(start position, tokens)], every layer of `cfg`,
    one logits row per chunk (the engine's last-token logits).

    Returns:
        class name (every entry of CLASSES) → OpCost summed over chunks and layers.
    """
    total = dict.fromkeys(CLASSES, ZERO)
    for start, tokens in chunks:
        if tokens <= 0 or start < 0:
            raise ValueError(f"chunk (start={start}, tokens={tokens}) needs start >= 0 and tokens > 0")
        for layer in range(cfg.num_hidden_layers):
            for name, cost in layer_costs(cfg, layer, start, tokens, act_bytes=act_bytes, weight_bytes=weight_bytes,
                                          expert_dtype=expert_dtype).items():
                total[name] += cost
        embed = OpCost(0.0, tokens * cfg.hidden_size * (1 + cfg.hc_mult) * act_bytes)
        total["embed_head"] += embed + head_costs(cfg, 1, act_bytes=act_bytes, weight_bytes=weight_bytes)
    return total


def chunked(prompt_len: int, chunk_len: int) -> list[tuple[int, int]]:
    """(start, tokens) of a prompt split into chunks of at most chunk_len tokens."""
    if prompt_len <= 0 or chunk_len <= 0:
        raise ValueError(f"prompt_len={prompt_len} and chunk_len={chunk_len} must be > 0")
    return [(s, min(chunk_len, prompt_len - s)) for s in range(0, prompt_len, chunk_len)]
