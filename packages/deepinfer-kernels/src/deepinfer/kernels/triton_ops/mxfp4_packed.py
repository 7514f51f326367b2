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

def _decode_word(e: int) -> str:
    """PTX of element e's word ($(16 + e)) and scale byte ($(20 + e)) → its four pairs $(4r + e), × m1."""
    pairs = [f"and.b32 t, ${16 + e}, 0x81C081C0;"]
    for rotation in (4, 10):
        pairs.append(f"shf.l.wrap.b32 t, ${16 + e}, ${16 + e}, {rotation};\nand.b32 t, t, 0x81C081C0;")
    pairs.append(f"shf.l.wrap.b32 t, ${16 + e}, ${16 + e}, 6;\nshf.l.wrap.b32 a, ${16 + e}, ${16 + e}, 14;\n"
                 "and.b32 t, t, 0x80C080C0;\nand.b32 a, a, 0x01000100;\nor.b32 t, t, a;")
    lines = [f"min.u32 t, ${20 + e}, 128;", "mad.lo.u32 m, t, 0x00800080, 0x3F003F00;"]
    for r, pair in enumerate(pairs):
        lines += [pair, f"mul.rn.bf16x2 ${4 * r + e}, t, m;"]
    return "\n".join(lines)


def _scale_big(e: int) -> str:
    """PTX: element e's four pairs × m2 = 2^(max(s, 128) − 128) (inf for s = 255)."""
    return "\n".join([f"max.u32 t, ${20 + e}, 128;", "mad.lo.u32 m, t, 0x00800080, 0xFF7FFF80;",
                      f"setp.eq.u32 big, ${20 + e}, 255;", "selp.b32 m, 0x7F807F80, m, big;"]
                     + [f"mul.rn.bf16x2 ${4 * r + e}, ${4 * r + e}, m;" for r in range(4)])


_PACKED_ASM = tl.constexpr("\n".join(
    ["", "{", ".reg .b32 t, a, m;", ".reg .pred big;"] + [_decode_word(e) for e in range(4)]
    + ["max.u32 t, $20, $21;", "max.u32 t, t, $22;", "max.u32 t, t, $23;", "setp.gt.u32 big, t, 128;",
       "@!big bra DONE${:uid};"] + [_scale_big(e) for e in range(4)] + ["DONE${:uid}:", "}", ""]))


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
