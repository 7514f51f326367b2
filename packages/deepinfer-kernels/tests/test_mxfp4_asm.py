"""The PTX of the MXFP4 decoders (`mxfp4._ASM` for MX_ASM, `mxfp4_packed._PACKED_ASM` for MX_PACKED) on
the CPU, without a GPU or Triton's interpreter (which cannot run PTX).

- Each asm text runs instruction by instruction (`PtxSubset`) with its operands bound as Triton's
  lowering of `tl.inline_asm_elementwise(..., pack=P)` binds them (`run_elementwise_asm`), each of a
  block's P elements a different word with its own scale byte: every element's outputs must be its
  own word's weights.
- The tiles as compiled for sm_90 (`compiled_tile_cases`): each thread's elements taken P at a time in
  the register order of the asm's operand layout in the TTGIR, undefined values (random here) where a
  thread holds fewer than P; the binding checked against the LLIR (which results it reads, which
  operands are undefined).

Issue #29: `_PACKED_ASM` numbered its outputs element-major, passed an emulation that assumed the same,
and decoded wrongly on the H100 (column pairs permuted, columns 16–31 from undefined registers).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

from deepinfer.kernels import reference, repack_mxfp4_for_decode

triton = pytest.importorskip("triton")
tl = triton.language
mxfp4 = pytest.importorskip("deepinfer.kernels.triton_ops.mxfp4")
from deepinfer.kernels.triton_ops import mxfp4_packed  # noqa: E402


class PtxSubset:
    """Runs the PTX of `mxfp4._ASM` / `mxfp4_packed._PACKED_ASM` on numpy lanes (uint32): the instructions they use,
    with PTX's semantics (prmt's default mode: selector nibble k picks byte k of the result from
    a's and b's 8 bytes, its top bit replicating that byte's sign; mul.rn.bf16x2 as exact products
    rounded to nearest even, subnormals kept); one forward branch per predicate."""

    def __init__(self, text: str) -> None:
        self.lines = [line.strip().rstrip(";") for line in text.splitlines()]

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        regs = {k: v.astype(np.uint32) for k, v in inputs.items()}
        lanes = next(iter(inputs.values())).shape
        active = np.ones(lanes, dtype=bool)
        skipping: dict[str, np.ndarray] = {}                    # label -> lanes that jumped there

        def val(tok: str) -> np.ndarray:
            tok = tok.strip()
            if tok in regs:
                return regs[tok]
            return np.full(lanes, int(tok, 0) & 0xFFFFFFFF, dtype=np.uint32)

        def put(dst: str, value: np.ndarray) -> None:
            old = regs.get(dst, np.zeros(lanes, dtype=np.uint32))
            regs[dst] = np.where(active, value.astype(np.uint32), old)

        for line in self.lines:
            if not line or line in "{}" or line.startswith(".reg"):
                continue
            if line.endswith(":"):                               # a label: lanes that branched rejoin
                active = active | skipping.pop(line[:-1].replace("${:uid}", ""), False)
                continue
            op, _, rest = line.partition(" ")
            args = [a.strip() for a in rest.split(",")]
            if op.startswith("@!"):                              # @!p bra LABEL
                instruction, target = rest.split()
                assert instruction == "bra", line
                target = target.replace("${:uid}", "")
                jumped = active & ~regs[op[2:]].astype(bool)
                skipping[target] = jumped
                active = active & ~jumped
                continue
            if op == "and.b32":
                put(args[0], val(args[1]) & val(args[2]))
            elif op == "shr.u32":
                put(args[0], val(args[1]) >> val(args[2]))
            elif op == "or.b32":
                put(args[0], val(args[1]) | val(args[2]))
            elif op == "shf.l.wrap.b32":                         # funnel shift of (b:a) left, high word
                k = val(args[3]) & 31
                put(args[0], ((val(args[2]).astype(np.uint64) << k) | (val(args[1]).astype(np.uint64) >> (32 - k)))
                    .astype(np.uint32))
            elif op == "mul.lo.u32":
                put(args[0], (val(args[1]).astype(np.uint64) * val(args[2])).astype(np.uint32))
            elif op == "mad.lo.u32":
                put(args[0], (val(args[1]).astype(np.uint64) * val(args[2]) + val(args[3])).astype(np.uint32))
            elif op == "min.u32":
                put(args[0], np.minimum(val(args[1]), val(args[2])))
            elif op == "max.u32":
                put(args[0], np.maximum(val(args[1]), val(args[2])))
            elif op == "prmt.b32":
                put(args[0], self._prmt(val(args[1]), val(args[2]), val(args[3])))
            elif op == "mul.rn.bf16x2":
                put(args[0], self._mul_bf16x2(val(args[1]), val(args[2])))
            elif op in ("setp.gt.u32", "setp.eq.u32"):
                cmp = np.greater if op == "setp.gt.u32" else np.equal
                put(args[0], cmp(val(args[1]), val(args[2])).astype(np.uint32))
            elif op == "selp.b32":
                put(args[0], np.where(regs[args[3]].astype(bool), val(args[1]), val(args[2])))
            else:
                raise AssertionError(f"instruction not modelled: {line}")
        assert not skipping, "a branch without its label"
        return regs

    @staticmethod
    def _prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
        pool = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
        out = np.zeros_like(a)
        for k in range(4):
            nibble = (sel >> (4 * k)) & 0xF
            byte = np.take_along_axis(pool, (nibble & 7)[None].astype(np.int64), 0)[0]
            byte = np.where(nibble & 8, np.where(byte & 0x80, 0xFF, 0), byte)
            out |= (byte.astype(np.uint32) << (8 * k)).astype(np.uint32)
        return out

    @staticmethod
    def _mul_bf16x2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        def halves(x: np.ndarray) -> torch.Tensor:
            pairs = torch.from_numpy(x.astype(np.int64)).to(torch.int32)
            return torch.stack((pairs & 0xFFFF, (pairs >> 16) & 0xFFFF), -1).to(torch.int16).view(torch.bfloat16)

        product = (halves(a).float() * halves(b).float()).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
        return (product[..., 0] | (product[..., 1] << 16)).numpy().astype(np.uint32)


def run_elementwise_asm(text: str, num_results: int, operands: list[np.ndarray]) -> np.ndarray:
    """`text` as Triton binds `tl.inline_asm_elementwise(..., pack=P)`: output r of element e is
    $(r · P + e), input operand i of element e is $(num_results · P + i · P + e). operands: [P, blocks]
    uint32 each (element e of every block in row e) → outputs [num_results, P, blocks] uint32."""
    pack = operands[0].shape[0]
    inputs = {f"${num_results * pack + i * pack + e}": op[e] for i, op in enumerate(operands) for e in range(pack)}
    regs = PtxSubset(text).run(inputs)
    return np.stack([np.stack([regs[f"${r * pack + e}"] for e in range(pack)]) for r in range(num_results)])


# per decoder: (asm text, pack, whether its codes are re-packed, the pair of its group that output r of
# word c (of 4 in the group) holds)
DECODERS = {
    "asm": (mxfp4._ASM.value, 2, False, lambda r, c: 4 * c + r),
    "packed": (mxfp4_packed._PACKED_ASM.value, 4, True, lambda r, c: c + 4 * r),
}


def case(codes: torch.Tensor, scale: torch.Tensor, decoder: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MXFP4 rows (codes [rows, K / 2] uint8 as stored, scale bytes [rows, K / 32]) as a decoder reads
    them → (code words [rows, K / 8] uint32, each word's scale byte [rows, K / 8] uint32, the bf16 bits
    each output r should hold [4, rows, K / 8] uint32: the pair's two weights, the even column low)."""
    _, _, repacked, pair = DECODERS[decoder]
    stored = repack_mxfp4_for_decode(codes) if repacked else codes
    words = stored.contiguous().view(torch.int32).numpy().astype(np.uint32)
    bits = reference.dequant_mxfp4(codes, scale).to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint32)
    bits = bits & 0xFFFF
    word = np.arange(words.shape[1])
    want = np.stack([[bits[:, 32 * (word // 4) + 2 * pair(r, word % 4) + h] for h in (0, 1)] for r in range(4)])
    want = want[:, 0] | (want[:, 1] << 16)                                       # [4, rows, words]
    return words, np.repeat(scale.numpy().astype(np.uint32), 4, axis=1), want


def assert_same_bf16x2(got: np.ndarray, want: np.ndarray, where: str) -> None:
    """Both bf16 halves bitwise equal, except that any NaN matches any NaN (0 · inf at s = 255)."""
    def halves(x: np.ndarray) -> np.ndarray:
        return np.stack([x & 0xFFFF, x >> 16]).astype(np.uint32)

    def nan(h: np.ndarray) -> np.ndarray:
        return ((h & 0x7F80) == 0x7F80) & ((h & 0x7F) != 0)

    g, w = halves(got), halves(want)
    bad = (g != w) & ~(nan(g) & nan(w))
    assert not bad.any(), (f"{where}: {int(bad.sum())} of {bad.size} weights differ, first "
                           f"{int(g[bad][0]):#06x} != {int(w[bad][0]):#06x}")


@pytest.mark.parametrize("decoder", DECODERS)
def test_asm_text_decodes_every_element_of_a_block_by_itself(decoder: str) -> None:
    """Each block's P elements are words of different rows, at different places in their groups, with
    different scale bytes: every code (each row holds the 16 twice, shuffled; all four of its words
    are read) under every scale byte 0–255 (the subnormal results, overflow, inf and NaN), beside
    block-mates of ordinary (127), large (200) or the same scale bytes, so that both sides of the
    s > 128 branch the elements share run. Every element's four outputs must be its own word's."""
    text, pack, _, _ = DECODERS[decoder]
    gen = torch.Generator().manual_seed(29)
    block, element = np.arange(3 * 256), np.arange(pack)[:, None]            # row of element e: e · 768 + b
    codes = torch.stack([torch.randperm(32, generator=gen) % 16 for _ in range(pack * block.size)])
    codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)                  # one group a row
    other = np.array([-1, 127, 200])[block // 256]                                     # -1: the same byte
    scale = np.where((element == block % pack) | (other < 0), block % 256, other)     # [P, blocks]
    words, scales, want = case(codes, torch.from_numpy(scale.reshape(-1, 1).astype(np.uint8)), decoder)
    row = element * block.size + block
    for shift in range(4):                                    # element e reads word (b + e + shift) % 4
        word = (block + element + shift) % 4
        out = run_elementwise_asm(text, 4, [words[row, word], scales[row, word]])
        assert_same_bf16x2(out, want[:, row, word], f"{decoder}, word shift {shift}")


COMPILER = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                              reason="needs Triton's compiler (the interpreter compiles nothing)")


@triton.jit
def _tile_kernel(w_ptr, s_ptr, out_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile of MXFP4 rows decoded as the expert kernels decode it (MX_ASM: 4,
    logical order; MX_PACKED: 5, natural order), stored as bf16 bits."""
    n = tl.arange(0, BLOCK_N)
    words, scale = mxfp4._code_words(w_ptr + n[:, None] * (BLOCK_K // 2), s_ptr + n[:, None] * (BLOCK_K // 32), 0,
                                     BLOCK_K, n < BLOCK_N, BLOCK_K)
    if DECODE == 4:
        w = mxfp4._asm_tile(words, scale, BLOCK_K)
    else:
        w = mxfp4._packed_tile(words, scale, BLOCK_K, True)
    tl.store(out_ptr + n[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :], w.to(tl.int16, bitcast=True))


def compile_sm90(fn, sig: dict[str, str], constants: dict, aligned: set[str], num_warps: int):
    """`fn` compiled for sm_90 (pointers and `aligned` integers specialised as divisible by 16)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or n in aligned}
    source = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(constants, "constexpr")}, constexprs=constants,
                       attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": 3})


def compiled_tile_cases():
    """(decoder, the compiled kernel, its num_warps): the tile of the GPU probe of issue #29 (64 × 32, 4
    warps: two words a thread, fewer than `packed`'s pack of 4), and the shipped small-batch up and
    down kernels at V4-Flash's strides as `test_hopper_compile_moe` compiles them (Triton's cache
    shares the compiles; their asm operands in the layouts the wgmma's A operand propagates back, in
    the up kernel rows r, r + 8 and words c, c + 4 in one block of 4)."""
    from deepinfer.kernels.triton_ops import moe

    def tile(decoder: str):
        return compile_sm90(_tile_kernel, dict(w_ptr="*u8", s_ptr="*u8", out_ptr="*i16"),
                            dict(BLOCK_N=64, BLOCK_K=32, DECODE=mxfp4.DECODES[decoder]), set(), 4)

    def shipped(kernel: str):
        ints = dict.fromkeys(("hidden", "inter", "w_expert", "w_row", "s_expert", "s_row"), "i32")
        if kernel == "up":
            sig = dict(x_ptr="*bf16", order_ptr="*i64", meta_ptr="*i32", w13_ptr="*u8", s13_ptr="*u8",
                       act_ptr="*bf16", num_slots="i32", hidden="i32", inter="i32", top_k="i32", limit="fp32",
                       w_expert="i32", w_row="i32", s_expert="i32", s_row="i32")
        else:
            sig = dict(act_ptr="*bf16", order_ptr="*i64", meta_ptr="*i32", weights_ptr="*fp32", w2_ptr="*u8",
                       s2_ptr="*u8", y_ptr="*fp32", num_slots="i32", **ints)
        block_n, block_k = moe.MXFP4_TILES[mxfp4.MX_PACKED]
        constants = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION="tf32", FORMAT=moe.MXFP4,
                         BLOCK_S=32, DECODE=mxfp4.MX_PACKED, BF16_MATH=True)
        fn = moe._expert_up_kernel if kernel == "up" else moe._expert_down_kernel
        return compile_sm90(fn, sig, constants, set(ints), 4)

    return [pytest.param("packed", lambda: tile("packed"), 4, id="packed-probe-tile-64x32"),
            pytest.param("asm", lambda: tile("asm"), 4, id="asm-probe-tile-64x32"),
            pytest.param("packed", lambda: shipped("up"), 4, id="packed-shipped-up-kernel"),
            pytest.param("packed", lambda: shipped("down"), 4, id="packed-shipped-down-kernel")]


def _mlir_unescape(text: str) -> str:
    return re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), text)


def layout_bases(ttgir: str, name: str, shape: list[int]) -> tuple[list, list, list]:
    """Layout `name` of the TTGIR over `shape` as linear-layout bases (register, lane, warp): a
    #ttg.linear as written; a #ttg.blocked as Triton converts it (each kind's bases dimension by
    dimension in `order`, then registers that repeat the CTA tile over a larger shape; bases past the
    shape, i.e. broadcast, zero)."""
    definition = re.search(rf"^{name} = (.*)$", ttgir, re.M).group(1)
    if definition.startswith("#ttg.linear"):
        kinds = [re.search(rf"\b{k} = (\[[^=]*?\]\])", definition) for k in ("register", "lane", "warp")]
        return tuple([] if k is None else json.loads(k.group(1)) for k in kinds)
    assert definition.startswith("#ttg.blocked"), f"layout {definition} not modelled"
    spt, tpw, wpc, order = (json.loads(re.search(rf"\b{k} = (\[[^\]]*\])", definition).group(1))
                            for k in ("sizePerThread", "threadsPerWarp", "warpsPerCTA", "order"))
    rank = len(shape)

    def bases(counts: list[int], strides: list[int]) -> list[list[int]]:
        out = []
        for d in order:
            for bit in range(counts[d].bit_length() - 1):
                out.append([strides[d] << bit if i == d else 0 for i in range(rank)])
        return out

    tile = [spt[d] * tpw[d] * wpc[d] for d in range(rank)]
    reg = bases(spt, [1] * rank) + bases([max(1, shape[d] // tile[d]) for d in range(rank)], tile)
    lane = bases(tpw, spt)
    warp = bases(wpc, [spt[d] * tpw[d] for d in range(rank)])
    return tuple([[v if v < shape[i] else 0 for i, v in enumerate(b)] for b in kind] for kind in (reg, lane, warp))


def asm_operands(ttgir: str, text: str) -> tuple[int, list[int], str]:
    """(pack, shape, layout name) of the operands of the TTGIR's inline asm ops whose text is `text`
    (one shape and layout for every such op and operand)."""
    found = set()
    for m in re.finditer(r'tt\.elementwise_inline_asm "((?:[^"\\]|\\.)*)" \{[^}]*packed_element = (\d+)[^}]*\} '
                         r'[^:]*: ([^\n]*?) ->', ttgir):
        if _mlir_unescape(m.group(1)) == text:
            types = set(re.findall(r"tensor<([0-9x]+)xi32, (#\w+)>", m.group(3)))
            assert len(types) == 1, f"asm operands in several layouts: {types}"
            (dims, layout), = types
            found.add((int(m.group(2)), tuple(int(d) for d in dims.split("x")), layout))
    assert len(found) == 1, f"the decoder's asm ops: {found}"
    pack, shape, layout = found.pop()
    return pack, list(shape), layout


def assert_llir_binds_result_major(llir: str, text: str, pack: int, per_thread: int) -> None:
    """Each of the LLIR's calls of `text`: its undefined operands are a block's last elements (a thread
    holding fewer than `pack`), and the results read are those of its defined elements e numbered
    result-major, r · pack + e (`run_elementwise_asm`'s binding, the compiler's)."""
    calls = 0
    for m in re.finditer(r'(%\w+) = (?:tail )?call [^\n]*? asm "((?:[^"\\]|\\.)*)", "[^"]*"\(([^)]*)\)', llir):
        if _mlir_unescape(m.group(2)) != text:
            continue
        calls += 1
        args = [a.strip().split(" ", 1)[1] for a in m.group(3).split(",")][:2 * pack]
        undefined = [a in ("undef", "poison") for a in args]
        defined = pack - sum(undefined[:pack])
        assert undefined == [e >= defined for e in range(pack)] * 2, f"undefined operands {undefined}"
        assert defined in (pack, per_thread % pack), f"{defined} elements in a block, {per_thread} a thread"
        read = {int(k) for k in re.findall(rf"extractvalue [^\n]*? {m.group(1)}, (\d+)", llir)}
        assert read == {r * pack + e for r in range(4) for e in range(defined)}, f"results read: {sorted(read)}"
    assert calls, "the decoder's asm is not in the LLIR"


@COMPILER
@pytest.mark.parametrize(("decoder", "build", "num_warps"), compiled_tile_cases())
def test_compiled_tiles_decode_every_word_by_itself(decoder: str, build, num_warps: int) -> None:
    """The decoder's asm over the tile as compiled for sm_90: every thread's elements, `pack` at a time
    in the register order of the asm operands' layout (TTGIR), random words and scale bytes where a
    thread holds fewer than `pack`; every word of the tile decoded exactly, wherever it sits in its
    block and whatever its block-mates hold. The binding is checked against the LLIR."""
    text, _, _, _ = DECODERS[decoder]
    compiled = build()
    pack, shape, layout = asm_operands(compiled.asm["ttgir"], text)
    reg, lane, warp = layout_bases(compiled.asm["ttgir"], layout, shape)
    assert 2 ** len(warp) == num_warps and len(lane) == 5
    assert_llir_binds_result_major(compiled.asm["llir"], text, pack, 2 ** len(reg))

    def coords(bases: list[list[int]], count: int) -> np.ndarray:          # [count, rank]: XOR of the bases
        out = np.zeros((count, len(shape)), dtype=np.int64)
        for bit, b in enumerate(bases):
            out ^= np.where((np.arange(count)[:, None] >> bit) & 1, np.array(b), 0)
        return out

    where = (coords(warp, num_warps)[:, None, None] ^ coords(lane, 32)[None, :, None]
             ^ coords(reg, 2 ** len(reg))[None, None, :]).reshape(32 * num_warps, -1, len(shape))  # [threads, E, 2]
    assert len({tuple(c) for c in where.reshape(-1, len(shape))}) == shape[0] * shape[1], "layout misses elements"
    gen = torch.Generator().manual_seed(290)
    rows, k = shape[0], 8 * shape[1]
    codes = torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(0, 256, (rows, k // 32), generator=gen, dtype=torch.uint8)
    scale[: rows // 2] = torch.randint(0, 129, (rows // 2, k // 32), generator=gen, dtype=torch.uint8)
    words, scales, want = case(codes, scale, decoder)
    threads, per_thread = where.shape[:2]
    blocks = -(-per_thread // pack)
    slots = np.arange(blocks * pack).reshape(blocks, pack)                 # a thread's register index per slot
    real = slots < per_thread
    idx = np.minimum(slots, per_thread - 1)
    garbage = np.random.default_rng(29).integers(0, 2**32, (2, threads, blocks, pack), dtype=np.uint64)
    row, col = where[:, idx, 0], where[:, idx, 1]                          # [threads, blocks, pack]
    w_in = np.where(real, words[row, col], garbage[0].astype(np.uint32))
    s_in = np.where(real, scales[row, col], (garbage[1] % 256).astype(np.uint32))
    out = run_elementwise_asm(text, 4, [w_in.reshape(-1, pack).T, s_in.reshape(-1, pack).T])
    got = out.reshape(4, pack, threads, blocks).transpose(0, 2, 3, 1)       # [4, threads, blocks, pack]
    assert_same_bf16x2(got[:, :, real], want[:, row, col][:, :, real], f"{decoder} as compiled")
