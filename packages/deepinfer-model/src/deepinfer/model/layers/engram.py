"""Engram: n-gram hash memory injected into the residual streams (DeepSeek-V4.1, spec §2.9.6).

`EngramHasher` turns each position's token and its `max_ngram − 1` predecessors (compressed ids)
into table rows for every Engram layer, once per forward. The predecessors of a chunk's first tokens
come from a per-sequence history ring in the state slot (`engram.history`, compressed ids by
position mod ring length), so chunked prefill and decode hash exactly as one-shot prefill; the model
owns that state, the engine passes nothing new.

`Engram` (one per Engram layer) fetches the rows (`embed`, kept on the device or in host memory —
pinned when CUDA — with only the rows of a step copied over), projects them to one key per hc stream
and a shared value (`wkv`), and adds the value to each stream through a gate.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet
from deepinfer.kernels.reference import engram_gate, engram_hash, engram_offsets, engram_primes

from ..batch import ForwardBatch
from ..config_checks import ConfigError
from ..config_v41 import DeepseekV41Config
from .common import linear

HISTORY = "engram.history"


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram_size: int, compressed_vocab_size: int) -> Tensor:
    """[layers, max_ngram] int64 odd multipliers: 2·u + 1, u drawn by numpy's PCG64 seeded 10007·layer,
    below (2^63 − 1) // compressed_vocab_size // 2 (so id · multiplier stays in int64)."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram_size, dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, max_ngram_size, dtype=torch.int64)


def table_rows(cfg: DeepseekV41Config) -> list[int]:
    """Rows each Engram layer's table needs: the sum of its prime bucket sizes."""
    primes = engram_primes(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                           cfg.engram_vocab_size)
    return [sum(p for per_size in layer for p in per_size) for layer in primes]


class EngramHasher:
    """The hash state of a model: compressed token map, primes, offsets, multipliers.

    Args:
        token_map: [vocab] int64 compressed id of every token id (`engram_vocab.compressed_token_map`).
    Raises:
        ConfigError: the map's number of distinct ids is not `engram_compressed_vocab_size`.
    """

    def __init__(self, cfg: DeepseekV41Config, token_map: Tensor) -> None:
        num_ids = int(token_map.max()) + 1 if token_map.numel() else 0
        if num_ids != cfg.engram_compressed_vocab_size or token_map.numel() != cfg.vocab_size:
            raise ConfigError(f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size} but the tokenizer's "
                              f"compressed vocabulary has {num_ids} ids over {token_map.numel()} tokens "
                              f"(vocab_size={cfg.vocab_size}); the hash tables would not match")
        primes = engram_primes(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                               cfg.engram_vocab_size)
        self.max_ngram = cfg.engram_max_ngram_size
        self.token_map = token_map.long()
        self.primes = torch.tensor(primes, dtype=torch.int64)
        self.offsets = torch.tensor(engram_offsets(primes), dtype=torch.int64)
        self.multipliers = hash_multipliers(cfg.engram_layer_ids, cfg.engram_max_ngram_size,
                                            cfg.engram_compressed_vocab_size)
        self.pad = int(self.token_map[cfg.engram_pad_id])

    def __call__(self, batch: ForwardBatch, history: Tensor) -> Tensor:
        """Hash ids [num_tokens, engram layers, (max_ngram − 1)·heads] of the batch's tokens; writes
        their compressed ids into `history` ([num_slots, ring] int64, the state region)."""
        device = batch.token_ids.device
        for name in ("token_map", "primes", "offsets", "multipliers"):
            if getattr(self, name).device != device:
                setattr(self, name, getattr(self, name).to(device))
        ids = self.token_map[batch.token_ids]
        ring = history.shape[1]
        if batch.uniform_decode:         # one token per sequence: static shapes, no host positions
            return self._decode(ids, batch.positions, batch.state_slots, history, batch.max_query_len)
        cols = []
        for shift in range(self.max_ngram):
            src = batch.positions - shift
            col = torch.full_like(ids, self.pad)
            for i in range(batch.num_seqs):
                a, b, start = batch.cu_seqlens[i], batch.cu_seqlens[i + 1], batch.start_positions[i]
                p = src[a:b]
                chunk = ids[a:b][(p - start).clamp(min=0)]
                past = history[batch.state_slots[i]][p.clamp(min=0) % ring]
                col[a:b] = torch.where(p >= start, chunk, torch.where(p >= 0, past, col[a:b]))
            cols.append(col)
        for i in range(batch.num_seqs):
            a, b, start = batch.cu_seqlens[i], batch.cu_seqlens[i + 1], batch.start_positions[i]
            keep = max(start, start + (b - a) - ring)
            pos = torch.arange(keep, start + b - a, device=device)
            history[batch.state_slots[i], pos % ring] = ids[a + keep - start:b]
        return engram_hash(torch.stack(cols, dim=-1), self.multipliers, self.primes, self.offsets)

    def _decode(self, ids: Tensor, pos: Tensor, slots: Tensor, history: Tensor, max_query_len: int) -> Tensor:
        """One token per (virtual) sequence. The look-back is read before this step writes its ids, so a
        ring of max_ngram − 1 rows is enough; under multi-token decode (max_query_len > 1, several tokens
        of one row at consecutive positions) the predecessors at or after the row's first position in
        the step are read again after the write (see `csa2_decode`)."""
        ring = history.shape[1]
        shifts = torch.arange(self.max_ngram, device=ids.device)
        src = pos[:, None] - shifts[None, :]                                       # [n, max_ngram]
        past = history[slots[:, None], src.clamp(min=0) % ring]
        history[slots, pos % ring] = ids
        if max_query_len > 1:
            first = torch.full((history.shape[0],), torch.iinfo(torch.int64).max, dtype=torch.int64, device=ids.device)
            first.scatter_reduce_(0, slots, pos, "amin")            # each slot's first position in this step
            fed_now = src >= first.index_select(0, slots)[:, None]
            past = torch.where(fed_now, history[slots[:, None], src.clamp(min=0) % ring], past)
        cols = torch.where(src >= 0, past, torch.full_like(past, self.pad))
        cols[:, 0] = ids
        return engram_hash(cols, self.multipliers, self.primes, self.offsets)


class EngramEmbedding(nn.Module):
    """An Engram table: `weight` [rows, head_dim] (model dtype, or FP8 e4m3 with `scale` [rows,
    head_dim / 32] uint8-coded e8m0 as the checkpoint stores it)."""

    def __init__(self, rows: int, head_dim: int, fp8: bool) -> None:
        super().__init__()
        self.fp8 = fp8
        if fp8:
            self.weight = nn.Parameter(torch.empty(rows, head_dim, dtype=torch.float8_e4m3fn), requires_grad=False)
            self.scale = nn.Parameter(torch.empty(rows, head_dim // 32, dtype=torch.uint8), requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(rows, head_dim))

    def lookup(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows of `ids` ([...]) → [..., head_dim] in `dtype` on ids' device; a table in host memory
        gathers on the host and copies only those rows."""
        table_device = self.weight.device
        rows = self.weight[ids.to(table_device)]
        if self.fp8:
            scale = torch.exp2(self.scale[ids.to(table_device)].float() - 127.0)
            rows = (rows.float().unflatten(-1, (-1, 32)) * scale.unsqueeze(-1)).flatten(-2)
        if table_device != ids.device:
            rows = rows.pin_memory() if ids.device.type == "cuda" else rows
            rows = rows.to(ids.device, non_blocking=True)
        return rows.to(dtype)


class Engram(nn.Module):
    """One Engram layer: `embed` (the table), `wkv` [(hc + 1)·hidden, cols·head_dim], `q_weight`,
    `k_weight` [hc, hidden] (used as their product)."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, fp8_table: bool = False) -> None:
        super().__init__()
        self.index = cfg.engram_layer_ids.index(layer)
        self.hc, self.hidden, self.eps = cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.embed = EngramEmbedding(cfg.engram_num_embeddings[self.index], cfg.engram_head_dim, fp8_table)
        self.wkv = linear(cols * cfg.engram_head_dim, cfg.hidden_size * (cfg.hc_mult + 1))
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.hidden_size))
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.hidden_size))

    def forward(self, streams: Tensor, hash_ids: Tensor, ops: KernelSet | None = None) -> Tensor:
        """streams [t, hc, hidden], hash_ids [t, cols] (this layer's) → streams with the gated value added;
        `ops.engram_gate` gates (default: the reference)."""
        rows = self.embed.lookup(hash_ids, self.wkv.weight.dtype).flatten(-2)
        kv = torch.nn.functional.linear(rows, self.wkv.weight)
        key, value = kv.split([self.hc * self.hidden, self.hidden], dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.hidden))
        gate_fn = ops.engram_gate if ops is not None else engram_gate
        gate = gate_fn(streams, key, self.q_weight.float() * self.k_weight.float(), self.eps)
        return (streams.float() + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
