"""Token bitmasks: filled on the host from grammar states, applied to logits before sampling.

Layout (xgrammar's): int32 [num_rows, ceil(vocab_size / 32)]; token t is allowed in a row when bit
t % 32 of word t // 32 is set. `apply_token_bitmask` is the reference (pure PyTorch, any device);
on CUDA it uses xgrammar's kernel when xgrammar is installed (not run in CI: no GPU there).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .grammar_backend import GrammarState, xgrammar_installed

_BIT_SHIFTS_U8 = torch.arange(8, dtype=torch.uint8)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row for `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> Tensor:
    """An all-allowed bitmask: int32 [num_rows, ceil(vocab_size / 32)] on the CPU, every bit set."""
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def unpack_token_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """int32 [rows, ceil(vocab_size / 32)] -> bool [rows, vocab_size], True = token allowed."""
    num_rows, width = bitmask.shape
    if sys.byteorder == "little":   # byte b of word w holds tokens 32w + 8b .. 32w + 8b + 7
        as_bytes = bitmask.contiguous().view(torch.uint8)                        # [rows, 4 * width]
        bits = as_bytes.unsqueeze(-1) >> _BIT_SHIFTS_U8.to(bitmask.device)      # [rows, 4 * width, 8]
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = bitmask.unsqueeze(-1) >> shifts                                   # [rows, width, 32]
    return (bits & 1).reshape(num_rows, width * 32)[:, :vocab_size].bool()


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: Tensor | None) -> Tensor:
    """Set disallowed tokens of the constrained rows to -inf (out of place).

    Args:
        logits: [num_seqs, vocab_size] float32.
        bitmask: [num_constrained, ceil(vocab_size / 32)] int32, same device as logits.
        rows: [num_constrained] int64, the logits row of each bitmask row (distinct); None = every
            row is constrained, bitmask row i being logits row i (no gather / scatter).
    Returns:
        A new [num_seqs, vocab_size] tensor (`logits` itself when no row is constrained); rows not
        in `rows` are unchanged.
    """
    if bitmask.shape[0] == 0:
        return logits
    selected = logits.clone() if rows is None else logits.index_select(0, rows)
    kernel = _xgrammar_cuda_kernel() if logits.device.type == "cuda" else None
    if kernel is not None:
        kernel(selected, bitmask, vocab_size=logits.shape[1])
    else:
        selected.masked_fill_(~unpack_token_bitmask(bitmask, logits.shape[1]), -torch.inf)
    return selected if rows is None else logits.index_copy(0, rows, selected)


@dataclass(frozen=True, slots=True)
class StepBitmask:
    """The token masks of one step's constrained rows."""

    bitmask: Tensor                 # [len(rows), ceil(vocab_size / 32)] int32, CPU
    rows: tuple[int, ...]           # logits row of each bitmask row, ascending
    dead_rows: tuple[int, ...]      # rows whose grammar allows no token: their mask is left open,
                                    # their sampled token is discarded and the request fails
    dead_reasons: tuple[str, ...]   # why, per dead row


def fill_token_bitmask(
    grammars: Sequence[GrammarState | None],
    num_output_tokens: Sequence[int],
    banned_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
) -> StepBitmask | None:
    """Fill the masks of the rows that have a grammar (host work; xgrammar fills each row).

    Args:
        grammars: per logits row, the request's grammar state or None (unconstrained).
        num_output_tokens: per row, tokens the request has; each state must have consumed them all.
        banned_token_ids: per row, ids that may not be sampled now (EOS below min_tokens); they are
            cleared from the mask too, so a row left with no token is detected as a dead end.
        vocab_size: the logits width.
    Returns:
        None when no row has a grammar.
    Raises:
        StaleGrammarError: a state lags behind its request's tokens.
    """
    rows = tuple(i for i, grammar in enumerate(grammars) if grammar is not None)
    if not rows:
        return None
    bitmask = allocate_token_bitmask(len(rows), vocab_size)
    words = bitmask.numpy().view(np.uint32)          # shares memory with `bitmask`
    last_word_bits = np.uint32((1 << (vocab_size - 32 * (words.shape[1] - 1))) - 1)
    dead: dict[int, str] = {}

    def any_allowed(position: int) -> bool:
        return bool(words[position, :-1].any() or words[position, -1] & last_word_bits)

    for position, row in enumerate(rows):
        grammar = grammars[row]
        assert grammar is not None
        grammar.fill_bitmask(bitmask, position, expected_num_tokens=num_output_tokens[row])
        if not any_allowed(position):
            dead[row] = f"grammar dead end after {num_output_tokens[row]} output tokens: no token is allowed"
        for token_id in banned_token_ids[row]:
            if 0 <= token_id < vocab_size:
                words[position, token_id // 32] &= np.uint32(~(1 << (token_id % 32)) & 0xFFFFFFFF)
        if row not in dead and not any_allowed(position):
            dead[row] = (f"grammar dead end after {num_output_tokens[row]} output tokens: the grammar only "
                         "allows EOS / stop tokens, which min_tokens still bans")
        if row in dead:
            words[position] = np.uint32(0xFFFFFFFF)
    return StepBitmask(bitmask, rows, tuple(dead), tuple(dead.values()))


@functools.cache
def _xgrammar_cuda_kernel() -> Callable[..., None] | None:
    """xgrammar's in-place apply (its Triton kernel on CUDA), or None without xgrammar / Triton."""
    if importlib.util.find_spec("triton") is None or not xgrammar_installed():
        return None
    from xgrammar import apply_token_bitmask_inplace

    return apply_token_bitmask_inplace
