"""Varlen vs fixed verify on a measured step-time curve: the seed's experiment (docs/design.md §7.2), simulated.

    .venv/bin/python benchmarks/varlen_sim.py --curve docs/benchmarks/decode_h200_8l_run7.json
    .venv/bin/python benchmarks/varlen_sim.py --curve curve.json --acceptance 0.9,0.85,0.8,0.75,0.7

Curve: the CUDA-graph step times (`ours[*].graph_ms` per `batch`) of a `benchmarks/v4_decode_gpu.py`
JSON, read as forward ms per total query tokens. The engine's own estimators price a step:
`ForwardRuntimeEstimator` (the curve at the step's CUDA-graph key, linear between measured sizes)
and `SamplerRuntimeEstimator` (fed `--sampler-ms`). Beyond the largest measured size the curve is
extended by one point at `--max-extrapolation` × that size, on the line through the last two
measured points; a request count whose fixed step (R · (k + 1) tokens) needs more is not simulated.

Acceptance: per request, k conditional probabilities p_j that draft j is accepted given drafts
1 … j − 1 were; a request's expected tokens for query length q are 1 + Σ_{j < q} Π_{i ≤ j} p_i (the
golden/bonus token plus the accepted drafts). Default model, the seed's online average of
`--mean-accepted` accepted drafts out of k: one constant p with Σ_{j=1..k} p^j = mean (bisection).
`--acceptance` gives the p_j directly instead (from marginal rates a_j = fraction of steps whose
draft j is accepted: p_j = a_j / a_{j−1}, a_0 = 1). Every request has the same p_j, and the varlen
policy is told the true p_j (a calibrated confidence head).

Per R requests: fixed = `FixedVerifyPolicy` (all k drafts, total_q = R · (k + 1)); varlen =
`VarlenVerifyPolicy` (`choose_query_lens`); throughput = expected tokens / (forward + sampler ms);
gain = varlen / fixed − 1, set beside the seed's published gains. Exact expectations, no sampling.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from deepinfer.spec import (
    DEFAULT_GRAPH_INTERVAL,
    FixedVerifyPolicy,
    ForwardRuntimeEstimator,
    SamplerRuntimeEstimator,
    StepTimeCurve,
    VarlenVerifyPolicy,
    cuda_graph_key,
)

# docs/design.md §7.2: EP64/DP64, 5 drafts, requests per rank -> throughput gain of varlen over fixed, %.
SEED_GAIN_PERCENT = {16: -1.5, 32: 1.6, 60: 5.4, 96: 11.0}
SEED_MEAN_ACCEPTED = 3.2
# Greedy sampler on the H200 (docs/benchmarks/engine.md, 2026-11-30): sequences -> ms.
H200_GREEDY_SAMPLER_MS = "1:0.109,32:0.116,256:0.326"


@dataclass(frozen=True, slots=True)
class MeasuredCurve:
    """A recorded step-time curve and where it came from."""

    curve: StepTimeCurve      # sizes = decode batch (query tokens), ms = CUDA-graph step ms
    source: str
    gpu: str
    context: int


@dataclass(frozen=True, slots=True)
class SimResult:
    """Fixed vs varlen verify for one request count, in expectation."""

    num_requests: int
    fixed_total_q: int
    fixed_ms: float
    fixed_tokens: float
    varlen_total_q: int
    varlen_ms: float
    varlen_tokens: float

    @property
    def gain_percent(self) -> float:
        return 100.0 * ((self.varlen_tokens / self.varlen_ms) / (self.fixed_tokens / self.fixed_ms) - 1.0)


@dataclass(frozen=True, slots=True)
class Row:
    """One request count: its simulation, or None when its fixed step lies beyond the usable curve."""

    num_requests: int
    needed_tokens: int        # graph key of the fixed step, R · (k + 1) rounded up
    result: SimResult | None


def load_curve(path: str | Path) -> MeasuredCurve:
    """The `ours` rows of a `benchmarks/v4_decode_gpu.py` JSON that have a `graph_ms` (rows with an
    error, profile and prefill rows are skipped).

    Raises:
        ValueError: no usable row.
    """
    report = json.loads(Path(path).read_text())
    points = sorted((int(r["batch"]), float(r["graph_ms"])) for r in report.get("ours", [])
                    if "batch" in r and "graph_ms" in r)
    if not points:
        raise ValueError(f"{path}: no `ours` row with batch and graph_ms")
    sizes, ms = zip(*points)
    return MeasuredCurve(StepTimeCurve(tuple(sizes), tuple(ms)), str(path), report.get("gpu", "?"),
                         int(report.get("context", 0)))


def extend_curve(curve: StepTimeCurve, max_factor: float) -> tuple[StepTimeCurve, int]:
    """The curve the simulation may use and the largest size it covers: the measured points, plus
    (when `max_factor` > 1 and there are two points) one at floor(largest · max_factor) on the line
    through the last two (slope clamped at 0)."""
    if max_factor < 1.0:
        raise ValueError(f"max_factor={max_factor} must be >= 1")
    limit = int(curve.sizes[-1] * max_factor)
    if limit == curve.sizes[-1] or len(curve.sizes) < 2:
        return curve, curve.sizes[-1]
    (a, b), (ta, tb) = curve.sizes[-2:], curve.ms[-2:]
    slope = max((tb - ta) / (b - a), 0.0)
    return StepTimeCurve(curve.sizes + (limit,), curve.ms + (tb + slope * (limit - b),)), limit


def continuation_for_mean(mean_accepted: float, num_drafts: int) -> float:
    """The constant p with Σ_{j=1..num_drafts} p^j = mean_accepted (bisection to 1e-12).

    Raises:
        ValueError: mean_accepted outside [0, num_drafts].
    """
    if not 0.0 <= mean_accepted <= num_drafts:
        raise ValueError(f"mean_accepted={mean_accepted} outside [0, {num_drafts}]")
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        if sum(mid**j for j in range(1, num_drafts + 1)) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def expected_tokens(acceptance: np.ndarray, query_lens: np.ndarray) -> float:
    """Σ over requests of 1 + the expected accepted drafts among the first query_len − 1.

    Args:
        acceptance: [num_requests, num_drafts] conditional acceptance probabilities.
        query_lens: [num_requests] golden token + verified drafts.
    """
    marginal = np.cumprod(acceptance, axis=1)
    verified = np.arange(acceptance.shape[1])[None, :] < (np.asarray(query_lens)[:, None] - 1)
    return float(len(query_lens) + (marginal * verified).sum())


def simulate(curve: StepTimeCurve, acceptance: Sequence[float], num_requests: int,
             sampler: SamplerRuntimeEstimator, interval: int = DEFAULT_GRAPH_INTERVAL) -> SimResult:
    """One decode step of `num_requests` requests with len(acceptance) drafts each, fixed vs varlen."""
    num_drafts = len(acceptance)
    forward = ForwardRuntimeEstimator(curve, interval=interval)
    seq_ids = tuple(str(i) for i in range(num_requests))
    seq_lens = np.zeros(num_requests, dtype=np.int64)          # neither policy reads them
    rates = np.tile(np.asarray(acceptance, dtype=np.float64), (num_requests, 1))
    varlen = VarlenVerifyPolicy(forward, sampler, default_acceptance=tuple(acceptance))

    def priced(query_lens: np.ndarray) -> tuple[int, float, float]:
        total_q = int(query_lens.sum())
        ms = forward.estimate_ms(total_q) + sampler.estimate_ms(num_requests)
        return total_q, ms, expected_tokens(rates, query_lens)

    fixed = priced(FixedVerifyPolicy().query_lens(seq_ids, seq_lens, num_drafts + 1))
    chosen = priced(varlen.query_lens(seq_ids, seq_lens, num_drafts + 1))
    return SimResult(num_requests, *fixed, *chosen)


def run_experiment(measured: MeasuredCurve, acceptance: Sequence[float], requests: Sequence[int],
                   sampler: SamplerRuntimeEstimator, max_factor: float,
                   interval: int = DEFAULT_GRAPH_INTERVAL) -> tuple[list[Row], int]:
    """Every request count on the extended curve; returns the rows and the largest usable size."""
    curve, limit = extend_curve(measured.curve, max_factor)
    rows = []
    for r in requests:
        needed = cuda_graph_key(r * (len(acceptance) + 1), interval)
        result = simulate(curve, acceptance, r, sampler, interval) if needed <= limit else None
        rows.append(Row(r, needed, result))
    return rows, limit


def parse_sampler_ms(text: str) -> SamplerRuntimeEstimator:
    """`"seqs:ms,seqs:ms"` -> an estimator fed those times ("" = no sampler time)."""
    sampler = SamplerRuntimeEstimator()
    for item in filter(None, text.split(",")):
        seqs, ms = item.split(":")
        sampler.observe(int(seqs), float(ms))
    return sampler


def format_table(rows: Sequence[Row], measured: MeasuredCurve, limit: int, max_factor: float) -> str:
    """Markdown table: fixed vs varlen per request count beside the seed's gain."""
    lines = ["| requests / rank | fixed total_q | fixed ms | fixed tok/ms | varlen total_q | varlen ms "
             "| varlen tok/ms | **gain** | seed's gain |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        seed = SEED_GAIN_PERCENT.get(row.num_requests)
        seed_text = f"{seed:+.1f}%" if seed is not None else "—"
        res = row.result
        if res is None:
            lines.append(f"| {row.num_requests} | {row.needed_tokens} | beyond the curve: measured to "
                         f"{measured.curve.sizes[-1]} tokens, ×{max_factor:g} allowed = {limit} | | | | | | "
                         f"{seed_text} |")
            continue
        lines.append(f"| {res.num_requests} | {res.fixed_total_q} | {res.fixed_ms:.2f} | "
                     f"{res.fixed_tokens / res.fixed_ms:.3f} | {res.varlen_total_q} | {res.varlen_ms:.2f} | "
                     f"{res.varlen_tokens / res.varlen_ms:.3f} | **{res.gain_percent:+.1f}%** | {seed_text} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--curve", default="docs/benchmarks/decode_h200_8l_run7.json",
                    help="a benchmarks/v4_decode_gpu.py JSON")
    ap.add_argument("--requests", default="16,32,60,96", help="requests per rank, comma-separated")
    ap.add_argument("--drafts", type=int, default=5, help="k, drafts per request (with --mean-accepted)")
    ap.add_argument("--mean-accepted", type=float, default=SEED_MEAN_ACCEPTED,
                    help="mean accepted drafts per step -> constant per-position p")
    ap.add_argument("--acceptance", default="", help="conditional per-position p_1..p_k (overrides the two above)")
    ap.add_argument("--max-extrapolation", type=float, default=1.25,
                    help="use the curve up to this factor × its largest measured size")
    ap.add_argument("--sampler-ms", default=H200_GREEDY_SAMPLER_MS, help='"seqs:ms,…"; "" = none')
    ap.add_argument("--interval", type=int, default=DEFAULT_GRAPH_INTERVAL, help="CUDA-graph size interval")
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args()

    if args.acceptance:
        acceptance = [float(x) for x in args.acceptance.split(",")]
        model = f"measured per-position p = {', '.join(f'{p:.3f}' for p in acceptance)}"
    else:
        p = continuation_for_mean(args.mean_accepted, args.drafts)
        acceptance = [p] * args.drafts
        model = f"constant p = {p:.4f} (Σ_j p^j = {args.mean_accepted:g} accepted of {args.drafts})"
    measured = load_curve(args.curve)
    rows, limit = run_experiment(measured, acceptance, [int(x) for x in args.requests.split(",")],
                                 parse_sampler_ms(args.sampler_ms), args.max_extrapolation, args.interval)
    points = ", ".join(f"{s}: {m:.2f}" for s, m in zip(measured.curve.sizes, measured.curve.ms))
    print(f"curve: {measured.source} ({measured.gpu}, context {measured.context}); tokens: ms = {points}")
    print(f"usable to {limit} tokens (×{args.max_extrapolation:g} the largest measured size)")
    print(f"acceptance: {model}; expected accepted drafts per full step "
          f"{float(np.cumprod(acceptance).sum()):.3f}; sampler ms: {args.sampler_ms or 'none'}")
    print(format_table(rows, measured, limit, args.max_extrapolation))
    for row in rows:
        if row.result is None:
            print(f"R={row.num_requests}: the fixed step needs {row.needed_tokens} tokens, beyond the usable "
                  f"curve ({limit}); measure the curve to at least {row.needed_tokens} tokens")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "curve": measured.source, "gpu": measured.gpu, "context": measured.context,
            "curve_sizes": list(measured.curve.sizes), "curve_ms": list(measured.curve.ms),
            "usable_to": limit, "acceptance": acceptance, "sampler_ms": args.sampler_ms,
            "rows": [{"num_requests": r.num_requests, "needed_tokens": r.needed_tokens,
                      "result": None if r.result is None else dict(asdict(r.result),
                                                                    gain_percent=r.result.gain_percent),
                      "seed_gain_percent": SEED_GAIN_PERCENT.get(r.num_requests)} for r in rows],
        }, indent=1))


if __name__ == "__main__":
    main()
