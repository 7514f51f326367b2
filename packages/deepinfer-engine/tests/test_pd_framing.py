"""The handoff's wire format (issue #33): frames round-trip every tensor bit for bit (bf16 and FP8
included) with the metadata; a stream cut anywhere raises ConnectionError saying where; a bad frame
is refused; a prefill order's JSON round-trips its sampling parameters. No model is loaded."""

from __future__ import annotations

import io

import pytest
import torch

from deepinfer.engine import SamplingParams
from deepinfer.engine.core.kv_handoff import KVPayload, ModelFingerprint, PrefilledRequest, PrefillOrder
from deepinfer.engine.disagg.framing import handoff_frames, order_from_json, order_json, read_handoff


def _handoff() -> PrefilledRequest:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40), generator=gen, dtype=torch.int64).to(torch.uint8)
    state = {"layers.0.window": torch.randn(10, 8, generator=gen).to(torch.bfloat16),
             "layers.0.indexer.kv": torch.randn(6, 16, generator=gen).to(torch.float8_e4m3fn),
             "layers.0.compressor.kv": torch.zeros(0, 4)}
    return PrefilledRequest("r1", (5, 6, 7), 42, {42: -0.25, 7: -1.5}, 0, KVPayload(blocks, state), "k" * 64)


def _wire(handoff: PrefilledRequest) -> bytes:
    return b"".join(bytes(buffer) for buffer in handoff_frames(handoff))


def test_a_handoff_round_trips_bit_for_bit() -> None:
    sent = _handoff()
    got = read_handoff(io.BytesIO(_wire(sent)).read)
    assert (got.request_id, got.prompt_token_ids, got.first_token_id, got.first_logprobs, got.first_rank,
            got.fingerprint_key) == (sent.request_id, sent.prompt_token_ids, 42, {42: -0.25, 7: -1.5}, 0, "k" * 64)
    assert got.kv is not None and sent.kv is not None and got.kv.num_bytes == sent.kv.num_bytes
    assert torch.equal(got.kv.blocks, sent.kv.blocks)
    assert list(got.kv.state) == list(sent.kv.state)
    for name, tensor in sent.kv.state.items():
        assert got.kv.state[name].dtype == tensor.dtype and got.kv.state[name].shape == tensor.shape
        assert torch.equal(got.kv.state[name].view(torch.uint8), tensor.view(torch.uint8))
    no_kv = PrefilledRequest("r2", (1,), 3, None, None, None, "k")
    assert read_handoff(io.BytesIO(_wire(no_kv)).read).kv is None


@pytest.mark.parametrize("cut_at", [0, 5, 20, -100, -1])
def test_a_cut_stream_says_where(cut_at: int) -> None:
    wire = _wire(_handoff())
    with pytest.raises(ConnectionError, match=r"the transfer was cut in the handoff's (header|tensor '.*') "
                                              r"\(\d+ of \d+ bytes came\)"):
        read_handoff(io.BytesIO(wire[:cut_at]).read)


def test_bad_frames_are_refused() -> None:
    with pytest.raises(ValueError, match="claims 18446744073709551615 bytes"):
        read_handoff(io.BytesIO(b"\xff" * 8).read)
    header = b'{"tensors": [["blocks", "x", "torch.complex64", [1]]]}'
    with pytest.raises(ValueError, match="dtype 'torch.complex64'"):
        read_handoff(io.BytesIO(len(header).to_bytes(8, "big") + header).read)


def test_an_order_round_trips_its_sampling_parameters() -> None:
    params = SamplingParams(temperature=0.7, top_k=5, seed=2**63, max_tokens=9, stop=["\n\n"], logit_bias={3: -2.0},
                            logprobs=2, min_tokens=1, bad_words=["foo"], stop_token_ids=[7])
    order, asking = order_from_json(order_json(PrefillOrder("q", (1, 2), params), ModelFingerprint("M", "key")))
    assert (order.request_id, order.prompt_token_ids, order.params) == ("q", (1, 2), params)
    assert asking == ModelFingerprint("M", "key")
    with pytest.raises(ValueError, match="structured output is not supported yet"):
        order_from_json({"request_id": "q", "prompt_token_ids": [1], "params": {"structured": {"regex": "a"}},
                         "fingerprint_key": "k"})
    with pytest.raises(ValueError, match="prompt_token_ids must be a list of ints"):
        order_from_json({"request_id": "q", "prompt_token_ids": "12", "params": {}, "fingerprint_key": "k"})
