"""ForwardBatch: one step's packed, variable-length input to the model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Tokens of several sequences packed end to end; sequence i owns rows
    cu_seqlens[i] .. cu_seqlens[i+1] − 1, at consecutive positions from start_positions[i].

    A sequence's rows are a prefill chunk (possibly cut inside a compression window) or one or more
    decode query tokens (several when verifying drafts). Sequences may be at any positions.

    A multi-token decode (`multi_decode`: verify rows of 1 … max_query_len query tokens each) is a
    uniform decode over *virtual sequences*, one per token, each carrying its row's state slot and
    block table and its own position; several virtual sequences then share a state slot.

    `decode_step` says which exchange expert-parallel MoE layers use, and every rank of an EP group
    must agree on it: it is a property of the engine's step kind, not of the rows (a prefill step of
    one-token chunks is a uniform decode for attention, but `build` leaves `decode_step` False, since
    its peers may prefill longer chunks in the same step).
    """

    token_ids: Tensor         # [num_tokens] int64
    positions: Tensor         # [num_tokens] int64 absolute positions
    cu_seqlens: tuple[int, ...]        # [num_seqs + 1] row offsets (host ints)
    start_positions: tuple[int, ...]   # [num_seqs] position of each sequence's first row (= tokens cached before)
    block_tables: Tensor      # [num_seqs, max_blocks] int32; 0 = no block
    state_slots: Tensor       # [num_seqs] int64; 0 = the dummy slot
    logits_indices: Tensor    # [num_logits] int64 rows whose logits the forward returns
    max_context_len: int = 0  # ≥ every sequence's start + query length (a CUDA graph pads it to its capacity)
    uniform_decode: bool = False   # every sequence has exactly one query row (the batched decode path)
    max_query_len: int = 1    # uniform decode: most tokens one scheduler row feeds (> 1: virtual sequences share slots)
    decode_step: bool = False  # a decode step (`decode`, `multi_decode`): every EP peer runs one too, so MoE
                               # layers under expert parallelism take the fixed-capacity exchange

    @property
    def num_seqs(self) -> int:
        return len(self.start_positions)

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],
        start_positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        state_slots: Sequence[int],
        *,
        logits: str = "last",
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Pack per-sequence token lists.

        Args:
            logits: "last" (one row per sequence: its last token) or "all" (every row).
        Raises:
            ValueError: mismatched lengths, an empty sequence, or a negative start position.
        """
        n = len(token_ids)
        if not (len(start_positions) == len(block_tables) == len(state_slots) == n):
            raise ValueError("token_ids, start_positions, block_tables and state_slots must have equal lengths")
        if logits not in ("last", "all"):
            raise ValueError(f"logits={logits!r} must be 'last' or 'all'")
        cu = [0]
        positions: list[int] = []
        for i, (toks, start) in enumerate(zip(token_ids, start_positions)):
            if len(toks) == 0:
                raise ValueError(f"sequence {i} has no tokens")
            if start < 0:
                raise ValueError(f"start_positions[{i}]={start} must be >= 0")
            positions.extend(range(start, start + len(toks)))
            cu.append(cu[-1] + len(toks))
        lengths = [len(t) for t in block_tables]
        width = max(lengths, default=0)
        table = np.zeros((n, max(width, 1)), dtype=np.int32)
        if width:     # one scatter into the padded table instead of a copy per row
            table_rows = np.repeat(np.arange(n), lengths)
            columns = np.arange(len(table_rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            table[table_rows, columns] = np.concatenate([np.asarray(t, dtype=np.int64) for t in block_tables if len(t)])
        flat = [t for toks in token_ids for t in toks]
        rows = list(range(cu[-1])) if logits == "all" else [c - 1 for c in cu[1:]]
        return cls(
            token_ids=torch.tensor(flat, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            cu_seqlens=tuple(cu),
            start_positions=tuple(int(s) for s in start_positions),
            block_tables=torch.from_numpy(table).to(device),
            state_slots=torch.tensor(list(state_slots), dtype=torch.int64, device=device),
            logits_indices=torch.tensor(rows, dtype=torch.int64, device=device),
            max_context_len=max(s + len(t) for s, t in zip(start_positions, token_ids)) if n else 0,
            uniform_decode=n > 0 and all(len(t) == 1 for t in token_ids),
        )

    @classmethod
    def decode(
        cls,
        token_ids: np.ndarray | Tensor,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        state_slots: np.ndarray,
        *,
        device: torch.device | str = "cpu",
        to_device: Callable[[np.ndarray], Tensor] | None = None,
    ) -> ForwardBatch:
        """A decode step of one query token per sequence, straight from the scheduler's arrays (one
        copy each, no Python lists); the same batch as `build([[t] for t in token_ids],
        seq_lens - 1, block_tables, state_slots)`.

        Args:
            token_ids: [num_seqs] integer input token of each sequence, or an int64 tensor of them
                already on `device` (a ZOS engine takes them from the previous step's samples there).
            seq_lens: [num_seqs] integer K length after this step (>= 1): the token sits at seq_len − 1.
            block_tables: [num_seqs, max_blocks] integer block ids, 0-padded.
            state_slots: [num_seqs] integer state slot of each sequence.
            to_device: how a host array reaches `device` (default: `torch.from_numpy(a).to(device)`;
                an engine passes a pinned, non-blocking copy).
        Raises:
            ValueError: mismatched shapes, no sequence, or a seq_len < 1.
        """
        n = len(token_ids)
        if n == 0:
            raise ValueError("a decode batch needs at least one sequence")
        if seq_lens.shape != (n,) or state_slots.shape != (n,) or block_tables.ndim != 2 or len(block_tables) != n:
            raise ValueError(f"token_ids [{n}], seq_lens {list(seq_lens.shape)}, state_slots "
                             f"{list(state_slots.shape)} and block_tables {list(block_tables.shape)} must agree")
        positions: np.ndarray = seq_lens.astype(np.int64) - 1
        if positions.min() < 0:
            raise ValueError(f"seq_lens must be >= 1, got {int(seq_lens.min())}")
        table = block_tables if block_tables.shape[1] else np.zeros((n, 1), dtype=np.int32)
        move = to_device or (lambda array: torch.from_numpy(array).to(device))
        return cls(
            token_ids=token_ids if isinstance(token_ids, Tensor) else move(token_ids.astype(np.int64)),
            positions=move(positions),
            cu_seqlens=tuple(range(n + 1)),
            start_positions=tuple(positions.tolist()),
            block_tables=move(np.array(table, dtype=np.int32)),
            state_slots=move(state_slots.astype(np.int64)),
            logits_indices=torch.arange(n, dtype=torch.int64, device=device),
            max_context_len=int(positions.max()) + 1,
            uniform_decode=True,
            decode_step=True,
        )

    @classmethod
    def multi_decode(
        cls,
        token_ids: np.ndarray | Tensor,
        positions: np.ndarray | Tensor,
        token_rows: np.ndarray | Tensor,
        block_tables: np.ndarray | Tensor,
        state_slots: np.ndarray | Tensor,
        *,
        max_query_len: int,
        max_context_len: int | None = None,
        device: torch.device | str = "cpu",
        to_device: Callable[[np.ndarray], Tensor] | None = None,
    ) -> ForwardBatch:
        """A multi-token decode step (the verify forward of speculative decoding): R scheduler rows,
        row i feeding q_i consecutive query tokens (1 <= q_i <= max_query_len), flattened to
        total_q = sum(q_i) tokens. Every token becomes a virtual sequence of one query row carrying
        its row's state slot and block table (gathered on the device: no host read) and its own
        position, so the model runs its static-shape batched decode path (`layers.batched_decode`;
        DeepSeek-V4.1: `layers.csa2_decode`) with shapes set by total_q alone: a CUDA graph keyed by
        total_q serves any split into rows.
        Logits are returned for every token, in the given order.

        Padding tokens (a graph larger than the step) point at a row whose block table is all zeros
        and whose state slot is 0 (the reserved block and the dummy slot), at position 0.

        Args:
            token_ids: [total_q] integer input tokens (anchor, then drafts, per row), or an int64 tensor
                on `device`.
            positions: [total_q] integer position of each token; a row's tokens are consecutive
                positions (in any order in the batch).
            token_rows: [total_q] integer index into block_tables / state_slots of each token's row.
            block_tables: [R, max_blocks] integer block ids (0-padded); state_slots: [R] integer.
            max_query_len: the largest q_i (or a bound on it: a graph captures the bound). The model
                checks that its state rings (window, compressor; V4.1's Engram history too) hold
                max_query_len − 1 spare rows (`cache_spec(max_backtracking >= max_query_len − 1)`).
            max_context_len: >= every position + 1; required when positions is a tensor (a graph
                passes its capacity). From host positions it defaults to their max + 1.
            to_device: how a host array reaches `device` (default: `torch.from_numpy(a).to(device)`).
        Returns:
            A uniform-decode batch of total_q virtual sequences. `start_positions` are the positions
            when they come from the host, zeros when only the device has them (the batched path never
            reads them); `cu_seqlens` = 0 … total_q.
        Raises:
            ValueError: mismatched shapes, no token, max_query_len < 1, or no max_context_len for
                device positions.
        """
        n = len(token_ids)
        if n == 0:
            raise ValueError("a multi-token decode batch needs at least one token")
        if max_query_len < 1:
            raise ValueError(f"max_query_len={max_query_len} must be >= 1")
        if len(positions) != n or len(token_rows) != n:
            raise ValueError(f"token_ids [{n}], positions [{len(positions)}] and token_rows [{len(token_rows)}] "
                             "must have one entry per token")
        if block_tables.ndim != 2 or len(block_tables) != len(state_slots):
            raise ValueError(f"block_tables {list(block_tables.shape)} and state_slots {list(state_slots.shape)} "
                             "must have one row per scheduler row")
        move = to_device or (lambda array: torch.from_numpy(array).to(device))

        def tensor(array: np.ndarray | Tensor, dtype: torch.dtype) -> Tensor:
            if isinstance(array, Tensor):
                return array.to(device=device, dtype=dtype)
            return move(np.ascontiguousarray(array, dtype=np.int64 if dtype == torch.int64 else np.int32))

        host_positions = None if isinstance(positions, Tensor) else np.asarray(positions, dtype=np.int64)
        if host_positions is not None:
            if host_positions.min() < 0:
                raise ValueError(f"positions must be >= 0, got {int(host_positions.min())}")
            max_context_len = max(max_context_len or 0, int(host_positions.max()) + 1)
        elif max_context_len is None:
            raise ValueError("positions on the device need a host max_context_len")
        if block_tables.shape[1] == 0:
            block_tables = np.zeros((len(state_slots), 1), dtype=np.int32)
        rows = tensor(token_rows, torch.int64)
        return cls(
            token_ids=tensor(token_ids, torch.int64),
            positions=tensor(positions, torch.int64),
            cu_seqlens=tuple(range(n + 1)),
            start_positions=tuple(host_positions.tolist()) if host_positions is not None else (0,) * n,
            block_tables=tensor(block_tables, torch.int32).index_select(0, rows),
            state_slots=tensor(state_slots, torch.int64).index_select(0, rows),
            logits_indices=torch.arange(n, dtype=torch.int64, device=device),
            max_context_len=max_context_len,
            uniform_decode=True,
            max_query_len=max_query_len,
            decode_step=True,
        )
