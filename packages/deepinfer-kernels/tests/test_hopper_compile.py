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
EXPERT_META = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "PRECISION", "FORMAT", "BLOCK_S", "DECODE", "BF16_MATH")


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

    # MXFP4 with the shipped decoder here; every decoder: test_hopper_compile_moe.py
    formats = ((moe.PLAIN, "*bf16", "*bf16"), (moe.FP8_BLOCK, "*fp8e4nv", "*fp32"), (moe.MXFP4, "*u8", "*u8"))
    for fmt, weight, scale in formats:
        tiles = moe._tiles(fmt, 128 if fmt == moe.FP8_BLOCK else 32, moe.MXFP4_DECODE)
        meta = dict(zip(EXPERT_META, (tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"], "tf32", fmt,
                                      128 if fmt == moe.FP8_BLOCK else 32, moe.MXFP4_DECODE, True), strict=True))
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


def prefill_kernels():
    """The prefill attention reading its rows in place (CSA and window-only, bfloat16 tiles of a long
    chunk; the batch-invariant one-query tiles) and the prefill's index scores, at V4-Flash's shapes."""
    from deepinfer.kernels.triton_ops import indexer, paged

    pointers = {"q_ptr": "*bf16", "win_ptr": "*bf16", "sink_ptr": "*fp32", "out_ptr": "*bf16", "paged_ptr": "*bf16",
                "table_ptr": "*i32", "ids_ptr": "*i64"}
    ints = ("q_query", "q_head", "win_row", "paged_block", "paged_row", "ids_stride", "out_query", "out_head",
            "num_heads", "head_dim", "start", "window", "num_ids", "table_width", "rows_per_block", "ratio")
    signature = {**pointers, **dict.fromkeys(ints, "i32"), "scale": "fp32"}
    for has_paged, num_queries in ((True, 8192), (False, 8192), (True, 1)):   # the wrapper's tiles, the invariant's
        yield paged._prefill_attention_kernel, signature, {"HAS_PAGED": has_paged, "PRECISION": "tf32",
                                                           **paged._attention_tiles(2, 512, num_queries)}
    index = {"q_ptr": "*bf16", "keys_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32",
             **dict.fromkeys(("q_query", "q_head", "keys_row", "w_query", "out_query", "num_queries", "num_heads",
                              "dim", "num_keys"), "i32"), "scale": "fp32"}
    yield indexer._index_scores_kernel, index, {"PRECISION": "tf32", **indexer.index_tiles(2, 128)}


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


def v41_kernels():
    """DeepSeek-V4.1: the attention over packed rows (decode at each batch size's bfloat16 tiles, with and
    without splits; prefill with a chunk; a plain ring with packed entries; all plain), the index scores
    (per-query tables and one shared table) and the row quantisation (every format, packed and fake)."""
    from deepinfer.kernels.triton_ops import paged, v41_paged, v41_quant

    ints = ("q_query", "q_head", "slot_stride", "ring_slot", "ring_row", "chunk_row", "paged_block", "paged_row",
            "table_stride", "ids_stride", "out_query", "out_head", "num_heads", "head_dim", "ring_len", "window",
            "chunk_start", "chunk_len", "num_ids", "table_width", "rows_per_block", "ratio")

    def signature(ring: str, entries: str) -> dict[str, str]:
        pointers = {"q_ptr": "*bf16", "pos_ptr": "*i64", "ring_ptr": ring, "slot_ptr": "*i64", "sink_ptr": "*fp32",
                    "out_ptr": "*bf16", "part_ptr": "*fp32", "chunk_ptr": "*bf16", "paged_ptr": entries,
                    "table_ptr": "*i32", "ids_ptr": "*i64"}
        return {**pointers, **dict.fromkeys(ints, "i32"), "scale": "fp32"}

    packed = {"RING_FMT": v41_paged.MXFP8, "PAGED_FMT": v41_paged.FP4_E4M3, "HAS_PAGED": True, "PRECISION": "tf32"}
    for num_seqs, splits in ((1, 8), (32, 1), (256, 1)):
        yield v41_paged._v41_attention_kernel, signature("*u8", "*u8"), {
            **packed, "HAS_CHUNK": False, "SPLITS": splits, **paged._attention_tiles(2, 512, num_seqs)}
    tiles = paged._attention_tiles(2, 512, 1)
    yield v41_paged._v41_attention_kernel, signature("*u8", "*u8"), {**packed, "HAS_CHUNK": True, "SPLITS": 1,
                                                                     **tiles}
    yield v41_paged._v41_attention_kernel, signature("*bf16", "*u8"), {
        **packed, "RING_FMT": v41_paged.PLAIN, "HAS_CHUNK": True, "SPLITS": 1, **tiles}
    yield v41_paged._v41_attention_kernel, signature("*bf16", "*bf16"), {
        **packed, "RING_FMT": v41_paged.PLAIN, "PAGED_FMT": v41_paged.PLAIN, "HAS_CHUNK": False, "SPLITS": 8, **tiles}
    index = {"q_ptr": "*bf16", "keys_ptr": "*u8", "table_ptr": "*i32", "w_ptr": "*fp32", "out_ptr": "*fp32",
             **dict.fromkeys(("q_query", "q_head", "keys_block", "keys_row", "table_stride", "w_query", "num_queries",
                              "num_heads", "dim", "num_entries", "table_width", "rows_per_block", "ratio"), "i32"),
             "scale": "fp32"}
    for queries in (1, 8):
        yield v41_paged._v41_index_kernel, index, {"FMT": v41_paged.FP4_UE8M0, "QUERIES": queries, "BLOCK_H": 16,
                                                   "BLOCK_N": 32, "BLOCK_D": 128, "PRECISION": "tf32"}
    for fmt, block, dim in ((v41_quant.MXFP8, 32, 512), (v41_quant.FP4_E4M3, 16, 512), (v41_quant.FP4_UE8M0, 32, 128)):
        for fake in (False, True):
            yield v41_quant._quant_rows_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16" if fake else "*u8",
                                                 "x_row": "i32", "out_row": "i32", "dim": "i32"}, {
                "FMT": fmt, "FAKE": fake, "BLOCK": block, "NUM_BLOCKS": dim // block, "BLOCK_D": dim}


@pytest.mark.parametrize(("fn", "signature", "constants"),
                         [*sampling_kernels(), *expert_kernels(), *attention_kernels(), *prefill_kernels(),
                          *invariant_kernels(), *v41_kernels()],
                         ids=lambda v: getattr(v, "__name__", None) if callable(v) else None)
def test_kernel_compiles_for_hopper(fn, signature, constants) -> None:
    kernel = compile_for_hopper(fn, signature, constants)
    assert "sm_90" in kernel.asm["ptx"]
