"""DeepSeek's TileLang mHC kernels (`tile-kernels`) against ours, at V4-Flash shapes (hc 4, dim 4096).

    source .device/activate.sh && source benchmarks/device_env.sh     # on the device (bundle carried)
    python3 benchmarks/tile_kernels_mhc.py --out $OUT/tile_kernels_mhc.json

`pre`: the projection GEMM (float32, ours for both) then tile-kernels' `mhc_pre_big_fuse_fwd` (fed one
split-K partial and the row's sum of squares) vs our `triton_ops.hc_pre_fused`; `post`:
`mhc_post_fwd` vs `hc_post_fused`. Each is checked against `reference.hc_pre` / `reference.hc_post`.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from deepinfer.kernels import reference, triton_ops

HC, DIM, ITERS, EPS = 4, 4096, 20, 1e-6


def tk_pre(streams, fn, scale, base):
    from tile_kernels.mhc import mhc_pre_big_fuse_fwd

    tokens = streams.shape[0]
    flat = streams.reshape(tokens, -1).float()
    mul = (flat @ fn.t()).view(1, tokens, -1)
    sqrsum = flat.square().sum(-1).view(1, tokens)
    post = torch.empty(tokens, HC, dtype=torch.float32, device="cuda")
    comb = torch.empty(tokens, HC * HC, dtype=torch.float32, device="cuda")
    collapsed = torch.empty(tokens, DIM, dtype=torch.bfloat16, device="cuda")
    mhc_pre_big_fuse_fwd(mul, sqrsum, scale, base, streams, post, comb, collapsed, EPS, EPS, EPS, 2.0, ITERS,
                         n_splits=1)
    return collapsed, post, comb.view(tokens, HC, HC)


def tk_post(x, residual, post, comb):
    from tile_kernels.mhc import mhc_post_fwd

    tokens = x.shape[0]
    return mhc_post_fwd(x.view(1, tokens, DIM), residual.view(1, tokens, HC, DIM), post.view(1, tokens, HC, 1),
                        comb.contiguous().view(1, tokens, HC, HC)).view(tokens, HC, DIM)


def max_err(got, want) -> float:
    return max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))


def timed(row: dict, name: str, call, want) -> None:
    """Median µs of `call` and its max abs error against `want` (a tuple of tensors), or the error."""
    try:
        row[f"{name}_us"] = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median") * 1000
        got = call()
        row[f"{name}_err"] = max_err(got if isinstance(got, tuple) else (got,), want)
    except Exception as err:                      # report, keep going
        row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]


def measure(b: int, gen: torch.Generator) -> dict:
    streams = torch.randn(b, HC, DIM, generator=gen).cuda().bfloat16()
    fn = (torch.randn((2 + HC) * HC, HC * DIM, generator=gen) * 0.01).cuda()
    scale, base = (1 + torch.randn(3, generator=gen) * 0.2).cuda(), torch.randn((2 + HC) * HC, generator=gen).cuda()
    x = torch.randn(b, DIM, generator=gen).cuda().bfloat16()
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    want_pre = reference.hc_pre(streams, fn, scale, base, **kw)
    post, comb = want_pre[1], want_pre[2]
    want_post = (reference.hc_post(x, streams, post, comb),)
    row = {"batch": b}
    timed(row, "ours_pre", lambda: triton_ops.hc_pre_fused(streams, fn, scale, base, **kw), want_pre)
    timed(row, "tile_kernels_pre", lambda: tk_pre(streams, fn, scale, base), want_pre)
    timed(row, "ours_post", lambda: triton_ops.hc_post_fused(x, streams, post, comb), want_post)
    timed(row, "tile_kernels_post", lambda: tk_post(x, streams, post, comb), want_post)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,256")
    ap.add_argument("--out", default="tile_kernels_mhc.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in [int(x) for x in args.batches.split(",") if x]:
        rows.append(measure(b, gen))
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
