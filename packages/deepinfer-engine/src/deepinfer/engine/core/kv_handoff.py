"""Prefill/decode disaggregation, the engine's side (docs/design.md §15): what a PROMPT engine hands a
COMPLETION engine, the `KVTransfer` interface it goes through, and the copies between the cache and
a handoff.

A PROMPT engine, after a request's last prefill chunk has run and its first token is sampled,
copies the request's KV blocks and its whole state slot to host memory (`export_kv`, before the
scheduler frees them) and sends a `PrefilledRequest` through its `KVTransfer`. A COMPLETION engine
asks its `KVTransfer` to have a prompt prefilled (`request_prefill`), takes what arrives (`poll`),
admits the sequence with `Scheduler.add_prefilled_seq` (fresh blocks and a state slot) and writes
the KV and state into them (`import_kv`); from there it decodes like any sequence. The transports
(in process, TCP to a prefill server) live in `deepinfer.engine.disagg`; NORMAL engines hold the
null object, `NullKVTransfer`.

Both sides must lay out their caches alike (same model, dtypes, block size, ring lengths): the
`ModelFingerprint` of the two engines is compared when the decode side connects, so the rings are
copied slot for slot with no reordering.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from deepinfer.model import ModelCache

from ..config.engine_args import EngineArgs
from ..sampling.sampling_params import SamplingParams
from .cache_copies import block_bytes, gather_blocks, scatter_blocks
from .stats import TransferStats


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """What a pair of engines must share to hand KV over.

    Attributes:
        model: the model as the operator named it (the folder, or "the embedded model"), for messages.
        key: hex sha256 of config.json, the load format (and seed of dummy weights), dtypes, KV
            quantisation, YOCO truncation, max_model_len and the cache layout (streams, state regions,
            block size, ring lengths); equal keys = interchangeable KV.
    """

    model: str
    key: str


@dataclass(frozen=True, slots=True, eq=False)
class KVPayload:
    """A sequence's KV blocks and state slot in host memory.

    Attributes:
        blocks: [num_blocks, block_bytes] uint8, the blocks of positions [0, num_prompt_tokens) as
            `cache_copies.gather_blocks` lays them out (each block's rows of every paged stream).
        state: by state region name, [*region shape] of its dtype: the whole slot (stored and dropped
            regions: the compressors' open windows, Engram's look-back and the draft rings are state
            too; a prompt's end is no block boundary, so a prefix-cache snapshot would not do).
    """

    blocks: Tensor
    state: Mapping[str, Tensor]

    @property
    def num_bytes(self) -> int:
        return self.blocks.numel() + sum(t.numel() * t.element_size() for t in self.state.values())


@dataclass(frozen=True, slots=True, eq=False)
class PrefilledRequest:
    """A request whose prompt a PROMPT engine prefilled, with its first token.

    Attributes:
        request_id: the id the COMPLETION engine asked for (`PrefillOrder.request_id`).
        prompt_token_ids: the prompt.
        first_token_id: the token sampled from the last prompt position.
        first_logprobs: its logprobs entry ({token id: logprob}) when params.logprobs asked; else None.
        first_rank: the sampled token's rank in the vocabulary when logprobs were asked; else None.
        kv: the KV and state the prompt left; None when the request ended at its first token (EOS,
            a stop token, max_tokens 1), which the COMPLETION engine then finds again.
        fingerprint_key: `ModelFingerprint.key` of the engine that prefilled it.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token_id: int
    first_logprobs: dict[int, float] | None
    first_rank: int | None
    kv: KVPayload | None
    fingerprint_key: str


@dataclass(frozen=True, slots=True)
class PrefillOrder:
    """A COMPLETION engine's request to have a prompt prefilled (structured output, n > 1 and prompt
    logprobs are refused before one is made).

    Attributes:
        request_id: the COMPLETION engine's request id.
        prompt_token_ids: the prompt.
        params: the request's sampling parameters (the first token is sampled with them).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class TransferFailed:
    """A prefill order that will never arrive; `reason` says why (the request fails with it)."""

    request_id: str
    reason: str


class KVTransfer(Protocol):
    """How prefilled requests travel from a PROMPT engine to a COMPLETION engine. A PROMPT engine calls
    `send`; a COMPLETION engine `request_prefill`, `cancel` and `poll`; both `connect` once, with their
    fingerprint, when built (`LLMEngine.init_pd_split`), and report `stats`."""

    @property
    def prefills(self) -> bool:
        """True when `request_prefill` works (a COMPLETION engine may take `add_request`)."""

    def connect(self, fingerprint: ModelFingerprint) -> None:
        """Check the peer serves the same model; raises ValueError naming both models if not, or
        ConnectionError when the peer cannot be reached."""

    def send(self, handoff: PrefilledRequest) -> None:
        """PROMPT engine: hand a prefilled request on (never raises: a lost peer fails the request on
        the other side)."""

    def request_prefill(self, order: PrefillOrder) -> None:
        """COMPLETION engine: have a prompt prefilled; its `PrefilledRequest` or `TransferFailed` comes
        out of a later `poll`."""

    def cancel(self, request_id: str) -> None:
        """COMPLETION engine: the request was aborted; drop its order (nothing of it comes out of
        `poll`; what is in flight is cut off)."""

    def poll(self, timeout_s: float) -> list[PrefilledRequest | TransferFailed]:
        """COMPLETION engine: what arrived, waiting up to timeout_s for something (0 = do not wait)."""

    def stats(self) -> TransferStats:
        """KV handed over so far (sent or received)."""


class NullKVTransfer:
    """The `KVTransfer` of a NORMAL engine, and of a PROMPT engine nobody reads: sends are dropped,
    nothing is ever prefilled."""

    prefills = False

    def connect(self, fingerprint: ModelFingerprint) -> None:
        pass

    def send(self, handoff: PrefilledRequest) -> None:
        pass

    def request_prefill(self, order: PrefillOrder) -> None:
        raise ValueError("this engine has no prefill peer (a COMPLETION engine needs a KVTransfer that prefills)")

    def cancel(self, request_id: str) -> None:
        pass

    def poll(self, timeout_s: float) -> list[PrefilledRequest | TransferFailed]:
        return []

    def stats(self) -> TransferStats:
        return TransferStats()


def model_fingerprint(args: EngineArgs, model_dir: Path, cache: ModelCache, max_model_len: int) -> ModelFingerprint:
    """The fingerprint of an engine (`ModelFingerprint`)."""
    config = (model_dir / "config.json").read_bytes()
    spec = cache.spec
    layout = (spec.block_size, [(s.name, s.row_dim, s.tokens_per_row, str(s.dtype)) for s in spec.streams],
              [(r.name, list(r.shape), str(r.dtype)) for r in spec.states])
    parts = (hashlib.sha256(config).hexdigest(), args.load_format, args.seed if args.load_format == "dummy" else None,
             args.dtype, args.kv_quant, args.expert_dtype, args.yoco_prefill_truncation_mode,
             args.yoco_prefill_keep_tokens, max_model_len, layout)
    key = hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()
    return ModelFingerprint("the embedded model" if args.model is None else str(args.model), key)


def export_kv(cache: ModelCache, block_ids: Sequence[int], state_slot: int, *, with_state: bool = True) -> KVPayload:
    """Copy a sequence's blocks ([k] block ids) and (with_state) its state slot into host memory."""
    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=_device(cache))
    state = {name: view[state_slot].cpu() for name, view in cache.state.items()} if with_state else {}
    blocks = gather_blocks(cache, ids).cpu() if cache.paged else torch.zeros((len(ids), 0), dtype=torch.uint8)
    return KVPayload(blocks, state)


def import_kv(cache: ModelCache, block_ids: np.ndarray, state_slot: int, payload: KVPayload) -> None:
    """Write a `KVPayload` into fresh blocks ([k] int block ids, in order) and a state slot.

    Raises:
        ValueError: the payload does not fit this cache (another block count or size, a state region
            missing or extra, another shape or dtype); nothing is written then.
    """
    wanted = (len(block_ids), block_bytes(cache) if cache.paged else 0)
    if tuple(payload.blocks.shape) != wanted or payload.blocks.dtype != torch.uint8:
        raise ValueError(f"the transferred KV blocks are {tuple(payload.blocks.shape)} {payload.blocks.dtype}, this "
                         f"engine expects {wanted} torch.uint8")
    _check_fits({n: (*v.shape[1:], v.dtype) for n, v in cache.state.items()},
                {n: (*t.shape, t.dtype) for n, t in payload.state.items()})
    device = _device(cache)
    if cache.paged:                  # a model of sliding-window layers only keeps no paged KV
        scatter_blocks(cache, torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=device),
                       payload.blocks.to(device))
    for name, view in cache.state.items():
        view[state_slot].copy_(payload.state[name])


def _device(cache: ModelCache) -> torch.device:
    return next(iter((*cache.paged.values(), *cache.state.values()))).device


def _check_fits(wanted: Mapping[str, tuple], given: Mapping[str, tuple]) -> None:
    if wanted.keys() != given.keys():
        raise ValueError(f"the transferred KV has state regions {sorted(given)}, this engine {sorted(wanted)}")
    for name, shape in wanted.items():
        if given[name] != shape:
            raise ValueError(f"the transferred state region {name!r} is {given[name]}, this engine expects {shape}")


@dataclass(slots=True)
class PendingImports:
    """A COMPLETION engine's requests between `request_prefill` and their admission: the ones whose
    prefill is under way (`awaiting`), and those that arrived while the scheduler had no room for them
    (`arrived`, retried at every step, oldest first)."""

    awaiting: set[str] = field(default_factory=set)
    arrived: list[PrefilledRequest] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.awaiting) + len(self.arrived)

    def holds(self, request_id: str) -> bool:
        """Whether the request is here (not yet in the scheduler)."""
        return request_id in self.awaiting or any(h.request_id == request_id for h in self.arrived)

    def drop(self, request_id: str) -> bool:
        """Forget a request (aborted); True when it was awaiting its prefill (the transfer must cancel it)."""
        self.arrived = [h for h in self.arrived if h.request_id != request_id]
        if request_id in self.awaiting:
            self.awaiting.discard(request_id)
            return True
        return False


__all__ = ["KVPayload", "KVTransfer", "ModelFingerprint", "NullKVTransfer", "PendingImports", "PrefillOrder",
           "PrefilledRequest", "TransferFailed", "export_kv", "import_kv", "model_fingerprint"]
