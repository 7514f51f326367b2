"""MXFP4 weights in the small-batch expert kernels (`moe._expert_up_kernel` / `_expert_down_kernel`).

Storage: per weight row, bytes of two e2m1 codes (low nibble first; bit 3 the sign, magnitudes 0, .5,
1, 1.5, 2, 3, 4, 6) and one e8m0 scale byte s per 32 columns, meaning 2^(s − 127). The reference
(`reference.dequant_mxfp4`) multiplies in float32 and rounds to the activations' dtype. Every product
e · 2^(s − 127) has at most two significant bits and at least 2^-128 in magnitude, and bfloat16 has
float32's exponent range with subnormals down to 2^-133: so it is exact in bfloat16, overflow gives
±inf in both, s = 255 (2^128, inf in float32) gives ±inf, and ±0 · inf NaN. The decoders build those
bfloat16 values exactly at every scale byte 0–255 (tests/test_mxfp4_decode.py).

Decoders (`DECODE`, a constexpr of the kernels; `moe.MXFP4_DECODE` picks one):
- `MX_DOT_SCALED` (0): Triton's microscaling `tl.dot_scaled` on the packed codes (on Hopper an
  upcast Triton emits, a table lookup per code), activations × weightsᵀ.
- The others multiply weights × activationsᵀ, so that the weight tile is the A operand of the MMA
  (a wgmma from registers on Hopper: 64+ weight rows by 16 token rows), on "code words": each 32-bit
  word holds 8 codes (4 bytes) of one row and one scale group, and inside each 32 columns the
  columns are reordered (`load_columns`) so that the four column pairs an A fragment gives a lane
  (2c, 2c + 8, 16 + 2c, 24 + 2c) are the four bytes of word c, one `ldmatrix` register each.
  - `MX_BITS` (1): per code, integer ops build the bfloat16 bits with the scale folded into the
    exponent field (`_bits_word`).
  - `MX_GROUP_DOT` (2): codes decoded without their scale (as `MX_WORDS`, then × 2^126), one dot
    per 32 columns, the group's scale applied to the float32 partial product.
  - `MX_WORDS` (3): per byte, integer ops build both codes' bfloat16 bits as e · 2^-126 in one
    32-bit word (`_raw_pair`: bfloat16's subnormal 2^-127 is code ±0.5), then two bfloat16
    multiplies apply the scale (`_multipliers`).
  - `MX_ASM` (4): `MX_WORDS` in PTX: `prmt` places the two nibbles of a byte, one multiply and
    mask make the word, one `mul.rn.bf16x2` scales it; the second multiply only for groups with
    s > 128 (a branch, not taken for weights under 12 in magnitude). A GPU only.
- `MX_PACKED` (5): weights × activationsᵀ on codes re-packed at load time
  (`deepinfer.kernels.mxfp4_layout`): word c of a group already holds lane c's column pairs c, c + 4,
  c + 8, c + 12, so the decoded tile is in natural column order and the activations load contiguously
  (no `load_columns` gathers); per word four rotations and masks give the bf16 bits of each pair, then
  `MX_ASM`'s exact multiplies (`mxfp4_packed`). Needs weights in that layout; scales as stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mxfp4_packed import packed_pairs, packed_words_asm

MX_DOT_SCALED, MX_BITS, MX_GROUP_DOT, MX_WORDS, MX_ASM, MX_PACKED = 0, 1, 2, 3, 4, 5
DECODES = {"dot_scaled": MX_DOT_SCALED, "bits": MX_BITS, "group_dot": MX_GROUP_DOT, "words": MX_WORDS,
           "asm": MX_ASM, "packed": MX_PACKED}


def runnable_decode(decode: int, x: torch.Tensor) -> int:
    """The decoder the kernels run for `decode` and activations x: `MX_DOT_SCALED` needs bfloat16
    activations on a GPU and `MX_ASM` a GPU (not Triton's interpreter); else `MX_WORDS`. `MX_PACKED`
    runs everywhere (its weights' layout is its own: it never falls back)."""
    if (decode == MX_DOT_SCALED and not (x.is_cuda and x.dtype == torch.bfloat16)) or (
            decode == MX_ASM and not x.is_cuda):
        return MX_WORDS
    return decode


@triton.jit
def load_columns(rows, k0, k_in, rm, BLOCK_K: tl.constexpr, WORDS: tl.constexpr):
    """Columns k0 … k0 + BLOCK_K of the rows at `rows` ([BLOCK_M, 1] pointers, `rm` their [BLOCK_M, 1]
    mask), 0 past k_in: WORDS = 0: [BLOCK_M, BLOCK_K] in natural order; 1 (the code-word decoders on
    checkpoint-layout codes) transposed, [BLOCK_K, BLOCK_M], reordered inside each 32 columns: logical
    column pair 4j + c (16 pairs) is natural pair 4c + j, the j-th byte of code word c; 2 (`MX_PACKED`)
    transposed in natural order."""
    if WORDS == 1:
        p = tl.arange(0, BLOCK_K // 2)
        pair = k0 // 2 + ((p & ~15) | ((p & 3) << 2) | ((p >> 2) & 3))
        k = 2 * pair[:, None, None] + tl.arange(0, 2)[None, :, None]               # [pairs, 2, 1]
        out = tl.load(tl.trans(rows)[None, :, :] + k, mask=tl.trans(rm)[None, :, :] & (k < k_in), other=0.0)
        out = tl.reshape(out, (BLOCK_K, out.shape[2]))
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        out = tl.load(rows + k[None, :], mask=rm & (k < k_in)[None, :], other=0.0)
        if WORDS == 2:
            out = tl.trans(out)
    return out


@triton.jit
def mxfp4_tile(w_rows, s_rows, k0, k_in, nm, BLOCK_K: tl.constexpr):
    """Columns k0 … k0 + BLOCK_K of the MXFP4 weight rows at `w_rows` ([BLOCK_N, 1] pointers):
    (packed codes [BLOCK_N, BLOCK_K / 2] uint8, two per byte, low nibble first; their e8m0 group
    scales [BLOCK_N, BLOCK_K / 32] uint8, read from `s_rows`, one per 32 columns)."""
    kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_rows + kp[None, :], mask=nm[:, None] & (kp < k_in // 2)[None, :], other=0)
    g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scale = tl.load(s_rows + g[None, :], mask=nm[:, None] & (g < k_in // 32)[None, :], other=127)
    return packed, scale


@triton.jit
def _spread(per_group, WIDTH: tl.constexpr):
    """[rows, groups] → [rows, groups · WIDTH]: each group's value repeated over its WIDTH columns."""
    rows: tl.constexpr = per_group.shape[0]
    groups: tl.constexpr = per_group.shape[1]
    return tl.reshape(tl.broadcast_to(per_group[:, :, None], (rows, groups, WIDTH)), (rows, groups * WIDTH))


@triton.jit
def group_scales(s_rows, k0, k_in, nm, BLOCK_K: tl.constexpr):
    """The e8m0 scale bytes of columns k0 … k0 + BLOCK_K of the rows at `s_rows` ([BLOCK_N, 1] pointers,
    `nm` their [BLOCK_N] mask): [BLOCK_N, BLOCK_K / 32] int32, 0 where masked (codes there are 0)."""
    g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    return tl.load(s_rows + g[None, :], mask=nm[:, None] & (g < k_in // 32)[None, :], other=0).to(tl.int32)


@triton.jit
def _words(w_rows, k0, k_in, nm, BLOCK_K: tl.constexpr):
    """Code words [BLOCK_N, BLOCK_K / 8] uint32 (8 codes each) of columns k0 … k0 + BLOCK_K, 0 where
    masked. Rows are a multiple of 16 bytes apart: words are aligned."""
    v = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    return tl.load(w_rows.to(tl.pointer_type(tl.uint32), bitcast=True) + v[None, :],
                   mask=nm[:, None] & (v < k_in // 8)[None, :], other=0)


@triton.jit
def _code_words(w_rows, s_rows, k0, k_in, nm, BLOCK_K: tl.constexpr):
    """(code words [BLOCK_N, BLOCK_K / 8] uint32, natural order; their groups' scale bytes [BLOCK_N,
    BLOCK_K / 32] int32)."""
    return _words(w_rows, k0, k_in, nm, BLOCK_K), group_scales(s_rows, k0, k_in, nm, BLOCK_K)


@triton.jit
def _logical(o0, o1, o2, o3, BLOCK_K: tl.constexpr):
    """bf16 weights [rows, BLOCK_K] in the logical column order of `load_columns`, from the pair
    words o_j [rows, BLOCK_K / 8] (o_j of word c: byte j's two codes, the low nibble's in bits 0–15)."""
    rows: tl.constexpr = o0.shape[0]
    groups: tl.constexpr = BLOCK_K // 32
    j = tl.join(tl.join(tl.reshape(o0, (rows, groups, 4)), tl.reshape(o1, (rows, groups, 4))),
                tl.join(tl.reshape(o2, (rows, groups, 4)), tl.reshape(o3, (rows, groups, 4))))
    # j[.., c, a, b] = o_(a + 2b): logical pair 4(a + 2b) + c is [.., b, a, c]
    pairs = tl.reshape(tl.permute(j, (0, 1, 4, 3, 2)), (rows, BLOCK_K // 2))
    return tl.interleave(pairs.to(tl.uint16), (pairs >> 16).to(tl.uint16)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _raw_pair(words, J: tl.constexpr):
    """Byte J of each code word → a uint32 holding the bf16 bits of its codes times 2^-126, low
    nibble in bits 0–15: the nibbles to bits 0 and 16 (× 0x1001), then × (2^6 + 2^12) puts each code's
    magnitude bits on the exponent's two low bits and the mantissa's top bit (6–8) and its sign on
    bit 15; code 1 lands on bf16's subnormal 2^-127 = 0.5 · 2^-126."""
    nibbles = (((words >> (8 * J)) & 0xFF) * 0x1001) & 0x000F000F
    return (nibbles * 0x1040) & 0x81C081C0


@triton.jit
def _multipliers(scale):
    """bf16 bit patterns (int32) of m1 = 2^(min(s, 128) − 1) and m2 = 2^(max(s, 128) − 128), inf for
    s = 255: e · 2^-126 · m1 · m2 = e · 2^(s − 127), each product exact (e · 2^-126 · m1 ≤ 12)."""
    m1 = (tl.minimum(scale, 128) + 126) << 7
    m2 = tl.where(scale == 255, 0x7F80, (tl.maximum(scale, 128) - 1) << 7)
    return m1, m2


@triton.jit
def _as_bf16(bits):
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _mul(x, y, BF16_MATH: tl.constexpr):
    """x · y for bf16 x, y whose product is exact in bf16 (or overflows to ±inf, or is NaN): bf16
    arithmetic on a GPU; under the interpreter (which multiplies bf16 bit patterns as integers and
    flushes bf16 subnormals in its conversions) in float32 reached by bit shifts, the product's bits
    truncated back (exact, as the product is a bf16 value)."""
    if BF16_MATH:
        out = x * y
    else:
        wide = _widen(x) * _widen(y)
        out = (wide.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return out


@triton.jit
def _widen(x):
    """bf16 → float32 by appending 16 zero bits (exact, subnormals too)."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _unscaled(words, BLOCK_K: tl.constexpr, BF16_MATH: tl.constexpr):
    """Code words → their e2m1 values as bf16 [rows, BLOCK_K] (logical order), unscaled."""
    w = _logical(_raw_pair(words, 0), _raw_pair(words, 1), _raw_pair(words, 2), _raw_pair(words, 3), BLOCK_K)
    return _mul(w, _as_bf16(tl.full(w.shape, 0x7E80, tl.int32)), BF16_MATH)              # × 2^126


@triton.jit
def _group_factor(scale):
    """2^(s − 127) in float32 (s = 0: the subnormal 2^-127; s = 255: inf)."""
    return tl.where(scale == 0, 2.0**-127, (scale << 23).to(tl.float32, bitcast=True))


@triton.jit
def _words_tile(words, scale, BLOCK_K: tl.constexpr, BF16_MATH: tl.constexpr):
    """MX_WORDS: bf16 weights [rows, BLOCK_K] (logical order); `scale` per group [rows, groups]."""
    m1, m2 = _multipliers(scale)
    w = _logical(_raw_pair(words, 0), _raw_pair(words, 1), _raw_pair(words, 2), _raw_pair(words, 3), BLOCK_K)
    w = _mul(w, _spread(_as_bf16(m1), 32), BF16_MATH)
    return _mul(w, _spread(_as_bf16(m2), 32), BF16_MATH)


@triton.jit
def _bits_word(words, J: tl.constexpr, base, low, mult, add):
    """MX_BITS: byte J of each code word → the bf16 bits of its two codes times their scale (low
    nibble in bits 0–15). Per code c (c7 = its magnitude code): c7 ≥ `low`: (c7 << 6) + base with
    base = (s − 1) << 7, i.e. exponent (c7 >> 1) + s − 1 and mantissa bit c7 & 1, capped at inf
    (0x7F80); below: c7 · mult + add (per-group values, `_bits_tile`); the sign to bit 15."""
    out = tl.zeros_like(words)
    for half in tl.static_range(2):
        code = (words >> (8 * J + 4 * half)) & 0xF
        c7 = code & 7
        big = tl.minimum((c7 << 6) + base, 0x7F80)
        mag = tl.where(c7 >= low, big, c7 * mult + add)
        out = out | ((((code & 8) << 12) | mag).to(tl.uint32) << (16 * half))
    return out


@triton.jit
def _bits_tile(words, scale, BLOCK_K: tl.constexpr):
    """MX_BITS: bf16 weights [rows, BLOCK_K] (logical order). Codes below `low` take the linear form
    c7 · mult + add: code 0 → 0 and code 1 → (s − 1) << 7 (0.5 · 2^(s − 127)) for 2 ≤ s ≤ 254; s = 0
    makes codes 1–3 subnormal (c7 << 5, code 4 on is normal: low = 4); s = 1 makes code 1 the
    subnormal 0x40; s = 255 makes code 0 NaN (0x7FC0) and code 1 inf. For s ≥ 253 the cap gives inf
    where the exponent passes 254."""
    base = (scale - 1) << 7
    low = _spread(tl.where(scale == 0, 4, 2), 4)
    mult = _spread(tl.where(scale == 0, 32, tl.where(scale == 1, 64, tl.where(scale == 255, -64, base))), 4)
    add = _spread(tl.where(scale == 255, 0x7FC0, 0), 4)
    base = _spread(base, 4)
    return _logical(_bits_word(words, 0, base, low, mult, add), _bits_word(words, 1, base, low, mult, add),
                    _bits_word(words, 2, base, low, mult, add), _bits_word(words, 3, base, low, mult, add),
                    BLOCK_K)


_ASM = tl.constexpr("""
{
.reg .b32 lo, hi, t, m;
.reg .pred big;
min.u32 t, $10, 128;
mad.lo.u32 m, t, 0x00800080, 0x3F003F00;
and.b32 lo, $8, 0x0F0F0F0F;
shr.u32 hi, $8, 4;
and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 t, lo, hi, 0x8480;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $0, t, m;
prmt.b32 t, lo, hi, 0x8581;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $2, t, m;
prmt.b32 t, lo, hi, 0x8682;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $4, t, m;
prmt.b32 t, lo, hi, 0x8783;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $6, t, m;
min.u32 t, $11, 128;
mad.lo.u32 m, t, 0x00800080, 0x3F003F00;
and.b32 lo, $9, 0x0F0F0F0F;
shr.u32 hi, $9, 4;
and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 t, lo, hi, 0x8480;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $1, t, m;
prmt.b32 t, lo, hi, 0x8581;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $3, t, m;
prmt.b32 t, lo, hi, 0x8682;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $5, t, m;
prmt.b32 t, lo, hi, 0x8783;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $7, t, m;
max.u32 t, $10, $11;
setp.gt.u32 big, t, 128;
@!big bra DONE${:uid};
max.u32 t, $10, 128;
mad.lo.u32 m, t, 0x00800080, 0xFF7FFF80;
setp.eq.u32 big, $10, 255;
selp.b32 m, 0x7F807F80, m, big;
mul.rn.bf16x2 $0, $0, m;
mul.rn.bf16x2 $2, $2, m;
mul.rn.bf16x2 $4, $4, m;
mul.rn.bf16x2 $6, $6, m;
max.u32 t, $11, 128;
mad.lo.u32 m, t, 0x00800080, 0xFF7FFF80;
setp.eq.u32 big, $11, 255;
selp.b32 m, 0x7F807F80, m, big;
mul.rn.bf16x2 $1, $1, m;
mul.rn.bf16x2 $3, $3, m;
mul.rn.bf16x2 $5, $5, m;
mul.rn.bf16x2 $7, $7, m;
DONE${:uid}:
}
""")


@triton.jit
def _asm_tile(words, scale, BLOCK_K: tl.constexpr):
    """MX_ASM: bf16 weights [rows, BLOCK_K] (logical order), two code words per asm block (operands:
    outputs o0–o3 × 2 words, then the 2 words, then their 2 scale bytes). Per word: lo / hi = its
    low / high nibbles, one per byte; per byte j, `prmt` with selector 0x8(4+j)8j puts lo's byte j
    in byte 0 and hi's in byte 2 (bytes 1 and 3 zero: sign-replicated copies of lo's byte 0, whose
    top bit is clear), i.e. the two codes at bits 0 and 16; then as `_raw_pair`, and × m1 of
    `_multipliers` in one `mul.rn.bf16x2`. m2 = 1 unless s > 128: where either word's group has
    one, both take × m2 (the branch is not taken for weights under 12 in magnitude)."""
    o0, o1, o2, o3 = tl.inline_asm_elementwise(_ASM, "=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,r,r,r,r",
                                               [words, _spread(scale, 4)],
                                               dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True,
                                               pack=2)
    return _logical(o0, o1, o2, o3, BLOCK_K)


@triton.jit
def _packed_tile(words, scale, BLOCK_K: tl.constexpr, BF16_MATH: tl.constexpr):
    """MX_PACKED: bf16 weights [rows, BLOCK_K] in natural order from re-packed code words; `scale` per
    group [rows, groups]. PTX on a GPU; the same bits from Triton integer ops under the interpreter."""
    if BF16_MATH:
        o0, o1, o2, o3 = packed_words_asm(words, _spread(scale, 4))
        w = _logical(o0, o1, o2, o3, BLOCK_K)
    else:
        r0, r1, r2, r3 = packed_pairs(words)
        m1, m2 = _multipliers(scale)
        w = _mul(_logical(r0, r1, r2, r3, BLOCK_K), _spread(_as_bf16(m1), 32), BF16_MATH)
        w = _mul(w, _spread(_as_bf16(m2), 32), BF16_MATH)
    return w


@triton.jit
def packed_weights(w_rows, s_rows, k0, k_in, nm, BLOCK_K: tl.constexpr):
    """Columns k0 … k0 + BLOCK_K of re-packed MXFP4 rows at `w_rows` ([rows, 1] pointers, `nm` their
    mask; scales at `s_rows`) as exact bf16 weights [rows, BLOCK_K] in natural order, by integer ops
    and float32 products (the interpreter's twin of MX_PACKED): the grouped kernels' decode."""
    words = _words(w_rows, k0, k_in, nm, BLOCK_K)
    return _packed_tile(words, group_scales(s_rows, k0, k_in, nm, BLOCK_K), BLOCK_K, False)


@triton.jit
def mxfp4_dot(a, acc, w_rows, s_rows, k0, k_in, nm, scale, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
              DECODE: tl.constexpr, BF16_MATH: tl.constexpr):
    """acc + a @ (MXFP4 weight columns k0 … k0 + BLOCK_K of the rows at `w_rows`)ᵀ for
    MX_DOT_SCALED (a [BLOCK_M, BLOCK_K], acc [BLOCK_M, BLOCK_N]); for the code-word decoders acc +
    weights @ a with a from `load_columns` ([BLOCK_K, BLOCK_M], logical order; MX_PACKED: natural)
    and acc [BLOCK_N, BLOCK_M]. MX_GROUP_DOT takes BLOCK_K = 32 (one scale group). MX_PACKED takes the
    step's scale bytes from the caller (`scale`, from `group_scales`: loaded a K step early); the
    others read them here (`scale` unused)."""
    if DECODE == 0:
        packed, scale = mxfp4_tile(w_rows, s_rows, k0, k_in, nm, BLOCK_K)
        out = tl.dot_scaled(a, None, "bf16", tl.trans(packed), scale, "e2m1", acc=acc)
    elif DECODE == 5:
        w = _packed_tile(_words(w_rows, k0, k_in, nm, BLOCK_K), scale, BLOCK_K, BF16_MATH)
        out = tl.dot(w.to(a.dtype), a, acc, input_precision=PRECISION)
    else:
        words, scale = _code_words(w_rows, s_rows, k0, k_in, nm, BLOCK_K)
        if DECODE == 2:
            part = tl.dot(_unscaled(words, BLOCK_K, BF16_MATH).to(a.dtype), a, input_precision=PRECISION)
            out = acc + part * _group_factor(scale)                     # scale [BLOCK_N, 1]: one group
        else:
            if DECODE == 1:
                w = _bits_tile(words, scale, BLOCK_K)
            elif DECODE == 3:
                w = _words_tile(words, scale, BLOCK_K, BF16_MATH)
            else:
                w = _asm_tile(words, scale, BLOCK_K)
            out = tl.dot(w.to(a.dtype), a, acc, input_precision=PRECISION)
    return out
