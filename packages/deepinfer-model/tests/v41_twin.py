"""A second DeepSeek-V4.1 forward, written from the spec (§2.9) in the shape of transformers' model: one
sequence, the whole prompt at once, no cache — masks over full [T, T] / [T, entries] score matrices,
the published top-k as a per-forward "shared" mapping, Python-int Engram hashes. It reads the
parameters of a `DeepseekV41ForCausalLM` and shares only the kernels' packed-format rounding (itself
tested against hand cases), so the engine's paged / ring / per-sequence machinery is checked against
an independent formulation."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.kernels.reference import engram_primes, fake_quant_fp4_rows, fake_quant_mxfp8
from deepinfer.model import DeepseekV41ForCausalLM
from deepinfer.model.layers.engram import hash_multipliers


def _rms(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


def _rope(x: Tensor, pos: Tensor, inv_freq: Tensor, inverse: bool = False) -> Tensor:
    """Interleaved pairs of the last 2·len(inv_freq) channels rotated by pos·inv_freq."""
    rd = 2 * inv_freq.numel()
    ang = pos.float()[:, None] * inv_freq.float()[None, :]
    cos, sin = ang.cos(), ang.sin() * (-1 if inverse else 1)
    if x.dim() == 3:                                   # [t, heads, dim]
        cos, sin = cos[:, None, :], sin[:, None, :]
    even, odd = x[..., -rd::2].float(), x[..., -rd + 1::2].float()
    rot = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd].float(), rot), dim=-1)


def _mixes(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, cfg) -> tuple[Tensor, Tensor, Tensor]:
    hc = cfg.hc_mult
    m = F.linear(_rms(h.flatten(1), None, cfg.rms_norm_eps), fn.float())
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = torch.softmax((m[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc), -1) + cfg.hc_eps
    for it in range(cfg.hc_sinkhorn_iters):
        if it:
            comb = comb / (comb.sum(-1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    return pre, post, comb


def _engram_ids(model: DeepseekV41ForCausalLM, tokens: list[int]) -> list[list[list[int]]]:
    """[position][engram layer][column] table rows, with Python integers."""
    cfg = model.cfg
    cmap = model.hasher.token_map.tolist()
    pad = cmap[cfg.engram_pad_id]
    n = cfg.engram_max_ngram_size
    primes = engram_primes(len(cfg.engram_layer_ids), n, cfg.engram_n_heads, cfg.engram_vocab_size)
    mults = hash_multipliers(cfg.engram_layer_ids, n, cfg.engram_compressed_vocab_size).tolist()
    out = []
    for p in range(len(tokens)):
        c = [cmap[tokens[p - s]] if p - s >= 0 else pad for s in range(n)]
        row = []
        for k, layer_primes in enumerate(primes):
            r, ids, offset = c[0] * mults[k][0], [], 0
            for s in range(1, n):
                r ^= c[s] * mults[k][s]
                for prime in layer_primes[s - 1]:
                    ids.append(r % prime + offset)
                    offset += prime
            row.append(ids)
        out.append(row)
    return out


def _attention(model, layer: int, x: Tensor, pos: Tensor, shared: dict) -> Tensor:
    cfg, attn = model.cfg, model.layers[layer].attn
    t, heads, d = x.shape[0], cfg.num_attention_heads, cfg.head_dim
    ratio = cfg.compress_ratios[layer]
    inv = model.compress_inv_freq if ratio else model.main_inv_freq
    qr = _rms(x @ attn.wq_a.weight.float().t(), attn.q_norm.weight, cfg.rms_norm_eps)
    q = _rope((qr @ attn.wq_b.weight.float().t()).view(t, heads, d), pos, inv)
    kv = _rope(_rms(x @ attn.wkv.weight.float().t(), attn.kv_norm.weight, cfg.rms_norm_eps), pos, inv)
    if d % 32 == 0:
        kv = fake_quant_mxfp8(kv)
    j = torch.arange(t)
    mask = torch.where((j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - cfg.sliding_window), 0.0, -math.inf)
    keys = kv
    if ratio:
        if attn.compressor is not None:
            comp = attn.compressor
            if ratio == 1:
                latent = _rms(x @ comp.wkv.weight.float().t(), comp.norm.weight, cfg.rms_norm_eps)
            else:
                groups = t // ratio
                k = (x[:groups * ratio] @ comp.wkv.weight.float().t()).view(groups, ratio, d)
                g = (x[:groups * ratio] @ comp.wgate.weight.float().t()).view(groups, ratio, d)
                latent = _rms((k * g.softmax(1)).sum(1), comp.norm.weight, cfg.rms_norm_eps)
            gpos = torch.arange(latent.shape[0]) * ratio
            if attn.indexer is not None:                      # only a KV source that indexes owns keys
                ik = _rms(latent @ attn.indexer.wk.weight.float().t(), attn.indexer.k_norm.weight, cfg.rms_norm_eps)
                ik = _rope(ik, gpos, inv)
                shared["index_k"] = fake_quant_fp4_rows(ik, e4m3_scales=False) if ik.shape[-1] % 32 == 0 else ik
            row = _rope(latent, gpos, inv)
            shared["kv"] = fake_quant_fp4_rows(row, e4m3_scales=True) if d % 16 == 0 else row
        ix = attn.indexer
        entries = shared["index_k"].shape[0] if "index_k" in shared else 0
        if ix is not None and entries:
            iq = _rope((qr @ ix.wq_b.weight.float().t()).view(t, ix.num_heads, ix.head_dim), pos, inv)
            if ix.head_dim % 32 == 0:
                iq = fake_quant_fp4_rows(iq, e4m3_scales=False)
            w = (x @ ix.weights_proj.weight.float().t()) * ix.num_heads**-0.5
            dots = torch.einsum("thd,ed->the", iq, shared["index_k"]).relu() * ix.head_dim**-0.5
            scores = (dots * w[..., None]).sum(1)
            visible = (pos + 1) // ratio
            scores = scores.masked_fill(torch.arange(entries)[None, :] >= visible[:, None], -math.inf)
            if layer == cfg.candidate_source_layer_id:
                bs = cfg.candidate_block_size
                allowed = torch.zeros(t, entries, dtype=torch.bool)
                for i in range(t):
                    blocks = [max(scores[i, b:b + bs].tolist()) for b in range(0, entries, bs)]
                    if visible[i] > 0:
                        blocks[(int(visible[i]) - 1) // bs] = math.inf
                    order = sorted(range(len(blocks)), key=lambda b: (-blocks[b], b))[:cfg.candidate_topk_blocks]
                    for b in order:
                        if blocks[b] > -math.inf:
                            allowed[i, b * bs:(b + 1) * bs] = True
                shared["candidates"] = allowed
            elif 0 <= cfg.candidate_source_layer_id < layer and "candidates" in shared:
                scores = scores.masked_fill(~shared["candidates"], -math.inf)
            bias = torch.full((t, entries), -math.inf)
            for i in range(t):
                order = sorted(range(entries), key=lambda e: (-scores[i, e].item(), e))[:cfg.index_topk]
                for e in order:
                    if scores[i, e] > -math.inf:
                        bias[i, e] = 0.0
            shared["bias"] = bias
        kv_entries = shared["kv"].shape[0]
        if kv_entries and "bias" in shared:                # picks name rows of the current KV source
            bias = torch.full((t, kv_entries), -math.inf)
            width = min(kv_entries, shared["bias"].shape[1])
            bias[:, :width] = shared["bias"][:, :width]
            keys = torch.cat((kv, shared["kv"]))
            mask = torch.cat((mask, bias), dim=1)
    logits = torch.einsum("thd,kd->thk", q, keys) * d**-0.5 + mask[:, None, :]
    sink = attn.attn_sink.float()[None, :, None].expand(t, heads, 1)
    probs = torch.softmax(torch.cat((logits, sink), -1), -1)[..., :-1]
    o = _rope(torch.einsum("thk,kd->thd", probs, keys), pos, inv, inverse=True)
    groups = o.reshape(t, cfg.o_groups, -1)
    wa = attn.wo_a.weight.float().view(cfg.o_groups, -1, groups.shape[-1])
    return torch.einsum("tgi,goi->tgo", groups, wa).flatten(1) @ attn.wo_b.weight.float().t()


def _moe(model, layer: int, x: Tensor) -> Tensor:
    cfg, ffn = model.cfg, model.layers[layer].ffn
    scores = torch.sqrt(F.softplus(x @ ffn.gate.weight.float().t() / cfg.gate_temp))
    out = torch.zeros_like(x)
    inter, lim = cfg.moe_intermediate_size, cfg.swiglu_limit or math.inf
    for i in range(x.shape[0]):
        keyed = (scores[i] + ffn.gate.bias.float()).tolist()
        chosen = sorted(range(len(keyed)), key=lambda e: (-keyed[e], e))[:cfg.num_experts_per_tok]
        w = scores[i, chosen]
        if cfg.norm_topk_prob and len(chosen) > 1:
            w = w / (w.sum() + 1e-20)
        w = w * cfg.routed_scaling_factor
        for e, we in zip(chosen, w):
            w13, w2 = ffn.experts.w13[e].float(), ffn.experts.w2[e].float()
            g, u = w13[:inter] @ x[i], w13[inter:] @ x[i]
            out[i] += w2 @ (we * F.silu(g.clamp(max=lim)) * u.clamp(-lim, lim))
    s = ffn.shared_experts
    g, u = x @ s.w1.weight.float().t(), x @ s.w3.weight.float().t()
    return out + (F.silu(g.clamp(max=lim)) * u.clamp(-lim, lim)) @ s.w2.weight.float().t()


@torch.no_grad()
def twin_logits(model: DeepseekV41ForCausalLM, tokens: list[int]) -> Tensor:
    """float32 logits [T, vocab] of one sequence."""
    cfg = model.cfg
    t, pos = len(tokens), torch.arange(len(tokens))
    h = model.embed.weight.float()[torch.tensor(tokens)][:, None, :].repeat(1, cfg.hc_mult, 1)
    pre_mix = torch.zeros(t, cfg.hc_mult)
    pre_mix[:, 0] = 1
    grams = _engram_ids(model, tokens) if cfg.engram_layer_ids else None
    shared: dict = {}
    for layer, block in enumerate(model.layers):
        if block.engram is not None:
            eg = block.engram
            ids = torch.tensor([g[eg.index] for g in grams])
            kv = eg.embed.weight.float()[ids].flatten(1) @ eg.wkv.weight.float().t()
            key = kv[:, :cfg.hc_mult * cfg.hidden_size].view(t, cfg.hc_mult, -1)
            val = kv[:, cfg.hc_mult * cfg.hidden_size:]
            wt = eg.q_weight.float() * eg.k_weight.float()
            dot = (h * wt * key).sum(-1) * torch.rsqrt(h.pow(2).mean(-1) + cfg.rms_norm_eps) \
                * torch.rsqrt(key.pow(2).mean(-1) + cfg.rms_norm_eps) / math.sqrt(cfg.hidden_size)
            gate = torch.sigmoid(dot.sign() * dot.abs().clamp_min(1e-6).sqrt())
            h = h + gate[..., None] * val[:, None, :]
        a_pre, a_post, a_comb = _mixes(h, block.hc_attn_fn, block.hc_attn_scale.float(), block.hc_attn_base.float(),
                                       cfg)
        x = _rms((pre_mix[..., None] * h).sum(1), block.attn_norm.weight, cfg.rms_norm_eps)
        h = a_post[..., None] * _attention(model, layer, x, pos, shared)[:, None, :] + torch.einsum(
            "tjk,tjd->tkd", a_comb, h)
        f_pre, f_post, f_comb = _mixes(h, block.hc_ffn_fn, block.hc_ffn_scale.float(), block.hc_ffn_base.float(), cfg)
        x = _rms((a_pre[..., None] * h).sum(1), block.ffn_norm.weight, cfg.rms_norm_eps)
        h = f_post[..., None] * _moe(model, layer, x)[:, None, :] + torch.einsum("tjk,tjd->tkd", f_comb, h)
        pre_mix = f_pre
    x = _rms((pre_mix[..., None] * h).sum(1), model.norm.weight, cfg.rms_norm_eps)
    return x @ model.head.weight.float().t()
