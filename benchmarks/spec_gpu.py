"""Speculative decoding's speed-up apart from the draft head's quality (issue #31 item 4).

    python benchmarks/spec_gpu.py --out spec_gpu.json                  # V4-Flash-shaped, on the GPU
    python benchmarks/spec_gpu.py --tiny --device cpu --out /tmp/spec_tiny.json    # code-path check

The model is V4-Flash-shaped (`v4_flash_dummy.flash_config`, `--layers` of them; `--tiny`: its tiny
widths) with seeded random weights (`load_format="dummy"`) and a random one-stage DSpark head (k =
`--num-speculative-tokens` drafts). A random head's drafts are never right, so the benchmark overrides
the verification: `forced_acceptance` makes the verifier accept the first j drafts of each row, where
draft i is accepted with a fixed probability p given the ones before it were (p solved so that the
mean accepted length, accepted drafts + the target's own token with all k drafts verified, is
1.5 / 2.0 / 3.0 / 4.0), and reports p as every draft's confidence (what the varlen policy reads). The
override patches `deepinfer.engine.speculative.spec_step` inside this process for the run only: no
engine argument, environment variable or server flag reaches it (tests/test_spec_gpu_bench.py checks).

Each concurrency (`--concurrency`, default 1 16 64 256) runs `deepinfer.engine.bench.run_bench` with
that many requests in flight: plain decoding, then speculative decoding at each mean accepted length,
in the same process (the same model shape and workload). Per run: TPOT, output tokens/s, the mean
accepted length measured, TPOT / plain TPOT, and the share of the speculative step's device time spent
in the draft walk (`SpeculativeStats.spec_draft_ms` over draft + verify + sampling). JSON out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from deepinfer.engine import LLM
from deepinfer.engine.bench import run_bench
from deepinfer.engine.speculative import spec_step
from deepinfer.model import DSparkDraft
from deepinfer.model.layers.moe import Experts
from deepinfer.spec import VerifyInput, VerifyResult

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash_dummy import flash_config, tiny_flash_config

DSPARK = {"dspark_block_size": 5, "dspark_noise_token_id": 2, "dspark_markov_rank": 64}


def acceptance_rate(mean_accepted_length: float, k: int) -> float:
    """p such that 1 + p + p² + … + p^k = mean_accepted_length (each of k drafts accepted with
    probability p given the earlier ones were).

    Raises:
        ValueError: mean_accepted_length outside [1, k + 1].
    """
    if not 1.0 <= mean_accepted_length <= k + 1:
        raise ValueError(f"mean accepted length {mean_accepted_length} must be in [1, {k + 1}] for k={k}")
    low, high = 0.0, 1.0
    for _ in range(60):
        p = (low + high) / 2
        if sum(p ** i for i in range(k + 1)) < mean_accepted_length:
            low = p
        else:
            high = p
    return (low + high) / 2


class _RandomDraft(DSparkDraft):
    """A one-stage DSpark head with seeded random weights, made where the engine would load one
    (`attach_draft_head`); `forced_acceptance` sets the confidence its proposals report."""

    confidence: float | None = None

    @classmethod
    def from_model(cls, target: torch.nn.Module, *, expert_dtype: str | None = None,
                   block_size: int | None = None) -> DSparkDraft:
        draft = cls(target, 1, expert_dtype=expert_dtype, block_size=block_size)
        draft.init_weights(seed=7, std=0.02)
        gen = torch.Generator(device=target.embed.weight.device).manual_seed(7)
        cfg = target.cfg
        for module in draft.modules():
            if isinstance(module, Experts) and module.expert_dtype is not None:
                module.randomise_quantised_(cfg.moe_intermediate_size, cfg.hidden_size, 0.02, gen)
        return draft.eval()

    def propose(self, *args: Any, **kwargs: Any) -> Any:
        proposal = super().propose(*args, **kwargs)
        if _RandomDraft.confidence is None:
            return proposal
        return dataclasses.replace(proposal, confidence=torch.full_like(proposal.confidence, _RandomDraft.confidence))


@contextlib.contextmanager
def random_draft_head() -> Iterator[None]:
    """Engines built inside attach a random draft head (`_RandomDraft`) to a checkpoint-less model."""
    saved = spec_step.DSparkDraft, spec_step.num_stages_in
    spec_step.DSparkDraft, spec_step.num_stages_in = _RandomDraft, lambda tensors: 1
    try:
        yield
    finally:
        spec_step.DSparkDraft, spec_step.num_stages_in = saved


@contextlib.contextmanager
def forced_acceptance(rate: float, seed: int = 0) -> Iterator[None]:
    """Verification accepts each draft with probability `rate` given the earlier ones were (the target's
    own tokens then stand in for the accepted drafts, and a wrong token for the first rejected one);
    the draft head reports `rate` as every draft's confidence. Benchmark-only: patches this process."""
    real_verify = spec_step.verify
    generators: dict[torch.device, torch.Generator] = {}

    def forced(vi: VerifyInput) -> VerifyResult:
        target = vi.target_logits
        num_rows, k = vi.draft_ids.shape
        gen = generators.setdefault(target.device, torch.Generator(device=target.device).manual_seed(seed))
        best = target[:, :k].argmax(dim=-1)
        accept = torch.cumprod((torch.rand((num_rows, k), generator=gen, device=target.device) < rate).long(), dim=1)
        drafts = torch.where(accept.bool(), best, (best + 1) % target.shape[-1])
        return real_verify(dataclasses.replace(vi, draft_ids=drafts, temperature=torch.zeros_like(vi.temperature),
                                               draft_probs=None, processed_logits=None))

    spec_step.verify, _RandomDraft.confidence = forced, rate
    try:
        yield
    finally:
        spec_step.verify, _RandomDraft.confidence = real_verify, None


def _engine_args(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    expert_dtype = args.expert_dtype if args.expert_dtype != "auto" else (None if args.tiny else "fp8")
    engine: dict[str, Any] = {"model": str(folder), "load_format": "dummy", "device": args.device,
                              "dtype": args.dtype, "expert_dtype": expert_dtype, "max_num_seqs": max(args.concurrency),
                              "max_model_len": args.input_len + args.output_len + 64, "seed": 0}
    if args.device.startswith("cuda"):
        engine["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        engine["kv_cache_memory_mb"] = args.kv_cache_memory_mb
    if args.zos is not None:
        engine["zero_overhead_scheduling"] = args.zos
    return engine


def _bench(llm: LLM, args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    engine = llm.engine
    before = engine.stats()
    result = run_bench(engine, num_prompts=concurrency * args.waves, input_len=args.input_len,
                       output_len=args.output_len, seed=1, num_warmup=min(concurrency, args.warmup),
                       max_concurrency=concurrency)
    after = engine.stats()
    draft, verify, sample = (getattr(after, f) - getattr(before, f)
                             for f in ("spec_draft_ms", "spec_verify_ms", "spec_sample_ms"))
    keep = ("mean_tpot_ms", "p50_tpot_ms", "output_tokens_per_s", "mean_decode_step_ms", "num_decode_steps",
            "spec_mean_accepted_length", "spec_draft_tokens", "spec_verify_steps")
    out = {key: result[key] for key in keep if key in result}
    if engine.args.num_speculative_tokens and draft + verify + sample > 0:
        out["draft_share_of_step"] = round(draft / (draft + verify + sample), 3)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Plain decoding, then speculative decoding at each mean accepted length, at each concurrency."""
    raw = tiny_flash_config(args.layers) if args.tiny else flash_config(args.layers)
    raw.update(DSPARK, dspark_block_size=args.num_speculative_tokens,
               dspark_target_layer_ids=sorted({max(args.layers - 2, 0), args.layers - 1}))
    report: dict[str, Any] = {"shape": "tiny" if args.tiny else f"v4-flash-{args.layers}l", "device": args.device,
                              "dtype": args.dtype, "expert_dtype": args.expert_dtype,
                              "k": args.num_speculative_tokens, "varlen": args.varlen,
                              "input_len": args.input_len, "output_len": args.output_len, "plain": {}, "spec": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(raw))
        engine = _engine_args(args, folder)
        plain = LLM(**engine)
        report["device_name"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        for c in args.concurrency:
            report["plain"][c] = _bench(plain, args, c)
            print(f"plain c={c}: {report['plain'][c]}", file=sys.stderr)
        del plain
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        with random_draft_head():
            spec = LLM(**engine, num_speculative_tokens=args.num_speculative_tokens, varlen_verify=args.varlen)
        for length in args.accepted_lengths:
            runs = report["spec"][length] = {}
            with forced_acceptance(acceptance_rate(length, args.num_speculative_tokens)):
                for c in args.concurrency:
                    runs[c] = _bench(spec, args, c)
                    plain_tpot = report["plain"][c].get("mean_tpot_ms")
                    if plain_tpot and runs[c].get("mean_tpot_ms") is not None:
                        runs[c]["tpot_vs_plain"] = round(runs[c]["mean_tpot_ms"] / plain_tpot, 3)
                    print(f"spec L={length} c={c}: {runs[c]}", file=sys.stderr)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny widths (a CPU check of the code path)")
    parser.add_argument("--layers", type=int, default=4, help="backbone layers [default: 4]")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--expert-dtype", default="auto", choices=("auto", "fp8", "fp4"),
                        help="routed experts' format; auto = fp8 (the released V4-Flash's), the dtype with --tiny")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--varlen", action=argparse.BooleanOptionalAction, default=True,
                        help="varlen verify (default) or every draft verified")
    parser.add_argument("--zos", action=argparse.BooleanOptionalAction, default=None,
                        help="zero_overhead_scheduling for both engines [default: the engine's]")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--accepted-lengths", type=float, nargs="+", default=[1.5, 2.0, 3.0, 4.0])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--waves", type=int, default=2, help="requests per concurrency slot [default: 2]")
    parser.add_argument("--warmup", type=int, default=4, help="warm-up requests (at most the concurrency)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--kv-cache-memory-mb", type=float, default=64)
    parser.add_argument("--out", type=Path, required=True, help="JSON report")
    args = parser.parse_args(argv)
    for length in args.accepted_lengths:
        acceptance_rate(length, args.num_speculative_tokens)      # refuse an impossible length up front
    report = run(args)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
