"""Copies of a sequence's cache in and out of the model's cache memory: state snapshots (what a
sequence needs to resume at a block boundary) and whole KV blocks, as flat byte rows that may live
anywhere — a device pool of prefix-cache snapshots, pinned host memory (the prefix cache's host
tier), or another engine (prefill/decode disaggregation).

A snapshot row keeps, per state region, only the ring rows a later step reads at the boundary
(`StateSpec.boundary_rows`: the sliding window's last rows, a CSA compressor's previous window;
nothing of an HCA compressor, whose window closes there), in position order, so that it can be put
back into any state slot at the same position. A block row is the block's rows of every paged stream,
one after the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer.model import CacheSpec, ModelCache

_ALIGN = 16          # every region's offset in a row: any element type may view it


@dataclass(frozen=True, slots=True)
class SnapshotRegion:
    """One state region's part of a snapshot row.

    Attributes:
        name: the region (`StateSpec.name`).
        num_rows: ring rows kept, those of positions t − num_rows … t − 1 (row = position mod
            ring_len); for a region kept whole (`boundary_rows` None), all of them, in ring order.
        ring_len: rows of the region (its shape[0]).
        whole: the region is copied as it is (no position arithmetic).
        offset: byte offset in the snapshot row.
        num_bytes: bytes it takes there (num_rows × bytes per row).
    """

    name: str
    num_rows: int
    ring_len: int
    whole: bool
    offset: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class SnapshotLayout:
    """Where each state region's live rows go in a snapshot row of `num_bytes` bytes (a multiple of 16)."""

    regions: tuple[SnapshotRegion, ...]
    num_bytes: int

    @classmethod
    def for_spec(cls, spec: CacheSpec) -> SnapshotLayout:
        """The layout of a model's state (`CausalLM.cache_spec`); regions with nothing live are left out."""
        regions, offset = [], 0
        for state in spec.states:
            ring_len = state.shape[0] if state.shape else 1
            whole = state.boundary_rows is None or not state.shape
            num_rows = ring_len if state.boundary_rows is None or whole else state.boundary_rows
            if not 0 <= num_rows <= ring_len:
                raise ValueError(f"state region {state.name!r}: boundary_rows={state.boundary_rows} must be in "
                                 f"[0, {ring_len}]")
            if not num_rows:
                continue
            num_bytes = state.num_bytes // ring_len * num_rows
            regions.append(SnapshotRegion(state.name, num_rows, ring_len, whole, offset, num_bytes))
            offset += -(-num_bytes // _ALIGN) * _ALIGN
        return cls(tuple(regions), max(offset, _ALIGN))


def save_snapshots(cache: ModelCache, layout: SnapshotLayout, slots: Tensor, positions: Tensor) -> Tensor:
    """The snapshots of state slots standing at block boundaries.

    Args:
        slots: [k] int64 state slots (on the cache's device).
        positions: [k] int64 tokens each has computed (a multiple of every compress ratio).

    Returns:
        [k, layout.num_bytes] uint8 on the cache's device.
    """
    out = torch.zeros((slots.shape[0], layout.num_bytes), dtype=torch.uint8, device=slots.device)
    for region in layout.regions:
        rows = _rows(cache.state[region.name], region, slots, positions)
        out[:, region.offset:region.offset + region.num_bytes] = rows.reshape(slots.shape[0], -1).view(torch.uint8)
    return out


def restore_snapshots(cache: ModelCache, layout: SnapshotLayout, snapshots: Tensor, slots: Tensor,
                      positions: Tensor) -> None:
    """Puts snapshots back into state slots: each slot is zeroed, then gets its snapshot's rows, so it
    resumes exactly where the saved sequence stood.

    Args:
        snapshots: [k, layout.num_bytes] uint8 (`save_snapshots`'s rows), on the cache's device.
        slots: [k] int64 state slots to fill.
        positions: [k] int64 the position each snapshot was saved at.
    """
    cache.zero_slots(slots)
    for region in layout.regions:
        state = cache.state[region.name]
        rows = snapshots[:, region.offset:region.offset + region.num_bytes].contiguous()
        rows = rows.view(state.dtype).view(slots.shape[0], region.num_rows, *state.shape[2:])
        if region.whole:
            state[slots] = rows.view(slots.shape[0], *state.shape[1:])
        else:
            state[slots[:, None], _ring_rows(region, positions)] = rows


def block_bytes(cache: ModelCache) -> int:
    """Bytes of one KV block's row (`gather_blocks`): its rows of every paged stream."""
    return sum(t[0].numel() * t.element_size() for t in _streams(cache))


def gather_blocks(cache: ModelCache, block_ids: Tensor) -> Tensor:
    """[k] int64 KV block ids → [k, block_bytes(cache)] uint8, on the cache's device."""
    parts = [t[block_ids].reshape(block_ids.shape[0], -1).view(torch.uint8) for t in _streams(cache)]
    return torch.cat(parts, dim=1)


def scatter_blocks(cache: ModelCache, block_ids: Tensor, rows: Tensor) -> None:
    """Writes `gather_blocks`' rows ([k, block_bytes] uint8, on the cache's device) into KV blocks [k] int64."""
    offset = 0
    for t in _streams(cache):
        size = t[0].numel() * t.element_size()
        t[block_ids] = rows[:, offset:offset + size].contiguous().view(t.dtype).view(-1, *t.shape[1:])
        offset += size


def rows_to_host(rows: Tensor, pool: Tensor, ids: Tensor | list[int]) -> None:
    """Copies device rows [k, n] into rows `ids` of a host pool [m, n] (pinned: asynchronously, in
    stream order; the pool's rows must not be read on the host before the stream gets there)."""
    for row, index in enumerate(_ints(ids)):
        pool[index].copy_(rows[row], non_blocking=True)


def rows_from_host(pool: Tensor, ids: Tensor | list[int], device: torch.device) -> Tensor:
    """Rows `ids` of a host pool [m, n] as a new [k, n] tensor on `device` (asynchronously from
    pinned memory)."""
    indices = _ints(ids)
    out = torch.empty((len(indices), pool.shape[1]), dtype=pool.dtype, device=device)
    for row, index in enumerate(indices):
        out[row].copy_(pool[index], non_blocking=True)
    return out


def _ints(ids: Tensor | list[int]) -> list[int]:
    return ids.tolist() if isinstance(ids, Tensor) else list(ids)


def _streams(cache: ModelCache) -> list[Tensor]:
    """The paged streams' tensors, each once (streams sharing memory are copied once)."""
    seen, out = set(), []
    for t in cache.paged.values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(t)
    return out


def _ring_rows(region: SnapshotRegion, positions: Tensor) -> Tensor:
    """[k, num_rows] ring rows of positions t − num_rows … t − 1 (negative positions wrap to rows
    no token wrote: zero in a fresh slot)."""
    steps = torch.arange(region.num_rows, dtype=torch.int64, device=positions.device)
    return (positions[:, None] - region.num_rows + steps) % region.ring_len


def _rows(state: Tensor, region: SnapshotRegion, slots: Tensor, positions: Tensor) -> Tensor:
    if region.whole:
        return state[slots]
    return state[slots[:, None], _ring_rows(region, positions)]
