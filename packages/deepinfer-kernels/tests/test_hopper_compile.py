"""Kernels compiled for Hopper (sm_90) on a machine without a GPU: Triton's front end and the ptxas
shipped with its wheel catch what the CPU interpreter cannot (loop-carried type changes, layouts,
`dot_scaled`), so a kernel written between device sessions at least builds for the H200."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or not PTXAS.exists(),
    reason="needs Triton's compiler (not the interpreter) and the ptxas of its wheel",
)

CHUNK = {"vocab": "i32", "stride": "i32", "num_rows": "i32", "num_chunks": "i32"}
SAMPLING_STATE = {"top_k_ptr": "*i64", "k_state_ptr": "*fp32"}
EXPERT_STRIDES = {"w_expert": "i32", "w_row": "i32", "s_expert": "i32", "s_row": "i32"}
EXPERT_META = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "PRECISION", "FORMAT", "BLOCK_S", "MX_DOT")


def compile_for_hopper(fn, signature: dict[str, str], constants: dict):
    """Compile `fn` for sm_90; `constants` may carry the launch options num_warps / num_stages."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {"num_warps": constants.get("num_warps", 4), "num_stages": constants.get("num_stages", 3)}
    constants = {k: v for k, v in constants.items() if k not in options}
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                          target=GPUTarget("cuda", 90, 32), options=options)


def sampling_kernels():
    from deepinfer.kernels.triton_ops import sampling as s

    shape = {"CHUNK": s.CHUNK, "TILE": s.TILE}
    logits = {"logits_ptr": "*fp32", "temperature_ptr": "*fp32"}
    yield s._chunk_stats_kernel, {**logits, "max_ptr": "*fp32", "sum_ptr": "*fp32", "vocab": "i32", "stride": "i32",
                                  "num_chunks": "i32"}, shape
    yield s._row_stats_kernel, {"max_ptr": "*fp32", "sum_ptr": "*fp32", "stats_ptr": "*fp32", "num_chunks": "i32"}, {
        "NC_BLOCK": 64}
    for cut in (s.TOP_K, s.TOP_P):
        yield s._search_kernel, {
            **logits, "stats_ptr": "*fp32", "top_k_ptr": "*i64", "top_p_ptr": "*fp32", "k_state_ptr": "*fp32",
            "state_ptr": "*fp32", "count_ptr": "*i32", "mass_ptr": "*fp32", "base_ptr": "*fp32", "vocab": "i32",
            "stride": "i32", "num_rows": "i32", "num_chunks": "i32", "step": "i32",
        }, {"CUT": cut, **shape, "SPLITS": s.SPLITS, "NC_BLOCK": 64, "PASSES": s.PASSES}
    yield s._ties_kernel, {**logits, "stats_ptr": "*fp32", **SAMPLING_STATE, "p_state_ptr": "*fp32",
                           "ties_ptr": "*i32", **CHUNK}, {**shape, "PASSES": s.PASSES}
    for cuts in (True, False):
        yield s._race_kernel, {
            **logits, "noise_ptr": "*fp32", "min_p_ptr": "*fp32", "stats_ptr": "*fp32", **SAMPLING_STATE,
            "p_state_ptr": "*fp32", "ties_ptr": "*i32", "best_ptr": "*fp32", "best_id_ptr": "*i32", "vocab": "i32",
            "stride": "i32", "noise_stride": "i32", "num_rows": "i32", "num_chunks": "i32",
        }, {**shape, "PASSES": s.PASSES, "NC_BLOCK": 64, "CUTS": cuts}
    yield s._pick_kernel, {"best_ptr": "*fp32", "best_id_ptr": "*i32", "out_ptr": "*i64", "vocab": "i32",
                           "num_chunks": "i32"}, {"NC_BLOCK": 64}


def expert_kernels():
    from deepinfer.kernels.triton_ops import moe

    formats = ((moe.PLAIN, "*bf16", "*bf16", False), (moe.FP8_BLOCK, "*fp8e4nv", "*fp32", False),
               (moe.MXFP4, "*u8", "*u8", True), (moe.MXFP4, "*u8", "*u8", False))
    for fmt, weight, scale, mx_dot in formats:
        tiles = moe._tiles(fmt, 128 if fmt == moe.FP8_BLOCK else 32)
        meta = dict(zip(EXPERT_META, (tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"], "tf32", fmt,
                                      128 if fmt == moe.FP8_BLOCK else 32, mx_dot), strict=True))
        yield moe._expert_up_kernel, {
            "x_ptr": "*bf16", "order_ptr": "*i64", "meta_ptr": "*i32", "w13_ptr": weight, "s13_ptr": scale,
            "act_ptr": "*bf16", "num_slots": "i32", "hidden": "i32", "inter": "i32", "top_k": "i32", "limit": "fp32",
            **EXPERT_STRIDES,
        }, meta
        yield moe._expert_down_kernel, {
            "act_ptr": "*bf16", "order_ptr": "*i64", "meta_ptr": "*i32", "weights_ptr": "*fp32", "w2_ptr": weight,
            "s2_ptr": scale, "y_ptr": "*fp32", "num_slots": "i32", "hidden": "i32", "inter": "i32", **EXPERT_STRIDES,
        }, meta


def attention_kernels():
    """The paged decode attention at V4-Flash's CSA shape with each batch size's bfloat16 tiles."""
    from deepinfer.kernels.triton_ops import paged

    pointers = ("q", "ring", "slot", "pos", "sink", "out", "part", "paged", "table", "ids")
    types = ("*bf16", "*bf16", "*i64", "*i64", "*fp32", "*bf16", "*fp32", "*bf16", "*i32", "*i64")
    ints = ("q_seq", "q_head", "ring_slot", "ring_row", "paged_block", "paged_row", "table_stride", "ids_stride",
            "out_seq", "out_head", "num_heads", "head_dim", "ring_len", "window", "num_ids", "table_width", "ratio")
    signature = {**{f"{name}_ptr": t for name, t in zip(pointers, types, strict=True)}, **dict.fromkeys(ints, "i32"),
                 "scale": "fp32"}
    for num_seqs in (1, 32, 256):
        yield paged._paged_attention_kernel, signature, {
            "SPLITS": 1, "HAS_PAGED": True, "PRECISION": "tf32", **paged._attention_tiles(2, 512, num_seqs)}


def invariant_kernels():
    """The batch-invariant GEMM at V4-Flash's projection shapes (its tiles depend on them alone), in
    bfloat16 and float32 (the mHC projection's split-K partials), and the decode attention's fixed
    tiles with its fixed split count."""
    import torch

    from deepinfer.kernels.triton_ops import gemm, paged

    ints = ("rows", "n_out", "k_in", "x_row", "x_group", "w_row", "w_group", "out_row", "out_group", "out_split",
            "k_split")
    for dtype, t, precision in ((torch.bfloat16, "*bf16", "tf32"), (torch.float32, "*fp32", "ieee")):
        signature = {"x_ptr": t, "w_ptr": t, "out_ptr": t, **dict.fromkeys(ints, "i32")}
        for n_out, k_in, splits in ((4160, 4096, 1), (40960, 1024, 1), (4096, 8192, 1), (24, 16384, 8)):
            yield gemm._gemm_kernel, signature, {"SPLITS": splits, "BLOCK_M": gemm.BLOCK_M, "PRECISION": precision,
                                                 **gemm._plan(n_out, k_in, dtype, 1)}
    for _, signature, constants in attention_kernels():
        yield paged._paged_attention_kernel, signature, {
            **constants, "SPLITS": paged.INVARIANT_SPLITS, **paged._attention_tiles(2, 512, 1)}
        break


@pytest.mark.parametrize(("fn", "signature", "constants"),
                         [*sampling_kernels(), *expert_kernels(), *attention_kernels(), *invariant_kernels()],
                         ids=lambda v: getattr(v, "__name__", None) if callable(v) else None)
def test_kernel_compiles_for_hopper(fn, signature, constants) -> None:
    kernel = compile_for_hopper(fn, signature, constants)
    assert "sm_90" in kernel.asm["ptx"]
