"""Byte layout planner for the paged KV buffer and the per-sequence state buffer (pure Python).

Paged KV: every layer's block rows live in ONE uint8 buffer, stream-major ("layer-major"): stream
s owns [offset_s, offset_s + num_blocks * block_stride_s), block b of s starts at
offset_s + b * block_stride_s, and each region starts 32-byte aligned. Block 0 is part of the
buffer (the reserved dummy block). The total is padded to a multiple of
lcm(128, ceil(bytes_per_token)), where bytes_per_token is the exact sum over streams that own
bytes (not `shares`) of bytes_per_row / tokens_per_row: the amortised bytes one token adds.

State: num_slots equal slots in one uint8 buffer; inside a slot the stored regions come first (in
the given order), then the dropped ones, each 32-byte aligned, so saving a sequence's state is one
copy of the first `state_size_to_disk` bytes of its slot.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType

REGION_ALIGN = 32  # bytes; start of every stream region and state region
TOTAL_ALIGN_BASE = 128  # bytes; the paged total is a multiple of lcm(128, ceil(bytes_per_token))


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _check_int(field: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{field}={value} must be >= {minimum}")
    return value


def _check_name(field: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty str, got {value!r}")


@dataclass(frozen=True, slots=True)
class PagedStream:
    """One paged stream of one layer, e.g. "layers.2.kv" (compressed KV) or "layers.2.index_k".

    Attributes:
        name: unique stream name.
        bytes_per_row: bytes of one stored row, > 0.
        tokens_per_row: tokens folded into one row (the compress ratio), > 0.
        shares: name of an EARLIER stream whose region this one reuses (same offsets, same row
            geometry, no bytes of its own); None for a stream that owns its region.
    """

    name: str
    bytes_per_row: int
    tokens_per_row: int
    shares: str | None = None

    def __post_init__(self) -> None:
        _check_name("PagedStream.name", self.name)
        _check_int(f"PagedStream({self.name!r}).bytes_per_row", self.bytes_per_row, 1)
        _check_int(f"PagedStream({self.name!r}).tokens_per_row", self.tokens_per_row, 1)
        if self.shares is not None:
            _check_name(f"PagedStream({self.name!r}).shares", self.shares)


@dataclass(frozen=True, slots=True)
class StreamPlacement:
    """Where one stream lives in the paged buffer; all values in bytes except rows_per_block."""

    offset: int  # start of the stream's region (block 0), 32-byte aligned
    rows_per_block: int  # block_size // tokens_per_row
    bytes_per_row: int
    block_stride: int  # rows_per_block * bytes_per_row


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """Result of plan_paged_layout: one uint8 buffer of total_bytes holding every stream's blocks."""

    num_blocks: int  # block 0 (reserved dummy) included
    block_size: int  # tokens per block
    bytes_per_block: int  # sum of block_stride over streams that own bytes
    total_bytes: int  # padded to a multiple of total_alignment
    bytes_per_token: float  # exact: sum of bytes_per_row / tokens_per_row over owning streams
    total_alignment: int  # lcm(128, ceil(bytes_per_token))
    streams: Mapping[str, StreamPlacement]  # read-only, in the given order; sharers included

    def block_offset(self, name: str, block_id: int) -> int:
        """Byte offset of block block_id of stream name in the buffer.

        Raises:
            ValueError: unknown stream name or block_id outside [0, num_blocks).
        """
        if name not in self.streams:
            raise ValueError(f"name={name!r} is not a stream of this layout")
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id={block_id} out of range [0, {self.num_blocks})")
        placement = self.streams[name]
        return placement.offset + block_id * placement.block_stride


def _stream_geometry(
    streams: Sequence[PagedStream], block_size: int
) -> tuple[dict[str, PagedStream], dict[str, str], Fraction]:
    """Validates the streams; returns them by name, each sharer's owning stream, exact bytes/token."""
    by_name: dict[str, PagedStream] = {}
    owner: dict[str, str] = {}
    bytes_per_token = Fraction(0)
    for index, stream in enumerate(streams):
        if not isinstance(stream, PagedStream):
            raise ValueError(f"streams[{index}] must be a PagedStream, got {type(stream).__name__}")
        if stream.name in by_name:
            raise ValueError(f"streams[{index}].name={stream.name!r} is a duplicate")
        if block_size % stream.tokens_per_row:
            raise ValueError(
                f"block_size={block_size} must be a multiple of streams[{index}].tokens_per_row="
                f"{stream.tokens_per_row} (stream {stream.name!r})"
            )
        if stream.shares is None:
            owner[stream.name] = stream.name
            bytes_per_token += Fraction(stream.bytes_per_row, stream.tokens_per_row)
        else:
            target = by_name.get(stream.shares)
            if target is None:
                raise ValueError(
                    f"streams[{index}].shares={stream.shares!r} names no earlier stream "
                    f"(stream {stream.name!r})"
                )
            if (target.bytes_per_row, target.tokens_per_row) != (stream.bytes_per_row, stream.tokens_per_row):
                raise ValueError(
                    f"streams[{index}] ({stream.name!r}) shares {target.name!r} but its "
                    f"bytes_per_row/tokens_per_row {stream.bytes_per_row}/{stream.tokens_per_row} differ "
                    f"from {target.bytes_per_row}/{target.tokens_per_row}"
                )
            owner[stream.name] = owner[target.name]
        by_name[stream.name] = stream
    if not by_name:
        raise ValueError("streams must not be empty")
    return by_name, owner, bytes_per_token


def _place_streams(
    by_name: dict[str, PagedStream], owner: dict[str, str], block_size: int, num_blocks: int
) -> tuple[dict[str, StreamPlacement], int]:
    placements: dict[str, StreamPlacement] = {}
    end = 0
    for name, stream in by_name.items():
        if owner[name] != name:
            placements[name] = placements[owner[name]]
            continue
        rows_per_block = block_size // stream.tokens_per_row
        stride = rows_per_block * stream.bytes_per_row
        offset = _align(end, REGION_ALIGN)
        placements[name] = StreamPlacement(offset, rows_per_block, stream.bytes_per_row, stride)
        end = offset + num_blocks * stride
    return placements, end


def plan_paged_layout(
    streams: Sequence[PagedStream],
    block_size: int,
    *,
    num_blocks: int | None = None,
    budget_bytes: int | None = None,
) -> PagedLayout:
    """Places every paged stream's blocks in one uint8 buffer.

    Args:
        streams: the streams, in buffer order (a sharer after the stream it shares).
        block_size: tokens per block, > 0 and a multiple of every stream's tokens_per_row.
        num_blocks: blocks per stream, reserved block 0 included, >= 2. Exactly one of num_blocks
            and budget_bytes must be given.
        budget_bytes: bytes available; the layout takes the largest num_blocks whose padded
            total_bytes fits.

    Returns:
        The PagedLayout; buffer = uint8[total_bytes].

    Raises:
        ValueError: naming the bad field: empty or duplicate streams, unknown or mismatched
            `shares`, a block_size that is not a multiple of a tokens_per_row, both or neither of
            num_blocks/budget_bytes, num_blocks < 2, or a budget too small for 2 blocks.
    """
    _check_int("block_size", block_size, 1)
    if (num_blocks is None) == (budget_bytes is None):
        raise ValueError("exactly one of num_blocks and budget_bytes must be given")
    by_name, owner, exact_bytes_per_token = _stream_geometry(streams, block_size)
    total_alignment = math.lcm(TOTAL_ALIGN_BASE, math.ceil(exact_bytes_per_token))

    def total_for(count: int) -> tuple[dict[str, StreamPlacement], int]:
        placements, end = _place_streams(by_name, owner, block_size, count)
        return placements, _align(end, total_alignment)

    if num_blocks is not None:
        count = _check_int("num_blocks", num_blocks, 2)
    else:
        budget = _check_int("budget_bytes", budget_bytes, 0)
        bytes_per_block = sum(s.block_stride for n, s in total_for(1)[0].items() if owner[n] == n)
        low, high = 1, budget // bytes_per_block + 1  # total_for(high) > budget always
        while high - low > 1:  # invariant: total_for(low) fits or low == 1, total_for(high) does not
            mid = (low + high) // 2
            if total_for(mid)[1] <= budget:
                low = mid
            else:
                high = mid
        if low < 2 or total_for(low)[1] > budget:
            raise ValueError(
                f"budget_bytes={budget} is below the {total_for(2)[1]} bytes that 2 blocks need "
                "(block 0 is reserved)"
            )
        count = low
    placements, total = total_for(count)
    return PagedLayout(
        num_blocks=count,
        block_size=block_size,
        bytes_per_block=sum(p.block_stride for n, p in placements.items() if owner[n] == n),
        total_bytes=total,
        bytes_per_token=float(exact_bytes_per_token),
        total_alignment=total_alignment,
        streams=MappingProxyType(placements),
    )


@dataclass(frozen=True, slots=True)
class StateRegion:
    """One per-sequence state region (a window ring, a compressor accumulator, ...).

    Attributes:
        name: unique region name.
        num_bytes: bytes per slot, > 0.
        stored: True if saved to a KV store with the sequence; False if dropped (recomputable).
    """

    name: str
    num_bytes: int
    stored: bool

    def __post_init__(self) -> None:
        _check_name("StateRegion.name", self.name)
        _check_int(f"StateRegion({self.name!r}).num_bytes", self.num_bytes, 1)
        if not isinstance(self.stored, bool):
            raise ValueError(f"StateRegion({self.name!r}).stored must be a bool, got {self.stored!r}")


@dataclass(frozen=True, slots=True)
class RegionPlacement:
    """Where one region lives inside every slot; offsets are relative to the slot start."""

    offset: int  # 32-byte aligned
    num_bytes: int
    stored: bool


@dataclass(frozen=True, slots=True)
class StateLayout:
    """Result of plan_state_layout: one uint8 buffer of num_slots slots of slot_bytes each."""

    num_slots: int  # slot 0 (the dummy slot) included
    slot_bytes: int  # multiple of 32
    total_bytes: int  # num_slots * slot_bytes
    state_size_to_disk: int  # end of the last stored region; 0 if none is stored
    regions: Mapping[str, RegionPlacement]  # read-only, in slot order (stored first)

    def region_offset(self, name: str, slot: int) -> int:
        """Byte offset of region name of slot slot in the buffer.

        Raises:
            ValueError: unknown region name or slot outside [0, num_slots).
        """
        if name not in self.regions:
            raise ValueError(f"name={name!r} is not a region of this layout")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot={slot} out of range [0, {self.num_slots})")
        return slot * self.slot_bytes + self.regions[name].offset


def plan_state_layout(regions: Sequence[StateRegion], num_slots: int) -> StateLayout:
    """Lays out the per-sequence state regions inside a slot and the slots in one uint8 buffer.

    Args:
        regions: the regions; stored ones are placed first, then dropped ones, each group in the
            given order.
        num_slots: slots in the buffer, dummy slot 0 included, >= 2 (e.g.
            BlockManager.for_state_slots(...).num_blocks).

    Returns:
        The StateLayout; buffer = uint8[total_bytes], slot s = buffer[s * slot_bytes:][:slot_bytes].

    Raises:
        ValueError: naming the bad field: empty regions, a duplicate name, num_slots < 2.
    """
    _check_int("num_slots", num_slots, 2)
    names: set[str] = set()
    for index, region in enumerate(regions):
        if not isinstance(region, StateRegion):
            raise ValueError(f"regions[{index}] must be a StateRegion, got {type(region).__name__}")
        if region.name in names:
            raise ValueError(f"regions[{index}].name={region.name!r} is a duplicate")
        names.add(region.name)
    if not names:
        raise ValueError("regions must not be empty")
    ordered = [r for r in regions if r.stored] + [r for r in regions if not r.stored]
    placements: dict[str, RegionPlacement] = {}
    end = 0
    state_size_to_disk = 0
    for region in ordered:
        offset = _align(end, REGION_ALIGN)
        placements[region.name] = RegionPlacement(offset, region.num_bytes, region.stored)
        end = offset + region.num_bytes
        if region.stored:
            state_size_to_disk = end
    slot_bytes = _align(end, REGION_ALIGN)
    return StateLayout(
        num_slots=num_slots,
        slot_bytes=slot_bytes,
        total_bytes=num_slots * slot_bytes,
        state_size_to_disk=state_size_to_disk,
        regions=MappingProxyType(placements),
    )
