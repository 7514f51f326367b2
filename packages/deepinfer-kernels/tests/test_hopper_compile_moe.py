"""The expert kernels compiled for Hopper (sm_90) on a machine without a GPU: the grouped GEMMs of
prefill at the V4-Flash shapes with every shipped tile, and the small-batch kernels on MXFP4 weights
with every decoder of `triton_ops.mxfp4`. The SASS must use the warpgroup matrix instructions (HGMMA
for bf16 and decoded MXFP4, QGMMA for FP8 e4m3 × e4m3), software-pipelined copies (LDGSTS: the
`num_stages` took effect) and no local memory (no spills)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import triton

BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
    reason="needs Triton's compiler (not the interpreter) and the ptxas / cuobjdump of its wheel",
)

# What the launch specialises at V4-Flash's shapes: pointers and these integers divisible by 16.
ALIGNED = {"hidden", "inter", "x_row", "w_expert", "w_row", "s_expert"}
INTS = ("max_tiles", "num_n", "hidden", "inter", "top_k", "x_row", "w_expert", "w_row", "s_expert", "s_row")


def signature(kernel: str, weight: str, scale: str, fp8: bool) -> dict[str, str]:
    act = "*fp8e4nv" if fp8 else "*bf16"
    side = "*fp32" if fp8 else "*bf16"
    if kernel == "up":
        pointers = {"x_ptr": act, "xs_ptr": side, "order_ptr": "*i64", "tiles_ptr": "*i32", "w13_ptr": weight,
                    "s13_ptr": scale, "act_ptr": act, "acts_ptr": side}
        ints = dict.fromkeys(INTS, "i32")
        return {**pointers, **{k: v for k, v in ints.items() if k in INTS[:5]}, "limit": "fp32",
                **{k: v for k, v in ints.items() if k not in INTS[:5]}}
    pointers = {"act_ptr": act, "acts_ptr": side, "order_ptr": "*i64", "tiles_ptr": "*i32", "weights_ptr": "*fp32",
                "w2_ptr": weight, "s2_ptr": scale, "y_ptr": "*bf16"}
    return {**pointers, **dict.fromkeys(("max_tiles", "num_n", "hidden", "inter", "w_expert", "w_row", "s_expert",
                                         "s_row"), "i32")}


def cases():
    from deepinfer.kernels.triton_ops import moe
    from deepinfer.kernels.triton_ops.moe_grouped import GemmTiles, expert_tiles

    formats = (("bf16", moe.PLAIN, "*bf16", "*bf16"), ("fp8", moe.FP8_BLOCK, "*fp8e4nv", "*fp32"),
               ("mxfp4", moe.MXFP4, "*u8", "*u8"), ("mxfp4-packed", moe.MXFP4_PACKED, "*u8", "*u8"))
    for name, fmt, weight, scale in formats:
        tiles = expert_tiles(fmt, 4096, 2048, 128)
        plain = GemmTiles(64, 128, 128 if fmt == moe.FP8_BLOCK else 64, 4, 3)       # one warpgroup, no halves
        for kernel, t in (("up", tiles.up), ("down", tiles.down), ("down", plain)):
            yield pytest.param(kernel, fmt, signature(kernel, weight, scale, fmt == moe.FP8_BLOCK), t,
                               "QGMMA" if fmt == moe.FP8_BLOCK else "HGMMA",
                               id=f"{name}-{kernel}-{t.block_m}x{t.block_n}x{t.block_k}-w{t.num_warps}-h{int(t.half)}")


def compile_sm90(fn, sig: dict[str, str], constants: dict, aligned: set[str], num_warps: int, num_stages: int,
                 tmp_path) -> tuple:
    """(compiled kernel, its SASS, its resource usage) of `fn` for sm_90: pointers and the `aligned`
    integer arguments specialised as divisible by 16, `constants` as constexprs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or n in aligned}
    source = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(constants, "constexpr")}, constexprs=constants,
                       attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    return compiled, sass, usage


@pytest.mark.parametrize(("kernel", "fmt", "sig", "tiles", "mma"), list(cases()))
def test_grouped_expert_kernels_compile_to_warpgroup_mma(kernel, fmt, sig, tiles, mma, tmp_path) -> None:
    from deepinfer.kernels.triton_ops import moe, moe_grouped_kernels

    fn = moe_grouped_kernels._up_kernel if kernel == "up" else moe_grouped_kernels._down_kernel
    constants = dict(FORMAT=fmt, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                     GROUP=128 if fmt == moe.FP8_BLOCK else 1, PRECISION="tf32", F8_DOT=fmt == moe.FP8_BLOCK,
                     HALF=tiles.half)
    compiled, sass, usage = compile_sm90(fn, sig, constants, ALIGNED, tiles.num_warps, tiles.num_stages, tmp_path)
    assert re.search(rf"\b{mma}\.", sass), f"no {mma} in the SASS"
    assert "LDGSTS" in sass, "loads not software-pipelined"
    assert "LDL" not in sass and "STL" not in sass and re.search(r"STACK:0\b", usage), "local memory (spills)"
    assert compiled.metadata.shared <= 227 * 1024


def small_batch_cases():
    """The small-batch expert kernels (`moe._expert_up_kernel` / `_expert_down_kernel`) on MXFP4
    weights, every decoder of `mxfp4.DECODES` at its shipped tile (`moe.MXFP4_TILES`)."""
    from deepinfer.kernels.triton_ops import moe, mxfp4

    for name, decode in mxfp4.DECODES.items():
        block_n, block_k = moe.MXFP4_TILES[decode]
        for kernel in ("up", "down"):
            yield pytest.param(kernel, decode, block_n, block_k, id=f"{name}-{kernel}-{block_n}x{block_k}")


SMALL_BATCH_SIGNATURES = {
    "up": dict(x_ptr="*bf16", order_ptr="*i64", meta_ptr="*i32", w13_ptr="*u8", s13_ptr="*u8", act_ptr="*bf16",
               num_slots="i32", hidden="i32", inter="i32", top_k="i32", limit="fp32", w_expert="i32", w_row="i32",
               s_expert="i32", s_row="i32"),
    "down": dict(act_ptr="*bf16", order_ptr="*i64", meta_ptr="*i32", weights_ptr="*fp32", w2_ptr="*u8", s2_ptr="*u8",
                 y_ptr="*fp32", num_slots="i32", hidden="i32", inter="i32", w_expert="i32", w_row="i32",
                 s_expert="i32", s_row="i32"),
}


@pytest.mark.parametrize(("kernel", "decode", "block_n", "block_k"), list(small_batch_cases()))
def test_small_batch_mxfp4_kernels_compile_for_hopper(kernel, decode, block_n, block_k, tmp_path) -> None:
    """V4-Flash shapes (hidden 4096, intermediate 2048: the sizes and strides the launch specialises
    as divisible by 16). Every decoder must compile for sm_90 without local memory, with the matrix
    instructions on the tensor cores (HGMMA: weights × activationsᵀ puts BLOCK_N ≥ 64 weight rows on
    a wgmma's M) and pipelined copies; the PTX decoders' prmt / rotations and bf16x2 multiplies must
    be there, and `packed` must read its activations without 2-byte gathers."""
    from deepinfer.kernels.triton_ops import moe, mxfp4

    fn = moe._expert_up_kernel if kernel == "up" else moe._expert_down_kernel
    sig = SMALL_BATCH_SIGNATURES[kernel]
    constants = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION="tf32", FORMAT=moe.MXFP4, BLOCK_S=32,
                     DECODE=decode, BF16_MATH=True)
    aligned = {"hidden", "inter", "w_expert", "w_row", "s_expert", "s_row"}
    _, sass, usage = compile_sm90(fn, sig, constants, aligned, 4, 3, tmp_path)
    assert re.search(r"\bHGMMA\.", sass), "no HGMMA in the SASS"
    assert "LDGSTS" in sass, "loads not software-pipelined"
    assert "LDL" not in sass and "STL" not in sass and re.search(r"STACK:0\b", usage), "local memory (spills)"
    if decode == mxfp4.MX_ASM:
        assert "PRMT" in sass and re.search(r"\bHMUL2\.BF16", sass), "the PTX decoder is missing"
    if decode == mxfp4.MX_PACKED:       # rotations, exact bf16 multiplies; natural activations: no gathers
        assert re.search(r"\bSHF\.L\.W", sass) and re.search(r"\bHMUL2\.BF16", sass), "the PTX decoder is missing"
        assert not re.search(r"\bLD(G|S)\.E?\.?U16\b", sass), "2-byte loads (gathers, or scales through shared memory)"
