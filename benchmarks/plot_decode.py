"""Plot the JSON of v4_decode_gpu.py: decode step time against batch size, with the roofline.

    python benchmarks/plot_decode.py decode.json docs/benchmarks/decode_h200.png [LABEL=other.json ...]

Each LABEL=other.json (say fp8=decode_fp8.json, a run with quantised experts) adds that run's
CUDA-graph steps and its own roofline.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def timed(report: dict) -> list[dict]:
    return [r for r in report["ours"] if "eager_ms" in r]      # profile rows have no timings


def main(src: str, dst: str, *others: str) -> None:
    with open(src) as f:
        report = json.load(f)
    ours = timed(report)
    batches = [r["batch"] for r in ours]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(batches, [r["roofline_ms"] for r in ours], "k--", label="memory roofline")
    ax.plot(batches, [r["eager_ms"] for r in ours], "o-", label="DeepInfer eager")
    graphed = [r for r in ours if "graph_ms" in r]
    if graphed:
        ax.plot([r["batch"] for r in graphed], [r["graph_ms"] for r in graphed], "s-", label="DeepInfer CUDA graph")
    for other in others:
        label, _, path = other.partition("=")
        with open(path) as f:
            rows = [r for r in timed(json.load(f)) if "graph_ms" in r]
        line, = ax.plot([r["batch"] for r in rows], [r["graph_ms"] for r in rows], "d-",
                        label=f"DeepInfer CUDA graph, {label} experts")
        ax.plot([r["batch"] for r in rows], [r["roofline_ms"] for r in rows], ":", color=line.get_color(),
                label=f"roofline, {label} experts")
    hf = [r for r in report.get("transformers", []) if "hf_step_ms" in r]
    if hf:
        ax.plot([r["batch"] for r in hf], [r["hf_step_ms"] for r in hf], "^-", label="transformers")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent sequences (decode batch)")
    ax.set_ylabel("decode step time (ms)")
    ax.set_title(f"{report['gpu']}: {len(report['layers'])} V4-Flash layers, context {report['context']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:])
