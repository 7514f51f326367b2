"""Penalties, logit_bias, allowed_token_ids and bad_words, applied to the logits on the device.

Everything that depends on the batch's composition is decided on the host when the step is launched
(`build_logit_controls`: index and value tensors, two host-to-device copies); everything that depends
on the tokens sampled so far lives on the device in a `TokenHistory`, so that a ZOS step launched
before the host has read the previous step's tokens still sees them. No operation here synchronises.

`TokenHistory` keeps one row per sequence that needs it (a penalty, or a bad word of more than one
token): the counts of its output tokens, a mask of its prompt tokens, and its last `HISTORY_WINDOW`
output tokens. The sampler adds each step's sampled token to its row (`record_tokens`); the engine
rebuilds a row from the host's tokens when a sampled token is dropped for recompute (`reset`).

The formulas are vLLM's (`apply_penalties`), in its order: allowed_token_ids, bad words, logit_bias,
then repetition (prompt and output tokens: a positive logit divided by the penalty, a negative one
multiplied), frequency (minus penalty × count) and presence (minus penalty if the count is > 0).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..device.staging import to_device
from ..text.tokenizer import Tokenizer
from .sampling_params import MAX_BAD_WORD_TOKENS, InvalidSamplingParams, SamplingParams

HISTORY_WINDOW = MAX_BAD_WORD_TOKENS - 1     # output tokens a bad word's prefix is compared with


class TokenHistory:
    """Per-sequence token history on the device; rows are handed out and taken back on the host.

    Attributes:
        counts: [num_rows, vocab_size] int32, how often each token occurs in the sequence's output.
        prompt_mask: [num_rows, vocab_size] bool, the tokens of its prompt.
        recent: [num_rows, HISTORY_WINDOW] int64, its last output tokens, oldest first; -1 = none.
    """

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self.recent = torch.full((0, HISTORY_WINDOW), -1, dtype=torch.int64, device=self.device)
        self._free: list[int] = []

    @property
    def num_used(self) -> int:
        return self.counts.shape[0] - len(self._free)

    def acquire(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> int:
        """A free row holding this sequence's prompt and outputs so far; returns its index."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.reset(row, prompt_token_ids, output_token_ids)
        return row

    def release(self, row: int) -> None:
        """Give a row back (its contents are rewritten by the next `acquire`)."""
        if not 0 <= row < self.counts.shape[0] or row in self._free:
            raise ValueError(f"row={row} is not a used TokenHistory row")
        self._free.append(row)

    def reset(self, row: int, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """Rewrite a row from the host's tokens (queued after any earlier device work on it)."""
        host_ids = np.fromiter(itertools.chain(prompt_token_ids, output_token_ids), dtype=np.int64)
        ids = to_device(host_ids, self.device) if host_ids.size else None     # in range: the engine checked them
        num_prompt = len(prompt_token_ids)
        self.prompt_mask[row] = False
        self.counts[row] = 0
        self.recent[row] = -1
        if ids is None:
            return
        prompt, output = ids[:num_prompt], ids[num_prompt:]
        if prompt.shape[0]:
            self.prompt_mask[row].index_fill_(0, prompt, True)
        if output.shape[0]:
            self.counts[row].index_add_(0, output, torch.ones_like(output, dtype=torch.int32))
            tail = output[-HISTORY_WINDOW:]
            self.recent[row, HISTORY_WINDOW - tail.shape[0]:] = tail

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        mask = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        recent = torch.full((new, HISTORY_WINDOW), -1, dtype=torch.int64, device=self.device)
        counts[:old], mask[:old], recent[:old] = self.counts, self.prompt_mask, self.recent
        self.counts, self.prompt_mask, self.recent = counts, mask, recent
        self._free.extend(range(new - 1, old - 1, -1))      # lowest row handed out first


@dataclass(frozen=True, slots=True)
class LogitControls:
    """The logit changes of one step's rows, as tensors on the logits' device.

    Build it with `build_logit_controls`; `apply_logit_controls` applies it and `record_tokens` adds
    the sampled tokens to the history.
    """

    allowed_rows: Tensor     # [num_restricted] int64, rows with an allowed_token_ids list
    allowed_pos: Tensor      # [num_allowed] int64, position in allowed_rows; pairs with allowed_ids
    allowed_ids: Tensor      # [num_allowed] int64
    ban_rows: Tensor         # [num_bans] int64; single-token bad words: always banned
    ban_ids: Tensor          # [num_bans] int64
    bias_rows: Tensor        # [num_biases] int64
    bias_ids: Tensor         # [num_biases] int64
    bias_values: Tensor      # [num_biases] float32
    history_rows: Tensor     # [num_tracked] int64, rows with a TokenHistory row
    history_slots: Tensor    # [num_tracked] int64, their TokenHistory rows
    presence: Tensor         # [num_tracked] float32
    frequency: Tensor        # [num_tracked] float32
    repetition: Tensor       # [num_tracked] float32
    word_pos: Tensor         # [num_words] int64, position in history_rows of a multi-token bad word
    word_prefix: Tensor      # [num_words, HISTORY_WINDOW] int64, its leading tokens right-aligned; -1 = any
    word_last: Tensor        # [num_words] int64, its last token (banned when the prefix matches)
    history: TokenHistory | None
    use_penalties: bool      # some tracked row has a penalty on
    use_repetition: bool     # some tracked row has repetition_penalty != 1


@dataclass
class _ControlLists:
    """The host lists `build_logit_controls` fills row by row, in `LogitControls` order."""

    allowed_rows: list[int] = field(default_factory=list)
    allowed_pos: list[int] = field(default_factory=list)
    allowed_ids: list[int] = field(default_factory=list)
    ban_rows: list[int] = field(default_factory=list)
    ban_ids: list[int] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)
    bias_ids: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    tracked: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    word_pos: list[int] = field(default_factory=list)
    word_prefix: list[int] = field(default_factory=list)
    word_last: list[int] = field(default_factory=list)

    def allow(self, row: int, kept: list[int]) -> None:
        self.allowed_pos += [len(self.allowed_rows)] * len(kept)
        self.allowed_ids += kept
        self.allowed_rows.append(row)

    def bias(self, row: int, pairs: list[tuple[int, float]]) -> None:
        self.bias_rows += [row] * len(pairs)
        self.bias_ids += [t for t, _ in pairs]
        self.bias_values += [b for _, b in pairs]

    def ban_words(self, row: int, words: list[Sequence[int]], slot: int | None) -> None:
        """One-token words are banned outright; longer ones when the row's history ends in their prefix
        (the row is tracked: `slot` is its TokenHistory row)."""
        for word in words:
            if len(word) == 1:
                self.ban_rows.append(row)
                self.ban_ids.append(word[0])
                continue
            if slot is None:
                raise ValueError(f"row {row} has a bad word of {len(word)} tokens but no TokenHistory row")
            self.word_pos.append(len(self.tracked) - 1)
            self.word_prefix += [-1] * (HISTORY_WINDOW - len(word) + 1) + list(word[:-1])
            self.word_last.append(word[-1])

    def int_parts(self) -> tuple[list[int], ...]:
        return (self.allowed_rows, self.allowed_pos, self.allowed_ids, self.ban_rows, self.ban_ids, self.bias_rows,
                self.bias_ids, self.tracked, self.slots, self.word_pos, self.word_prefix, self.word_last)


def build_logit_controls(params: Sequence[SamplingParams], history_slots: Sequence[int | None],
                         bad_word_ids: Sequence[Sequence[Sequence[int]]], history: TokenHistory | None,
                         vocab_size: int, device: torch.device) -> LogitControls | None:
    """The step's `LogitControls`, or None when no row uses any (host work; ids >= vocab_size are skipped).

    Args:
        params: one SamplingParams per row.
        history_slots: per row, its TokenHistory row, or None (a row needs one exactly when it has a
            penalty or a bad word of more than one token).
        bad_word_ids: per row, its tokenized bad words (each a non-empty id sequence).
    """
    rows = [row for row, (p, slot, words) in enumerate(zip(params, history_slots, bad_word_ids))
            if slot is not None or words or p.logit_bias or p.allowed_token_ids is not None]
    if not rows:
        return None
    lists = _ControlLists()
    for row in rows:
        p, slot = params[row], history_slots[row]
        if p.allowed_token_ids is not None:
            lists.allow(row, [t for t in p.allowed_token_ids if t < vocab_size])
        if p.logit_bias:
            lists.bias(row, [(t, b) for t, b in p.logit_bias_pairs if t < vocab_size])
        if slot is not None:
            lists.tracked.append(row)
            lists.slots.append(slot)
        lists.ban_words(row, [word for word in bad_word_ids[row] if word[-1] < vocab_size], slot)
    if lists.tracked and history is None:
        raise ValueError("rows with a TokenHistory row need the TokenHistory")
    return _on_device(lists, params, history, device)


def _on_device(lists: _ControlLists, params: Sequence[SamplingParams], history: TokenHistory | None,
               device: torch.device) -> LogitControls:
    """The lists as `LogitControls` tensors: two host-to-device copies (int64 and float32)."""
    tracked, bias_values = lists.tracked, lists.bias_values
    int_parts = lists.int_parts()
    ints = to_device(np.fromiter(itertools.chain.from_iterable(int_parts), dtype=np.int64,
                                 count=sum(map(len, int_parts))), device)
    chosen = [params[row] for row in tracked]
    floats = to_device(np.array(bias_values + [p.presence_penalty for p in chosen]
                                + [p.frequency_penalty for p in chosen] + [p.repetition_penalty for p in chosen],
                                dtype=np.float32), device)
    parts = torch.split(ints, [len(part) for part in int_parts])
    num_bias, num_tracked = len(bias_values), len(tracked)
    return LogitControls(
        allowed_rows=parts[0], allowed_pos=parts[1], allowed_ids=parts[2], ban_rows=parts[3], ban_ids=parts[4],
        bias_rows=parts[5], bias_ids=parts[6], bias_values=floats[:num_bias],
        history_rows=parts[7], history_slots=parts[8],
        presence=floats[num_bias:num_bias + num_tracked],
        frequency=floats[num_bias + num_tracked:num_bias + 2 * num_tracked],
        repetition=floats[num_bias + 2 * num_tracked:],
        word_pos=parts[9], word_prefix=parts[10].view(-1, HISTORY_WINDOW), word_last=parts[11],
        history=history if tracked else None,
        use_penalties=any(p.uses_penalties for p in chosen),
        use_repetition=any(p.repetition_penalty != 1 for p in chosen),
    )


def apply_logit_controls(logits: Tensor, controls: LogitControls) -> Tensor:
    """[num_seqs, vocab] float32 -> the same with the controls applied (a new tensor; no sync)."""
    minus_inf = logits.new_full((), -torch.inf)
    out = logits
    if controls.allowed_rows.shape[0]:
        keep = torch.zeros(controls.allowed_rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
        keep.index_put_((controls.allowed_pos, controls.allowed_ids), torch.ones((), dtype=torch.bool,
                                                                                 device=logits.device))
        restricted = out.index_select(0, controls.allowed_rows).masked_fill(~keep, -torch.inf)
        out = out.index_copy(0, controls.allowed_rows, restricted)
    if controls.ban_rows.shape[0]:
        out = out.index_put((controls.ban_rows, controls.ban_ids), minus_inf)
    if controls.bias_rows.shape[0]:
        out = out.index_put((controls.bias_rows, controls.bias_ids), controls.bias_values, accumulate=True)
    history = controls.history
    if history is None:
        return out
    tracked = out.index_select(0, controls.history_rows)
    if controls.word_pos.shape[0]:
        slots = controls.history_slots.index_select(0, controls.word_pos)
        recent = history.recent.index_select(0, slots)
        prefix = controls.word_prefix
        match = ((recent == prefix) | (prefix < 0)).all(dim=1)
        # accumulate: two words ending in the same token ban it if either matches
        tracked = tracked.index_put((controls.word_pos, controls.word_last),
                                    torch.where(match, -torch.inf, 0.0), accumulate=True)
    if controls.use_penalties:
        counts = history.counts.index_select(0, controls.history_slots)
        seen = counts > 0
        if controls.use_repetition:
            repeated = seen | history.prompt_mask.index_select(0, controls.history_slots)
            penalty = torch.where(repeated, controls.repetition[:, None], 1.0)
            tracked = torch.where(tracked > 0, tracked / penalty, tracked * penalty)
        tracked = tracked - controls.frequency[:, None] * counts - controls.presence[:, None] * seen
    return out.index_copy(0, controls.history_rows, tracked)


def record_tokens(controls: LogitControls, token_ids: Tensor) -> None:
    """Add each tracked row's sampled token ([num_seqs] int64, on the device) to its history (no sync)."""
    history = controls.history
    if history is None:
        return
    tokens = token_ids.index_select(0, controls.history_rows)
    slots = controls.history_slots
    history.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
    shifted = torch.cat((history.recent.index_select(0, slots)[:, 1:], tokens[:, None]), dim=1)
    history.recent.index_copy_(0, slots, shifted)


def tokenize_bad_words(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad words: each word (leading spaces stripped) as is, and with one leading
    space when that gives a different first token and as many tokens; duplicates dropped.

    Raises:
        InvalidSamplingParams: a word of more than MAX_BAD_WORD_TOKENS tokens (names its index).
    """
    result: list[tuple[int, ...]] = []
    for index, word in enumerate(words):
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (plain, spaced) if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain) \
                else (plain,):
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise InvalidSamplingParams(f"bad_words[{index}] is {len(ids)} tokens long; at most "
                                            f"{MAX_BAD_WORD_TOKENS} are allowed")
            if ids and ids not in result:
                result.append(ids)
    return tuple(result)
