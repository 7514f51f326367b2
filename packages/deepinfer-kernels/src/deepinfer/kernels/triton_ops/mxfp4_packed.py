"""The `packed` MXFP4 decoder's code words (`mxfp4.MX_PACKED`): codes re-packed at load time by
`deepinfer.kernels.mxfp4_layout.repack_mxfp4_for_decode`, so that word c of a 32-column group holds the
column pairs c, c + 4, c + 8, c + 12 (lane c's A-fragment columns, in natural order) with each pair's
two codes where four rotations and masks make them bfloat16 bits of code × 2^-126 (`mxfp4_layout`).

- On a GPU, `packed_words_asm`: per word nine integer instructions (`shf.l.wrap` rotations, `and` /
  `or`: lop3 after ptxas) and four `mul.rn.bf16x2` by m1 = 2^(min(s, 128) − 1), exact; where the
  group's scale byte s > 128 (a branch, not taken for weights under 12 in magnitude) four more by
  m2 = 2^(s − 128) (s = 255: inf), as `mxfp4._ASM` does.
- Under Triton's interpreter, `packed_pairs`: the same rotations and masks in Triton integer ops (the
  caller scales them with `mxfp4._multipliers`, as `MX_WORDS` does).

How Triton binds `tl.inline_asm_elementwise(..., pack=P)` (what `_PACKED_ASM` is written for): one asm
block takes P elements that are consecutive in a thread's registers — any P elements of the tensor,
in whatever order the layout gives (not the 4 words of a group, nor of one row) — and, if a thread
holds fewer than P, undefined values in the rest. Operands are numbered result-major: output r of
element e is $(r · P + e), then input operand i of element e is $(R · P + i · P + e) for R results.
So every output of `_PACKED_ASM` is a function of its own element's word and scale byte alone; the
four elements share only the branch (all four take × m2 when one has s > 128: × 1.0, exact, for the
others). Issue #29: the first version numbered the outputs element-major ($4e + r), so output r of
element e held pair e of element r's word; on the H100 (two words a thread in a 64 × 32 tile) that
permuted the column pairs and filled columns 16–31 from the two undefined elements.
"""

from __future__ import annotations

import triton
import triton.language as tl

_M = tl.constexpr(0x81C081C0)  # bf16 bits 6–8 and 15 of both halves: a code's magnitude and sign

_PACKED_ASM = tl.constexpr("""
{
.reg .b32 t, a, m;
.reg .pred big;
min.u32 t, $20, 128;
mad.lo.u32 m, t, 0x00800080, 0x3F003F00;
and.b32 t, $16, 0x81C081C0;
mul.rn.bf16x2 $0, t, m;
shf.l.wrap.b32 t, $16, $16, 4;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $4, t, m;
shf.l.wrap.b32 t, $16, $16, 10;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $8, t, m;
shf.l.wrap.b32 t, $16, $16, 6;
shf.l.wrap.b32 a, $16, $16, 14;
and.b32 t, t, 0x80C080C0;
and.b32 a, a, 0x01000100;
or.b32 t, t, a;
mul.rn.bf16x2 $12, t, m;
min.u32 t, $21, 128;
mad.lo.u32 m, t, 0x00800080, 0x3F003F00;
and.b32 t, $17, 0x81C081C0;
mul.rn.bf16x2 $1, t, m;
shf.l.wrap.b32 t, $17, $17, 4;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $5, t, m;
shf.l.wrap.b32 t, $17, $17, 10;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $9, t, m;
shf.l.wrap.b32 t, $17, $17, 6;
shf.l.wrap.b32 a, $17, $17, 14;
and.b32 t, t, 0x80C080C0;
and.b32 a, a, 0x01000100;
or.b32 t, t, a;
mul.rn.bf16x2 $13, t, m;
min.u32 t, $22, 128;
mad.lo.u32 m, t, 0x00800080, 0x3F003F00;
and.b32 t, $18, 0x81C081C0;
mul.rn.bf16x2 $2, t, m;
shf.l.wrap.b32 t, $18, $18, 4;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $6, t, m;
shf.l.wrap.b32 t, $18, $18, 10;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $10, t, m;
shf.l.wrap.b32 t, $18, $18, 6;
shf.l.wrap.b32 a, $18, $18, 14;
and.b32 t, t, 0x80C080C0;
and.b32 a, a, 0x01000100;
or.b32 t, t, a;
mul.rn.bf16x2 $14, t, m;
min.u32 t, $23, 128;
mad.lo.u32 m, t, 0x00800080, 0x3F003F00;
and.b32 t, $19, 0x81C081C0;
mul.rn.bf16x2 $3, t, m;
shf.l.wrap.b32 t, $19, $19, 4;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $7, t, m;
shf.l.wrap.b32 t, $19, $19, 10;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $11, t, m;
shf.l.wrap.b32 t, $19, $19, 6;
shf.l.wrap.b32 a, $19, $19, 14;
and.b32 t, t, 0x80C080C0;
and.b32 a, a, 0x01000100;
or.b32 t, t, a;
mul.rn.bf16x2 $15, t, m;
max.u32 t, $20, $21;
max.u32 t, t, $22;
max.u32 t, t, $23;
setp.gt.u32 big, t, 128;
@!big bra DONE${:uid};
max.u32 t, $20, 128;
mad.lo.u32 m, t, 0x00800080, 0xFF7FFF80;
setp.eq.u32 big, $20, 255;
selp.b32 m, 0x7F807F80, m, big;
mul.rn.bf16x2 $0, $0, m;
mul.rn.bf16x2 $4, $4, m;
mul.rn.bf16x2 $8, $8, m;
mul.rn.bf16x2 $12, $12, m;
max.u32 t, $21, 128;
mad.lo.u32 m, t, 0x00800080, 0xFF7FFF80;
setp.eq.u32 big, $21, 255;
selp.b32 m, 0x7F807F80, m, big;
mul.rn.bf16x2 $1, $1, m;
mul.rn.bf16x2 $5, $5, m;
mul.rn.bf16x2 $9, $9, m;
mul.rn.bf16x2 $13, $13, m;
max.u32 t, $22, 128;
mad.lo.u32 m, t, 0x00800080, 0xFF7FFF80;
setp.eq.u32 big, $22, 255;
selp.b32 m, 0x7F807F80, m, big;
mul.rn.bf16x2 $2, $2, m;
mul.rn.bf16x2 $6, $6, m;
mul.rn.bf16x2 $10, $10, m;
mul.rn.bf16x2 $14, $14, m;
max.u32 t, $23, 128;
mad.lo.u32 m, t, 0x00800080, 0xFF7FFF80;
setp.eq.u32 big, $23, 255;
selp.b32 m, 0x7F807F80, m, big;
mul.rn.bf16x2 $3, $3, m;
mul.rn.bf16x2 $7, $7, m;
mul.rn.bf16x2 $11, $11, m;
mul.rn.bf16x2 $15, $15, m;
DONE${:uid}:
}
""")


# outputs $0–$15 (pair r of element e: $(4r + e)), then words $16–$19 and their scale bytes $20–$23
_CONSTRAINTS = tl.constexpr(",".join(["=&r"] * 16 + ["r"] * 8))


@triton.jit
def packed_words_asm(words, scale):
    """Code words [rows, words] uint32 (`packed` layout) and each word's group scale byte (int32, same
    shape) → four uint32 tensors [rows, words]: pair j's two weights as bfloat16 bits, exact
    (code · 2^(s − 127)). Elementwise: any layout, any number of elements a thread (module docstring)."""
    return tl.inline_asm_elementwise(_PACKED_ASM, _CONSTRAINTS, [words, scale],
                                     dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=4)


@triton.jit
def _rotl(words, K: tl.constexpr):
    return (words << K) | (words >> (32 - K))


@triton.jit
def packed_pairs(words):
    """Code words [rows, words] uint32 (`packed` layout) → four uint32 tensors: pair j's two codes as the
    bfloat16 bits of code × 2^-126 (the interpreter's twin of `packed_words_asm` before its multiplies)."""
    r0 = words & _M
    r1 = _rotl(words, 4) & _M
    r2 = _rotl(words, 10) & _M
    r3 = (_rotl(words, 6) & 0x80C080C0) | (_rotl(words, 14) & 0x01000100)
    return r0, r1, r2, r3
