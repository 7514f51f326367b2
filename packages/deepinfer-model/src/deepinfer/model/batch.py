"""ForwardBatch: one step's packed, variable-length input to the model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Tokens of several sequences packed end to end; sequence i owns rows
    cu_seqlens[i] .. cu_seqlens[i+1] − 1, at consecutive positions from start_positions[i].

    A sequence's rows are a prefill chunk (possibly cut inside a compression window) or one or more
    decode query tokens (several when verifying drafts). Sequences may be at any positions.
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
        width = max((len(t) for t in block_tables), default=0)
        table = torch.zeros(n, max(width, 1), dtype=torch.int32)
        for i, t in enumerate(block_tables):
            table[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.int32)
        flat = [t for toks in token_ids for t in toks]
        rows = list(range(cu[-1])) if logits == "all" else [c - 1 for c in cu[1:]]
        return cls(
            token_ids=torch.tensor(flat, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            cu_seqlens=tuple(cu),
            start_positions=tuple(int(s) for s in start_positions),
            block_tables=table.to(device),
            state_slots=torch.tensor(list(state_slots), dtype=torch.int64, device=device),
            logits_indices=torch.tensor(rows, dtype=torch.int64, device=device),
            max_context_len=max(s + len(t) for s, t in zip(start_positions, token_ids)) if n else 0,
            uniform_decode=n > 0 and all(len(t) == 1 for t in token_ids),
        )
