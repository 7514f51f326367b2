"""CED / YOCO prefill truncation of DeepSeek-V4.1 (docs/design.md §8, spec §5).

From the first consumer layer S (the layer after the last KV source: every later layer reads its
global KV from the sources), a prefill row of a sequence matters only through the window KV it gives
the later layers, unless it is one of the sequence's last `keep_tokens` rows (whose logits, and whose
window KV for decoding, are wanted). Truncation runs the layers from S on for those tail rows only;
the earlier rows stay frozen at S (their residual streams and pre-mix as they entered S), and each
consumer layer still writes their window KV, computed from that frozen state. Approximate by design:
the frozen rows never see layers S and later.

Modes: "compact" gathers the tail rows (hidden, mHC pre-mix, the published top-k and candidates) into
a smaller batch and writes the frozen rows' KV into the window rings first; "mask" keeps every row,
resets the non-tail rows to their frozen state after each layer from S on — the same result with
more work, kept to check "compact". A step where no sequence has more than `keep_tokens` rows is
not changed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .batch import ForwardBatch
from .config_checks import ConfigError
from .config_v41 import DeepseekV41Config

TRUNCATION_MODES = ("off", "compact", "mask")
DEFAULT_KEEP_TOKENS = 140            # window 128 + backtracking margin (EngineArgs.yoco_prefill_keep_tokens)


@dataclass(frozen=True, slots=True)
class Truncation:
    """Prefill truncation settings of a model: `mode` in TRUNCATION_MODES, `keep_tokens` ≥ 1."""

    mode: str = "off"
    keep_tokens: int = DEFAULT_KEEP_TOKENS


def first_consumer_layer(cfg: DeepseekV41Config) -> int:
    """S: the layer after the last KV source."""
    return max(cfg.kv_source_layer_ids) + 1 if cfg.kv_source_layer_ids else cfg.num_hidden_layers


def check_truncation(cfg: DeepseekV41Config, truncation: Truncation) -> None:
    """The model-side constraints of docs/design.md §8 (prompt logprobs are checked per step).

    Raises:
        ConfigError: an unknown mode, keep_tokens < 1, no layer after the last KV source, an Engram
            layer at or after it, or DSpark target layers on both sides of it.
    """
    if truncation.mode not in TRUNCATION_MODES:
        raise ConfigError(f"prefill truncation mode={truncation.mode!r} must be one of {TRUNCATION_MODES}")
    keep = truncation.keep_tokens
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"prefill truncation keep_tokens={keep!r} must be an integer >= 1")
    if truncation.mode == "off":
        return
    s = first_consumer_layer(cfg)
    if s >= cfg.num_hidden_layers:
        raise ConfigError("prefill truncation needs layers after the last KV source "
                          f"(kv_source_layer_ids={list(cfg.kv_source_layer_ids)})")
    late = [layer for layer in cfg.engram_layer_ids if layer >= s]
    if late:
        raise ConfigError(f"prefill truncation: Engram layer(s) {late} at or after the first consumer layer {s}")
    sides = {layer >= s for layer in cfg.dspark_target_layer_ids}
    if len(sides) > 1:
        raise ConfigError(f"prefill truncation: dspark_target_layer_ids {list(cfg.dspark_target_layer_ids)} lie on "
                          f"both sides of the first consumer layer {s}")


@dataclass(frozen=True, slots=True)
class Frozen:
    """The non-tail rows entering layer S: streams [n, hc, hidden], pre-mix [n, hc], positions [n],
    and per sequence of the batch the row range [cu[i], cu[i + 1])."""

    h: Tensor
    pre_mix: Tensor
    positions: Tensor
    cu: tuple[int, ...]


class TruncationPlan:
    """Which rows of a step are each sequence's tail; None from `plan` when nothing is truncated."""

    def __init__(self, batch: ForwardBatch, keep: int) -> None:
        tail, head = [], []
        for i in range(batch.num_seqs):
            a, b = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
            cut = max(a, b - keep)
            head.append(torch.arange(a, cut))
            tail.append(torch.arange(cut, b))
        device = batch.token_ids.device
        self.tail_rows = torch.cat(tail).to(device)
        self.head_rows = torch.cat(head).to(device)
        self.tail_lens = [len(t) for t in tail]
        self.head_lens = [len(h) for h in head]
        in_tail = torch.zeros(batch.token_ids.shape[0], dtype=torch.bool, device=device)
        in_tail[self.tail_rows] = True
        if not bool(in_tail[batch.logits_indices].all()):
            raise ValueError("prefill truncation computes only each sequence's last rows: logits of earlier rows "
                             "(prompt logprobs) cannot be asked for")
        self.in_tail = in_tail

    @classmethod
    def plan(cls, batch: ForwardBatch, truncation: Truncation) -> TruncationPlan | None:
        if truncation.mode == "off":
            return None
        lengths = [b - a for a, b in zip(batch.cu_seqlens, batch.cu_seqlens[1:])]
        if max(lengths, default=0) <= truncation.keep_tokens:
            return None
        return cls(batch, truncation.keep_tokens)

    def compact(self, batch: ForwardBatch, h: Tensor, pre_mix: Tensor, published) -> tuple[ForwardBatch, Tensor,
                                                                                         Tensor, Frozen]:
        """The tail-only batch, its streams and pre-mix, the frozen head rows; gathers the published
        top-k and candidates to the tail rows in place."""
        cu = [0]
        for n in self.tail_lens:
            cu.append(cu[-1] + n)
        starts = tuple(s + h_len for s, h_len in zip(batch.start_positions, self.head_lens))
        remap = torch.full((batch.token_ids.shape[0],), -1, dtype=torch.int64, device=h.device)
        remap[self.tail_rows] = torch.arange(len(self.tail_rows), device=h.device)
        compact = dataclasses.replace(
            batch, token_ids=batch.token_ids[self.tail_rows], positions=batch.positions[self.tail_rows],
            cu_seqlens=tuple(cu), start_positions=starts, logits_indices=remap[batch.logits_indices],
            uniform_decode=False)
        for i, n in enumerate(self.tail_lens):
            for table in (published.picks, published.candidates):
                if table[i] is not None:
                    table[i] = table[i][table[i].shape[0] - n:]
        head_cu = [0]
        for n in self.head_lens:
            head_cu.append(head_cu[-1] + n)
        frozen = Frozen(h[self.head_rows], pre_mix[self.head_rows], batch.positions[self.head_rows], tuple(head_cu))
        return compact, h[self.tail_rows], pre_mix[self.tail_rows], frozen
