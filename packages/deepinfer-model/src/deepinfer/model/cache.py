"""The model's cache: what it declares (CacheSpec) and the tensor views it reads and writes.

Two kinds of memory (docs/design.md §5):
- paged streams, one row per `tokens_per_row` tokens, addressed through a sequence's block table:
  `layers.{i}.kv` (compressed KV, CSA and HCA layers) and `layers.{i}.index_k` (CSA index keys);
- per-sequence state in a slot: `layers.{i}.window` (the sliding-window KV ring, stored) and the
  compressor rings `layers.{i}.compressor.{kv,gate}` / `layers.{i}.indexer.{kv,gate}` (dropped:
  compression windows align to the block grain, so they need not be saved).

Ring lengths: window `sliding_window + max_backtracking`; compressor `2·ratio` (CSA, overlapping
windows need the previous window's rows) or `ratio` (HCA), each + max_backtracking. At a block
boundary only part of a ring is live (`StateSpec.boundary_rows`): the window's last `sliding_window`
rows, a CSA compressor's (and indexer's) previous window of `ratio` rows, nothing of an HCA one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class PagedStreamSpec:
    """One paged stream: rows of `row_dim` elements of `dtype`, one per `tokens_per_row` tokens."""

    name: str
    row_dim: int
    tokens_per_row: int
    dtype: torch.dtype

    @property
    def bytes_per_row(self) -> int:
        return self.row_dim * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One per-sequence state region of `shape` elements of `dtype`; `stored` ones go to a KV store.

    `boundary_rows`: for a ring indexed by position mod `shape[0]`, how many rows a later step reads
    when the sequence stands at a block boundary t (a multiple of every compress ratio): those of
    positions t − boundary_rows … t − 1 (0 = none: a window that closes at every boundary). None =
    the whole region. A prefix-cache state snapshot keeps only these rows.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stored: bool
    boundary_rows: int | None = None

    @property
    def num_bytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Everything the model keeps between steps; `block_size` is tokens per paged block."""

    block_size: int
    streams: tuple[PagedStreamSpec, ...]
    states: tuple[StateSpec, ...]


class ModelCache:
    """Tensor views over the cache memory, by stream / region name.

    `paged[name]`: [num_blocks, block_size // tokens_per_row, row_dim]; block 0 is the reserved dummy.
    `state[name]`: [num_slots, *shape]; slot 0 is the dummy.
    """

    def __init__(self, spec: CacheSpec, paged: Mapping[str, Tensor], state: Mapping[str, Tensor]) -> None:
        self.spec = spec
        self.paged = dict(paged)
        self.state = dict(state)

    @classmethod
    def allocate(
        cls, spec: CacheSpec, num_blocks: int, num_slots: int, device: torch.device | str = "cpu"
    ) -> ModelCache:
        """Separate zeroed tensors per stream and region (tests, and engines without a planner)."""
        paged = {
            s.name: torch.zeros(
                num_blocks, spec.block_size // s.tokens_per_row, s.row_dim, dtype=s.dtype, device=device
            )
            for s in spec.streams
        }
        state = {r.name: torch.zeros(num_slots, *r.shape, dtype=r.dtype, device=device) for r in spec.states}
        return cls(spec, paged, state)

    @classmethod
    def from_buffers(
        cls,
        spec: CacheSpec,
        paged_buffer: Tensor,
        stream_offsets: Mapping[str, int],
        num_blocks: int,
        state_buffer: Tensor,
        region_offsets: Mapping[str, int],
        num_slots: int,
        slot_bytes: int,
    ) -> ModelCache:
        """Views into two uint8 buffers laid out by a planner (e.g. deepinfer.cache).

        Args:
            paged_buffer: uint8, layer-major: stream s occupies
                [offset_s, offset_s + num_blocks · rows_per_block · bytes_per_row).
            stream_offsets: byte offset of each stream (a stream sharing another's region has its offset).
            state_buffer: uint8 [num_slots · slot_bytes]; region r of slot k starts at
                k · slot_bytes + region_offsets[r].
        """
        if paged_buffer.dtype != torch.uint8 or state_buffer.dtype != torch.uint8:
            raise ValueError("paged_buffer and state_buffer must be uint8 tensors")
        paged = {}
        for s in spec.streams:
            rows = spec.block_size // s.tokens_per_row
            size = num_blocks * rows * s.bytes_per_row
            off = stream_offsets[s.name]
            if off + size > paged_buffer.numel():
                raise ValueError(f"stream {s.name!r} [{off}, {off + size}) exceeds the paged buffer")
            paged[s.name] = paged_buffer[off:off + size].view(s.dtype).view(num_blocks, rows, s.row_dim)
        slots = state_buffer[: num_slots * slot_bytes].view(num_slots, slot_bytes)
        state = {}
        for r in spec.states:
            off = region_offsets[r.name]
            if off + r.num_bytes > slot_bytes:
                raise ValueError(
                    f"state region {r.name!r} [{off}, {off + r.num_bytes}) exceeds slot_bytes={slot_bytes}"
                )
            state[r.name] = slots[:, off:off + r.num_bytes].view(r.dtype).view(num_slots, *r.shape)
        return cls(spec, paged, state)

    def copy_blocks(self, src: Tensor, dst: Tensor) -> None:
        """Copy whole paged blocks src[i] → dst[i] in every stream (copy-on-write for forks)."""
        for t in self.paged.values():
            t[dst] = t[src]

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """Copy state slots src[i] → dst[i] in every region."""
        for t in self.state.values():
            t[dst] = t[src]

    def zero_slots(self, slots: Tensor) -> None:
        """Zero the given state slots in every region."""
        for t in self.state.values():
            t[slots] = 0
