"""The bytes of a handoff on the wire: length-prefixed frames (an 8-byte big-endian length, then that
many bytes). A handoff is a JSON header frame (its metadata and, per tensor, name, dtype and shape)
followed by one frame of raw bytes per tensor, in the header's order; nothing else (docs/design.md
§15). Also the JSON of a `PrefillOrder` (the prefill request's body)."""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..core.kv_handoff import KVPayload, ModelFingerprint, PrefilledRequest, PrefillOrder
from ..sampling.sampling_params import SamplingParams

_LENGTH = struct.Struct(">Q")
MAX_HEADER_BYTES = 64 << 20          # a header frame longer than this is refused
MAX_TENSOR_BYTES = 1 << 40           # as a tensor frame
_DTYPES = {str(d): d for d in (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                               torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)}


def frame(payload: bytes | memoryview) -> list[bytes | memoryview]:
    """One frame: its length, then the payload (two buffers, so a large payload is not copied)."""
    return [_LENGTH.pack(len(payload)), payload]


def handoff_frames(handoff: PrefilledRequest) -> Iterator[bytes | memoryview]:
    """The buffers of a handoff's frames, in order (header, then each tensor's bytes)."""
    tensors = [] if handoff.kv is None else [("blocks", "blocks", handoff.kv.blocks)] + \
        [("state", n, t) for n, t in handoff.kv.state.items()]
    header = {
        "request_id": handoff.request_id, "prompt_token_ids": list(handoff.prompt_token_ids),
        "first_token_id": handoff.first_token_id, "first_rank": handoff.first_rank,
        "first_logprobs": None if handoff.first_logprobs is None else list(handoff.first_logprobs.items()),
        "fingerprint_key": handoff.fingerprint_key, "has_kv": handoff.kv is not None,
        "tensors": [[kind, name, str(t.dtype), list(t.shape)] for kind, name, t in tensors],
    }
    yield from frame(json.dumps(header).encode())
    for _, _, tensor in tensors:
        yield from frame(memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy()))


def read_handoff(read: Callable[[int], bytes]) -> PrefilledRequest:
    """A handoff from a byte stream; `read(n)` returns up to n bytes (b"" at the end).

    Raises:
        ConnectionError: the stream ended inside the handoff (a transfer cut mid-way), saying where.
        ValueError: bytes that are not a handoff (a bad length, header or dtype).
    """
    header = json.loads(_read_frame(read, MAX_HEADER_BYTES, "header"))
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise ValueError("the handoff header is not a JSON object with a 'tensors' list")
    blocks: torch.Tensor | None = None
    state: dict[str, torch.Tensor] = {}
    for kind, name, dtype_name, shape in header["tensors"]:
        dtype = _DTYPES.get(dtype_name)
        if dtype is None or kind not in ("blocks", "state"):
            raise ValueError(f"the handoff tensor {name!r} has kind {kind!r} and dtype {dtype_name!r}")
        data = bytearray(_read_frame(read, MAX_TENSOR_BYTES, f"tensor {name!r}"))
        tensor = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        if kind == "blocks":
            blocks = tensor.view(dtype).reshape(shape)
        else:
            state[name] = tensor.view(dtype).reshape(shape)
    if header["has_kv"] and blocks is None:
        raise ValueError("the handoff has KV but no 'blocks' tensor")
    logprobs = header["first_logprobs"]
    return PrefilledRequest(
        str(header["request_id"]), tuple(int(t) for t in header["prompt_token_ids"]), int(header["first_token_id"]),
        None if logprobs is None else {int(t): float(lp) for t, lp in logprobs},
        None if header["first_rank"] is None else int(header["first_rank"]),
        KVPayload(blocks, state) if blocks is not None else None, str(header["fingerprint_key"]),
    )


def _read_frame(read: Callable[[int], bytes], limit: int, what: str) -> bytes:
    length = _LENGTH.unpack(_read_exact(read, _LENGTH.size, what))[0]
    if length > limit:
        raise ValueError(f"the handoff's {what} frame claims {length} bytes (at most {limit})")
    return _read_exact(read, length, what)


def _read_exact(read: Callable[[int], bytes], num_bytes: int, what: str) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < num_bytes:
        part = read(min(num_bytes - got, 1 << 22))
        if not part:
            raise ConnectionError(f"the transfer was cut in the handoff's {what} ({got} of {num_bytes} bytes came)")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def order_json(order: PrefillOrder, fingerprint: ModelFingerprint) -> dict[str, Any]:
    """The body of a prefill request (with the asking engine's fingerprint: its model for messages, its
    key to be compared)."""
    params = {f.name: getattr(order.params, f.name) for f in dataclasses.fields(SamplingParams)}
    params["logit_bias"] = None if order.params.logit_bias is None else \
        [list(pair) for pair in order.params.logit_bias_pairs]
    return {"request_id": order.request_id, "prompt_token_ids": list(order.prompt_token_ids), "params": params,
            "fingerprint_key": fingerprint.key, "model": fingerprint.model}


def order_from_json(body: object) -> tuple[PrefillOrder, ModelFingerprint]:
    """(the order, the asking engine's fingerprint) from a prefill request's body.

    Raises:
        ValueError: a body that is not one (InvalidSamplingParams for bad sampling parameters).
    """
    if not isinstance(body, dict) or not {"request_id", "prompt_token_ids", "params", "fingerprint_key"} <= body.keys():
        raise ValueError("a prefill request is a JSON object with request_id, prompt_token_ids, params and "
                         "fingerprint_key")
    ids = body["prompt_token_ids"]
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ValueError("prompt_token_ids must be a list of ints")
    raw = body["params"]
    if not isinstance(raw, dict) or not raw.keys() <= {f.name for f in dataclasses.fields(SamplingParams)}:
        raise ValueError("params must be an object of SamplingParams fields")
    if raw.get("structured") is not None:
        raise ValueError("structured output is not supported yet with prefill/decode disaggregation")
    if raw.get("logit_bias") is not None:
        raw = {**raw, "logit_bias": [tuple(pair) for pair in raw["logit_bias"]]}
    asking = ModelFingerprint(str(body.get("model", "an unnamed model")), str(body["fingerprint_key"]))
    return PrefillOrder(str(body["request_id"]), tuple(ids), SamplingParams(**raw)), asking


__all__ = ["handoff_frames", "order_from_json", "order_json", "read_handoff"]
