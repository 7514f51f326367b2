"""GPU probe of the `packed` MXFP4 decoder (issue #29): is every weight it decodes bit-exact?

    source benchmarks/device_env.sh
    python benchmarks/mxfp4_packed_probe.py                 # ~10 s on a GPU; exit status 1 on a wrong bit
    python benchmarks/mxfp4_packed_probe.py --cpu-smoke     # the script itself, under Triton's interpreter

1. The tile of the H100 probe of 2026-12-08 (docs/benchmarks/moe_quantised.md §5): 64 rows × 32
   columns, 4 warps (two code words a thread, fewer than the asm's pack of 4), decoded by
   `mxfp4._packed_tile` (on a GPU the asm `mxfp4_packed._PACKED_ASM`); the probe's rows (codes 0–15
   twice, codes × 7 mod 16, all 1, all 9) at scale bytes 127 and 120, got / want bf16 bits per column.
2. The same kernel on every code at every scale byte 0–255 (one row each), and on random codes under
   random scale bytes at the shipped 64 × 128 tile: the number of wrong weights (any NaN matches NaN).
3. The ops on re-packed experts against `reference.moe_experts_mxfp4`: the small-batch kernels
   (`moe_experts_mxfp4_invariant(packed=True)`: the asm in the layout the wgmma's A operand gives it)
   at 1 and 8 tokens, and the grouped kernels (format MXFP4_PACKED: Triton integer ops) at 64 tokens:
   the largest error relative to the reference's largest output (weights exact: only the summation
   order and the activations' rounding differ; wrong weights gave ~1.5).

Under --cpu-smoke the decoder is the interpreter's integer twin (`mxfp4_packed.packed_pairs`), not the
asm: it checks this script, not the GPU code.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"       # before triton is imported

import torch
import triton
import triton.language as tl

from deepinfer.kernels import reference, repack_mxfp4_for_decode
from deepinfer.kernels.triton_ops import moe, mxfp4
from deepinfer.kernels.triton_ops.moe_grouped import grouped_experts

TOLERANCE = 2e-2                               # of the ops' largest output


@triton.jit
def _tile_kernel(w_ptr, s_ptr, out_ptr, num_rows, k_in, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BF16_MATH: tl.constexpr):
    """Columns 0 … BLOCK_K of re-packed MXFP4 rows decoded by `mxfp4._packed_tile`, as bf16 bits."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < num_rows
    words, scale = mxfp4._code_words(w_ptr + n[:, None] * (k_in // 2), s_ptr + n[:, None] * (k_in // 32), 0, k_in,
                                     nm, BLOCK_K)
    w = mxfp4._packed_tile(words, scale, BLOCK_K, BF16_MATH)
    tl.store(out_ptr + n[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :], w.to(tl.int16, bitcast=True),
             mask=nm[:, None])


def decode(codes: torch.Tensor, scale: torch.Tensor, block_k: int, device: str) -> torch.Tensor:
    """Checkpoint-layout codes [rows, block_k / 2] uint8 and scale bytes [rows, block_k / 32] → the
    packed decoder's bf16 bits [rows, block_k] int16 (CPU), the codes re-packed first."""
    rows = codes.shape[0]
    out = torch.empty(rows, block_k, dtype=torch.int16, device=device)
    _tile_kernel[(triton.cdiv(rows, 64),)](repack_mxfp4_for_decode(codes).to(device), scale.to(device), out, rows,
                                          block_k, BLOCK_N=64, BLOCK_K=block_k, BF16_MATH=device == "cuda")
    return out.cpu()


def want_bits(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return reference.dequant_mxfp4(codes, scale).to(torch.bfloat16).view(torch.int16)


def wrong(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where bf16 bits differ, any NaN matching any NaN."""
    nan = torch.isnan(got.view(torch.bfloat16)) & torch.isnan(want.view(torch.bfloat16))
    return (got != want) & ~nan


def as_codes(rows: list[list[int]]) -> torch.Tensor:
    c = torch.tensor(rows)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).to(torch.uint8)


def probe_tile(device: str) -> int:
    """Check 1: the probe's rows, printed; → wrong weights."""
    n = torch.arange(32)
    rows = [(n % 16).tolist(), (n * 7 % 16).tolist(), [1] * 32, [9] * 32] * 16                   # 64 rows
    codes = as_codes(rows)
    bad = 0
    for s in (127, 120):
        scale = torch.full((64, 1), s, dtype=torch.uint8)
        got, want = decode(codes, scale, 32, device), want_bits(codes, scale)
        bad += int(wrong(got, want).sum())
        for r in range(4):
            print(f"s {s} row {r} codes {rows[r][:16]}")
            print(" got  " + " ".join(f"{v & 0xFFFF:04x}" for v in got[r].tolist()))
            print(" want " + " ".join(f"{v & 0xFFFF:04x}" for v in want[r].tolist()))
    return bad


def every_code_and_random(device: str) -> tuple[int, int]:
    """Check 2: → (wrong weights of every code at every scale byte, of the random 64 × 128 rows)."""
    gen = torch.Generator().manual_seed(29)
    codes = as_codes([torch.randperm(32, generator=gen).remainder(16).tolist() for _ in range(256)])
    scale = torch.arange(256, dtype=torch.uint8)[:, None]
    every = int(wrong(decode(codes, scale, 32, device), want_bits(codes, scale)).sum())
    codes = torch.randint(0, 256, (128, 64), generator=gen, dtype=torch.uint8)
    scale = torch.randint(0, 256, (128, 4), generator=gen, dtype=torch.uint8)
    return every, int(wrong(decode(codes, scale, 128, device), want_bits(codes, scale)).sum())


def experts(device: str, hidden: int, inter: int, num_experts: int = 8):
    """Random MXFP4 experts: (w13, s13, w2, s2) as stored, on `device`."""
    gen = torch.Generator().manual_seed(7)
    q13 = [reference.quant_mxfp4((torch.randn(2 * inter, hidden, generator=gen) * hidden**-0.5).to(device))
           for _ in range(num_experts)]
    q2 = [reference.quant_mxfp4((torch.randn(hidden, inter, generator=gen) * inter**-0.5).to(device))
          for _ in range(num_experts)]
    return [torch.stack([q[i] for q in qs]) for qs in (q13, q2) for i in (0, 1)]


def op_errors(device: str, dtype: torch.dtype, hidden: int, inter: int) -> dict[str, float]:
    """Check 3: → the ops' largest error relative to the reference's largest output, by case."""
    w13, s13, w2, s2 = experts(device, hidden, inter)
    p13, p2 = repack_mxfp4_for_decode(w13), repack_mxfp4_for_decode(w2)
    gen = torch.Generator().manual_seed(8)
    out = {}
    for name, tokens in (("small-batch 1 token", 1), ("small-batch 8 tokens", 8), ("grouped 64 tokens", 64)):
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
        ids = torch.stack([torch.randperm(8, generator=gen)[:6] for _ in range(tokens)]).to(device)
        weights = torch.rand(tokens, 6, generator=gen).to(device)
        want = reference.moe_experts_mxfp4(x, ids, weights, w13, s13, w2, s2, 7.0).float()
        if name.startswith("grouped"):
            got = grouped_experts(x, ids, weights, p13, p2, 7.0, moe.MXFP4_PACKED, s13, s2, 32, inter)
        else:
            got = moe.moe_experts_mxfp4_invariant(x, ids, weights, p13, s13, p2, s2, 7.0, packed=True)
        out[name] = ((got.float() - want).abs().max() / want.abs().max()).item()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="Triton's interpreter on the CPU (the integer twin)")
    args = ap.parse_args()
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu-smoke for the script alone")
    if device == "cuda":
        print(torch.cuda.get_device_name(), f"torch {torch.__version__}, triton {triton.__version__}")
    failures = []
    bad = probe_tile(device)
    print(f"probe tile 64 x 32: {bad} wrong weights")
    failures += ["probe tile"] if bad else []
    every, random_rows = every_code_and_random(device)
    print(f"every code at every scale byte: {every} wrong weights; random rows, 64 x 128 tile: {random_rows}")
    failures += (["every code"] if every else []) + (["random rows"] if random_rows else [])
    dtype, hidden, inter = (torch.float32, 128, 64) if args.cpu_smoke else (torch.bfloat16, 1024, 512)
    for name, err in op_errors(device, dtype, hidden, inter).items():
        print(f"{name}: largest error {err:.2e} of the reference's largest output (tolerance {TOLERANCE})")
        failures += [name] if not err <= TOLERANCE else []
    print("packed probe: " + ("PASS" if not failures else "FAIL: " + ", ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
