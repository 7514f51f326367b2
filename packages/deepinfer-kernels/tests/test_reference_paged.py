"""The batched-decode ops that read the cache in place, against per-sequence Python formulations
(rows looked up one by one through the block table, the window pooled from all projections)."""

from __future__ import annotations

import torch

from deepinfer.kernels import reference as ref

BLOCK, RATIO, DIM = 16, 4, 8
ROWS = BLOCK // RATIO                    # compressed entries per block


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _entry_row(paged: torch.Tensor, table: list[int], entry: int) -> torch.Tensor | None:
    first = entry * RATIO
    col = first // BLOCK
    return None if col >= len(table) else paged[table[col], (first % BLOCK) // RATIO]


def test_paged_decode_attention_reads_window_ring_and_entries_through_the_table() -> None:
    gen, window, ring_len, heads = _gen(0), 5, 7, 3
    tables = [[3, 1, 4], [2, 6, 5]]
    q = torch.randn(2, heads, DIM, generator=gen)
    ring = torch.randn(4, ring_len, DIM, generator=gen)
    paged = torch.randn(7, ROWS, DIM, generator=gen)
    slots, positions = torch.tensor([2, 1]), torch.tensor([3, 40])          # sequence 0: window not full yet
    ids = torch.tensor([[0, -1, 2, 11], [13, 5, -1, 12]])                   # 13: past the 3-block table
    sink = torch.randn(heads, generator=gen)
    got = ref.paged_decode_attention(q, ring, slots, positions, window, sink, 0.3, paged,
                                     torch.tensor(tables), ids, RATIO)
    for b in range(2):
        pos, slot = int(positions[b]), int(slots[b])
        rows = [ring[slot, p % ring_len] for p in range(pos - window + 1, pos + 1) if p >= 0]
        rows += [r for e in ids[b].tolist() if e >= 0 and (r := _entry_row(paged, tables[b], e)) is not None]
        kv = torch.stack(rows)[None]
        want = ref.sparse_attention(q[b:b + 1], kv, torch.ones(1, len(rows), dtype=torch.bool), sink, 0.3)
        torch.testing.assert_close(got[b:b + 1], want)


def test_paged_indexer_scores_match_scores_on_looked_up_keys() -> None:
    gen, heads = _gen(1), 4
    tables = [[2, 5], [1, 3]]
    q, w = torch.randn(2, heads, DIM, generator=gen), torch.randn(2, heads, generator=gen)
    keys = torch.randn(6, ROWS, DIM, generator=gen)
    got = ref.paged_indexer_scores(q, keys, torch.tensor(tables), 9, w, 0.5, RATIO)   # entry 8: past the table
    for b in range(2):
        rows = [_entry_row(keys, tables[b], e) for e in range(9)]
        rows = torch.stack([r if r is not None else keys[0, 0] for r in rows])           # block 0, row 0
        torch.testing.assert_close(got[b], ref.indexer_scores(q[b:b + 1], rows, w[b:b + 1], 0.5)[0])


def test_compress_decode_token_by_token_pools_each_closed_window() -> None:
    gen, width, tokens = _gen(2), DIM, 13
    inv = ref.rope_inv_freq(4, 10000.0)
    norm = 1 + torch.randn(width, generator=gen) * 0.1
    for overlap in (False, True):
        mult = 2 if overlap else 1
        k_all = torch.randn(tokens, mult * width, generator=gen)
        g_raw = torch.randn(tokens, mult * width, generator=gen)
        ape = torch.randn(RATIO, mult * width, generator=gen)
        g_all = g_raw + ape[torch.arange(tokens) % RATIO]
        ring_kv = torch.zeros(3, mult * RATIO, mult * width)
        ring_gate = torch.zeros_like(ring_kv)
        paged = torch.full((4, ROWS, width), float("nan"))
        table = torch.tensor([[2, 3]])
        for t in range(tokens):
            row = ref.compress_decode(k_all[t:t + 1], g_raw[t:t + 1], ape, torch.tensor([t]), torch.tensor([1]),
                                      ring_kv, ring_gate, norm, inv, 1e-6, overlap=overlap, paged=paged,
                                      block_tables=table)
            if (t + 1) % RATIO:
                continue
            e = t // RATIO
            cur = slice(e * RATIO, t + 1)
            if overlap:   # previous window's first-half channels, then this window's second half
                prev = slice(max(e - 1, 0) * RATIO, e * RATIO)
                kk = torch.cat((k_all[prev, :width], k_all[cur, width:]))
                gg = torch.cat((g_all[prev, :width], g_all[cur, width:]))
            else:
                kk, gg = k_all[cur], g_all[cur]
            pooled = ref.rms_norm((kk * gg.softmax(0)).sum(0, keepdim=True), norm, 1e-6)
            want = ref.apply_rope(pooled, torch.tensor([e * RATIO]), inv)
            torch.testing.assert_close(row, want)
            torch.testing.assert_close(paged[table[0, e * RATIO // BLOCK], e % ROWS], want[0])
        written = ~torch.isnan(paged).all(-1)
        assert int(written[1:].sum()) == tokens // RATIO       # one row per closed window, none elsewhere


def test_prefill_attention_reads_the_window_run_and_entries_through_the_table(monkeypatch) -> None:
    """Query i at position start + i: window rows i + 1 … i + window of the run (positions ≥ 0 only),
    then its picks looked up through the sequence's table (−1 and entries past the table skipped);
    several of the twin's row blocks."""
    gen, window, heads, start, num_queries = _gen(3), 5, 3, 2, 9
    table = [3, 1, 4]
    q = torch.randn(num_queries, heads, DIM, generator=gen)
    run = torch.randn(window + num_queries, DIM, generator=gen)
    paged = torch.randn(6, ROWS, DIM, generator=gen)
    ids = torch.randint(-1, 14, (num_queries, 4), generator=gen)                 # 12, 13: past the table
    sink = torch.randn(heads, generator=gen)
    monkeypatch.setattr(ref.paged, "PREFILL_ROWS_BLOCK", 4)
    got = ref.prefill_attention(q, run, start, window, sink, 0.3, paged, torch.tensor(table), ids, RATIO)
    for i in range(num_queries):
        pos = start + i
        rows = [run[p - start + window] for p in range(pos - window + 1, pos + 1) if p >= 0]
        rows += [r for e in ids[i].tolist() if e >= 0 and (r := _entry_row(paged, table, e)) is not None]
        kv = torch.stack(rows)[None]
        want = ref.sparse_attention(q[i:i + 1], kv, torch.ones(1, len(rows), dtype=torch.bool), sink, 0.3)
        torch.testing.assert_close(got[i:i + 1], want)
