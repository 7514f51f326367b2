"""The MXFP4 decoders of the small-batch expert kernels (`triton_ops.mxfp4`) against
`reference.dequant_mxfp4`, and the expert ops through each of them against `reference.moe_experts_mxfp4`.

Runs on a CUDA device (every decoder; bfloat16 activations) and under Triton's CPU interpreter when
TRITON_INTERPRET=1 (float32 activations; the decoders the interpreter can run: not `MX_DOT_SCALED`,
whose weights no kernel exposes, nor the PTX of `MX_ASM`; op tests bounds-checked by `kernel_bounds`).
The PTX of `MX_ASM` and `MX_PACKED` on the CPU, emulated as Triton binds it: `test_mxfp4_asm.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer.kernels import reference, repack_mxfp4_for_decode

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")]
triton = pytest.importorskip("triton")
tl = triton.language
mxfp4 = pytest.importorskip("deepinfer.kernels.triton_ops.mxfp4")
from deepinfer.kernels.triton_ops import moe  # noqa: E402

# Decoders that expose their weight tile (MX_DOT_SCALED does not), and those the op runs here.
TILE_DECODES = [mxfp4.MX_BITS, mxfp4.MX_GROUP_DOT, mxfp4.MX_WORDS, mxfp4.MX_PACKED] + ([mxfp4.MX_ASM] if CUDA else [])
OP_DECODES = sorted(mxfp4.DECODES.values()) if CUDA else [mxfp4.MX_BITS, mxfp4.MX_GROUP_DOT, mxfp4.MX_WORDS,
                                                          mxfp4.MX_PACKED]
NAMES = {v: k for k, v in mxfp4.DECODES.items()}


@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, num_rows, k_in, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DECODE: tl.constexpr, BF16_MATH: tl.constexpr):
    """Columns 0 … BLOCK_K of MXFP4 rows (k_in columns stored) decoded as the expert kernels do,
    stored in logical order (MX_PACKED: natural): bf16 bits (int16), or for MX_GROUP_DOT the
    unscaled value × its group's factor as float32."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < num_rows
    words, scale = mxfp4._code_words(w_ptr + n[:, None] * (k_in // 2), s_ptr + n[:, None] * (k_in // 32), 0, k_in,
                                     nm, BLOCK_K)
    cols = tl.arange(0, BLOCK_K)
    if DECODE == 2:
        factor = mxfp4._spread(mxfp4._group_factor(scale).to(tl.float32), 32)
        out = mxfp4._unscaled(words, BLOCK_K, BF16_MATH).to(tl.float32) * factor
    else:
        if DECODE == 1:
            w = mxfp4._bits_tile(words, scale, BLOCK_K)
        elif DECODE == 3:
            w = mxfp4._words_tile(words, scale, BLOCK_K, BF16_MATH)
        elif DECODE == 4:
            w = mxfp4._asm_tile(words, scale, BLOCK_K)
        else:
            w = mxfp4._packed_tile(words, scale, BLOCK_K, BF16_MATH)
        out = w.to(tl.int16, bitcast=True)
    tl.store(out_ptr + n[:, None] * BLOCK_K + cols[None, :], out, mask=nm[:, None])


@triton.jit
def _columns_kernel(index_ptr, out_ptr, k_in, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """The natural column each logical column of `load_columns` holds (rows of 0, 1, …, k_in − 1)."""
    m = tl.arange(0, BLOCK_M)
    cols = mxfp4.load_columns(index_ptr + m[:, None] * 0, 0, k_in, (m < BLOCK_M)[:, None], BLOCK_K, True)
    tl.store(out_ptr + tl.arange(0, BLOCK_K), tl.max(cols, axis=1))


def logical_columns(block_k: int, k_in: int) -> torch.Tensor:
    """[block_k] int64: the natural column of each logical column (−1 past k_in)."""
    index = torch.arange(k_in, dtype=torch.int32, device=DEVICE)
    out = torch.empty(block_k, dtype=torch.int32, device=DEVICE)
    _columns_kernel[(1,)](index, out, k_in, BLOCK_K=block_k, BLOCK_M=16)
    cols = out.long().cpu()
    cols[torch.arange(block_k) >= k_in] = -1
    return cols


def decode(packed: torch.Tensor, scale: torch.Tensor, decoder: int, block_k: int) -> torch.Tensor:
    """Decoder `decoder`'s weights of `packed` / `scale` (checkpoint layout; re-packed here for
    MX_PACKED) at natural columns: bf16 bits (int16) or, for MX_GROUP_DOT, float32 bits (int32)."""
    rows, k_in = packed.shape[0], 2 * packed.shape[1]
    dtype = torch.float32 if decoder == mxfp4.MX_GROUP_DOT else torch.int16
    out = torch.empty(rows, block_k, dtype=dtype, device=DEVICE)
    codes = repack_mxfp4_for_decode(packed) if decoder == mxfp4.MX_PACKED else packed
    _decode_kernel[(triton.cdiv(rows, 64),)](codes.to(DEVICE), scale.to(DEVICE), out, rows, k_in, BLOCK_N=64,
                                            BLOCK_K=block_k, DECODE=decoder, BF16_MATH=CUDA)
    if decoder == mxfp4.MX_PACKED:
        return out.cpu()[:, :k_in].contiguous()
    cols = logical_columns(block_k, k_in)
    natural = torch.empty(rows, k_in, dtype=dtype)
    natural[:, cols[cols >= 0]] = out.cpu()[:, cols >= 0]
    return natural.view(torch.int32 if dtype == torch.float32 else torch.int16)


def expected_bits(packed: torch.Tensor, scale: torch.Tensor, decoder: int) -> torch.Tensor:
    values = reference.dequant_mxfp4(packed, scale)                       # float32, as the reference op
    if decoder == mxfp4.MX_GROUP_DOT:
        return values.view(torch.int32)
    return values.to(torch.bfloat16).view(torch.int16)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equal, except that any NaN matches any NaN (0 · inf at s = 255)."""
    float_type = torch.float32 if got.dtype == torch.int32 else torch.bfloat16
    got_nan, want_nan = torch.isnan(got.view(float_type)), torch.isnan(want.view(float_type))
    assert torch.equal(got_nan, want_nan)
    bad = (got != want) & ~want_nan
    assert not bad.any(), (f"{int(bad.sum())} codes differ, first at (scale byte row, column) "
                           f"{bad.nonzero()[0].tolist()}: {int(got[bad][0]):#06x} != {int(want[bad][0]):#06x}")


def test_logical_columns_permute_each_group_of_32() -> None:
    cols = logical_columns(128, 128)
    for g in range(4):
        assert sorted(cols[32 * g: 32 * g + 32].tolist()) == list(range(32 * g, 32 * g + 32))
    # lane c's A-fragment column pairs (2c, 2c + 8, 16 + 2c, 24 + 2c) are the bytes of code word c
    for c in range(4):
        assert [int(cols[p]) // 2 for p in (2 * c, 2 * c + 8, 16 + 2 * c, 24 + 2 * c)] == [4 * c + j for j in range(4)]


@pytest.mark.parametrize("decoder", TILE_DECODES, ids=lambda d: NAMES[d])
def test_every_code_at_every_scale_byte_decodes_exactly(decoder: int) -> None:
    """Row s holds each of the 16 codes twice (shuffled) under scale byte s, for s = 0 … 255: the
    subnormal results (s ≤ 1), overflow to inf (s ≥ 253), inf and NaN (s = 255) included."""
    gen = torch.Generator().manual_seed(decoder)
    codes = torch.stack([torch.arange(32)[torch.randperm(32, generator=gen)] % 16 for _ in range(256)])
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scale = torch.arange(256, dtype=torch.uint8)[:, None]
    assert_same_bits(decode(packed, scale, decoder, 32), expected_bits(packed, scale, decoder))


@pytest.mark.parametrize("decoder", TILE_DECODES, ids=lambda d: NAMES[d])
def test_random_rows_decode_exactly_past_a_partial_tile(decoder: int) -> None:
    """96 columns (3 groups) in a 128-column tile: random codes, random scale bytes 0–255."""
    gen = torch.Generator().manual_seed(100 + decoder)
    packed = torch.randint(0, 256, (80, 48), generator=gen, dtype=torch.uint8)
    scale = torch.randint(0, 256, (80, 3), generator=gen, dtype=torch.uint8)
    assert_same_bits(decode(packed, scale, decoder, 128), expected_bits(packed, scale, decoder))


def test_runnable_decode_falls_back_to_words_where_a_decoder_cannot_run() -> None:
    cpu = torch.zeros(1)
    assert mxfp4.runnable_decode(mxfp4.MX_DOT_SCALED, cpu) == mxfp4.MX_WORDS
    assert mxfp4.runnable_decode(mxfp4.MX_ASM, cpu) == mxfp4.MX_WORDS
    for decoder in (mxfp4.MX_BITS, mxfp4.MX_GROUP_DOT, mxfp4.MX_WORDS, mxfp4.MX_PACKED):
        assert mxfp4.runnable_decode(decoder, cpu) == decoder
    if CUDA:
        assert mxfp4.runnable_decode(mxfp4.MX_DOT_SCALED, cpu.cuda()) == mxfp4.MX_WORDS      # float32
        assert mxfp4.runnable_decode(mxfp4.MX_DOT_SCALED, cpu.cuda().bfloat16()) == mxfp4.MX_DOT_SCALED
        assert mxfp4.runnable_decode(mxfp4.MX_ASM, cpu.cuda()) == mxfp4.MX_ASM


def experts_case(seed: int, num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int = 6):
    """Tokens, routing (distinct experts per token) and MXFP4 experts: (x, ids, weights, [w13,
    w13_scale, w2, w2_scale])."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, DTYPE)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    q13 = [reference.quant_mxfp4(torch.randn(2 * inter, hidden, generator=gen) * hidden**-0.5)
           for _ in range(num_experts)]
    q2 = [reference.quant_mxfp4(torch.randn(hidden, inter, generator=gen) * inter**-0.5) for _ in range(num_experts)]
    args = [torch.stack([q[i] for q in qs]).to(DEVICE) for qs in (q13, q2) for i in (0, 1)]
    return x, ids.to(DEVICE), weights.to(DEVICE), args


def through(op, decoder: int, monkeypatch):
    """`op` (an MXFP4 experts op) as (x, ids, weights, w13, w13_scale, w2, w2_scale) → output with the
    swiglu limit 0.5, decoding by `decoder`: MX_PACKED on codes re-packed here (`packed=True`), the
    others as `moe.MXFP4_DECODE`."""
    if decoder != mxfp4.MX_PACKED:
        monkeypatch.setattr(moe, "MXFP4_DECODE", decoder)
        return lambda x, ids, weights, w13, s13, w2, s2: op(x, ids, weights, w13, s13, w2, s2, 0.5)
    return lambda x, ids, weights, w13, s13, w2, s2: op(x, ids, weights, repack_mxfp4_for_decode(w13), s13,
                                                         repack_mxfp4_for_decode(w2), s2, 0.5, packed=True)


@pytest.fixture
def checked(request):
    """Under the interpreter, every load and store of the expert kernels bounds-checked."""
    log = request.getfixturevalue("kernel_bounds") if INTERPRET else None
    yield
    if log is not None:
        log.assert_clean("_expert_up_kernel", "_expert_down_kernel")


@pytest.mark.parametrize(("num_tokens", "num_experts", "hidden", "inter"),
                         [(1, 8, 96, 160), (3, 16, 160, 96), (17, 8, 96, 160)])
@pytest.mark.parametrize("decoder", OP_DECODES, ids=lambda d: NAMES[d])
def test_experts_through_each_decoder_match_the_reference(decoder, num_tokens, num_experts, hidden, inter, checked,
                                                          monkeypatch) -> None:
    """Top-6 routing; hidden and intermediate sizes multiples of 32 but not of 128 (partial tiles).
    The weights are exact, so only the accumulation order differs from the reference."""
    x, ids, weights, args = experts_case(num_tokens * 7 + decoder, num_tokens, num_experts, hidden, inter)
    got = through(moe.moe_experts_mxfp4_fused, decoder, monkeypatch)(x, ids, weights, *args)
    want = reference.moe_experts_mxfp4(x, ids, weights, *args, 0.5)
    assert got.shape == want.shape and got.dtype == want.dtype and not torch.isnan(got).any()
    tol = 3e-2 if DTYPE == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("decoder", OP_DECODES, ids=lambda d: NAMES[d])
def test_a_token_gets_the_same_bits_alone_and_in_a_batch(decoder, monkeypatch) -> None:
    """`moe_experts_mxfp4_invariant`: token 0 alone and as row 9 of 17 tokens, bitwise equal."""
    x, ids, weights, args = experts_case(50 + decoder, 17, 8, 96, 160)
    order = torch.arange(17, device=DEVICE).roll(9)                     # token 0 lands on row 9
    op = through(moe.moe_experts_mxfp4_invariant, decoder, monkeypatch)
    alone = op(x[:1], ids[:1], weights[:1], *args)
    batch = op(x[order], ids[order], weights[order], *args)
    assert torch.equal(alone[0], batch[9])


@pytest.mark.skipif(not CUDA, reason="V4-Flash shapes: a GPU")
@pytest.mark.parametrize("num_tokens", [1, 8, 40])
def test_packed_experts_at_v4_flash_shapes_match_the_reference(num_tokens) -> None:
    """MX_PACKED at V4-Flash's hidden 4096 / intermediate 2048 (whole K steps, the shipped tile),
    16 experts, top-6, bf16: against the reference op and against the checkpoint-layout kernels."""
    x, ids, weights, (w13, s13, w2, s2) = experts_case(900 + num_tokens, num_tokens, 16, 4096, 2048)
    want = reference.moe_experts_mxfp4(x, ids, weights, w13, s13, w2, s2, 7.0)
    got = moe.moe_experts_mxfp4_invariant(x, ids, weights, repack_mxfp4_for_decode(w13), s13,
                                          repack_mxfp4_for_decode(w2), s2, 7.0, packed=True)
    stored = moe.moe_experts_mxfp4_invariant(x, ids, weights, w13, s13, w2, s2, 7.0)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * scale, rtol=0)
    torch.testing.assert_close(got.float(), stored.float(), atol=2e-2 * scale, rtol=0)
