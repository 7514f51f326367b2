"""One multi-token decode step over scheduler rows, shared by the V4 and V4.1 multi-token decode tests."""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.model import ForwardBatch


def multi_step(model, cache, chunks: list[list[int]], starts: list[int], tables: np.ndarray, slots: list[int], *,
               max_query_len: int, order: np.ndarray | None = None, pad: int = 0) -> torch.Tensor:
    """Row i (scheduler row i: block table tables[i], state slot slots[i]) feeds chunks[i] at positions
    starts[i] …; the tokens flattened in `order` (a permutation; default row by row) and followed by
    `pad` padding tokens (slot 0, an all-zero block table, position 0, as DecodeGraphs pads).
    Returns the logits row by row (the order undone)."""
    lens = np.array([len(c) for c in chunks])
    token_ids = np.concatenate([np.asarray(c) for c in chunks])
    rows = np.repeat(np.arange(len(chunks)), lens)
    positions = np.repeat(np.asarray(starts), lens) + np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
    order = np.arange(len(token_ids)) if order is None else order
    padded_tables = np.zeros((len(chunks) + 1, tables.shape[1]), dtype=np.int32)    # the last row: padding
    padded_tables[:-1] = tables[: len(chunks)]
    padded_slots = np.array(list(slots[: len(chunks)]) + [0])
    token_ids, positions, rows = (np.concatenate((a[order], np.full(pad, fill))) for a, fill in
                                  ((token_ids, 0), (positions, 0), (rows, len(chunks))))
    batch = ForwardBatch.multi_decode(token_ids, positions, rows, padded_tables, padded_slots,
                                      max_query_len=max_query_len)
    with torch.no_grad():
        logits = model(batch, cache)
    out = torch.empty_like(logits[: len(order)])
    out[torch.from_numpy(order)] = logits[: len(order)]
    return out
