"""`deepinfer bench`'s workload: random-token prompts sent to an LLMEngine, timed per token.

Requests arrive as a Poisson process (or all at once), at most `max_concurrency` of them in the
engine at a time; every output token is time-stamped when the engine step that produced it returns.
The metrics (`bench_metrics`) are those of an online client:

- TTFT: first token - the request's start (its arrival, or later when it waited for a concurrency slot).
- TPOT, per request of n >= 2 tokens: (last token - first token) / (n - 1).
- ITL: every gap between consecutive tokens of a request (tokens of one step share a time stamp).
- decode step: the wall time of each `engine.step()` call that ran a decode step. In steady state
  this is the engine's decode step time (with ZOS: the GPU's step, when the host keeps up); unlike
  TPOT it leaves out the prefill steps that interleave with decoding.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from deepinfer.sched import StepKind

from .core.outputs import OutputKind
from .sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

MAX_REQUESTS = 2**20
PERCENTILES = (50, 90, 99)


class InvalidBenchArgs(ValueError):
    """A workload parameter is out of range; the message names it and the allowed range.

    Attributes:
        fields: the `BenchWorkload` fields at fault.
    """

    def __init__(self, message: str, *fields: str) -> None:
        super().__init__(message)
        self.fields = fields


@dataclass(frozen=True, slots=True)
class BenchWorkload:
    """A synthetic workload: `num_prompts` random-token prompts, each generating exactly `output_len`
    tokens (EOS ignored, greedy).

    Attributes:
        num_prompts: timed requests, in [1, 2**20].
        input_len: prompt tokens per request, >= 1 (input_len + output_len <= the engine's max_model_len).
        output_len: output tokens per request, >= 1.
        seed: seeds the prompts and the arrival times, >= 0.
        num_warmup: requests run to completion and discarded before the timed ones, in [0, 2**20].
        request_rate: mean arrivals per second of a Poisson process, > 0; inf = all at once.
        max_concurrency: most timed requests in the engine at once, in [1, 2**20]; None = no limit.

    Raises:
        InvalidBenchArgs: a field out of range; the message names it.
    """

    num_prompts: int
    input_len: int
    output_len: int
    seed: int = 0
    num_warmup: int = 0
    request_rate: float = math.inf
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        _int("num_prompts", self.num_prompts, 1, MAX_REQUESTS)
        _int("input_len", self.input_len, 1, 2**31 - 1)
        _int("output_len", self.output_len, 1, 2**31 - 1)
        _int("seed", self.seed, 0, 2**63 - 1)
        _int("num_warmup", self.num_warmup, 0, MAX_REQUESTS)
        rate = self.request_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
            raise InvalidBenchArgs(f"request_rate={rate!r} must be > 0 requests/s (inf = all at once)",
                                   "request_rate")
        if self.max_concurrency is not None:
            _int("max_concurrency", self.max_concurrency, 1, MAX_REQUESTS)

    def check_fits(self, max_model_len: int) -> None:
        """Raises InvalidBenchArgs unless a request fits the engine: input_len + output_len <= max_model_len."""
        if self.input_len + self.output_len > max_model_len:
            raise InvalidBenchArgs(
                f"input_len + output_len = {self.input_len} + {self.output_len} must be <= the engine's "
                f"max_model_len={max_model_len}", "input_len", "output_len")


    def requests(self, vocab_size: int) -> BenchRequests:
        """The prompts and arrival times, drawn from `seed` (warm-up prompts from seed + 1, so that
        they differ from the timed ones); the same for any num_warmup."""
        rng = random.Random(self.seed)
        prompts = [[rng.randrange(vocab_size) for _ in range(self.input_len)] for _ in range(self.num_prompts)]
        offsets = arrival_offsets(self.num_prompts, self.request_rate, rng)
        warmup_rng = random.Random(self.seed + 1)
        warmup = [[warmup_rng.randrange(vocab_size) for _ in range(self.input_len)] for _ in range(self.num_warmup)]
        return BenchRequests(prompts, warmup, offsets)


@dataclass(frozen=True, slots=True)
class BenchRequests:
    """A workload's requests: prompt token ids, and seconds from the start at which each timed one arrives."""

    prompts: list[list[int]]
    warmup_prompts: list[list[int]]
    arrival_offsets: list[float]


@dataclass(frozen=True, slots=True)
class RequestTrace:
    """What one timed request did: start and token times in seconds (one clock), and how it ended."""

    start: float
    token_times: tuple[float, ...]
    finish_reason: str


def run_bench(engine: LLMEngine, num_prompts: int, input_len: int, output_len: int, seed: int = 0, *,
              num_warmup: int = 0, request_rate: float = math.inf, max_concurrency: int | None = None,
              progress: bool = False) -> dict[str, Any]:
    """Run a synthetic workload (see `BenchWorkload`) on `engine` and return its metrics.

    Returns:
        `bench_metrics` of the timed requests, plus the workload's parameters (request_rate as the
        string "inf" when unbounded, so that the dict is valid JSON); with speculative decoding also
        the timed requests' spec_verify_steps, spec_draft_tokens, spec_accepted_tokens and
        spec_mean_accepted_length (tokens per verified row: accepted drafts + the target's own token).
    Raises:
        InvalidBenchArgs: a parameter out of range, or input_len + output_len > engine.max_model_len.
    """
    workload = BenchWorkload(num_prompts, input_len, output_len, seed, num_warmup, request_rate, max_concurrency)
    workload.check_fits(engine.max_model_len)
    requests = workload.requests(engine.model.cfg.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    _run_to_completion(engine, requests.warmup_prompts, params)
    prompts, offsets = requests.prompts, requests.arrival_offsets
    spec_before = engine.stats()
    with tqdm(total=num_prompts, disable=not progress, desc="bench", unit="req") as bar:
        traces, elapsed, decode_steps = _run_timed(engine, prompts, params, offsets, max_concurrency, bar)
    spec_after = engine.stats()
    result: dict[str, Any] = {
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "num_warmup": num_warmup,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate, "max_concurrency": max_concurrency,
        "seed": seed,
    }
    result.update(bench_metrics(traces, elapsed, input_len, decode_steps))
    if engine.args.num_speculative_tokens:     # the timed requests' drafts (the warm-up's left out)
        rows = spec_after.spec_verify_rows - spec_before.spec_verify_rows
        accepted = spec_after.spec_accepted_tokens - spec_before.spec_accepted_tokens
        result.update(spec_verify_steps=spec_after.spec_verify_steps - spec_before.spec_verify_steps,
                      spec_draft_tokens=spec_after.spec_draft_tokens - spec_before.spec_draft_tokens,
                      spec_accepted_tokens=accepted,
                      spec_mean_accepted_length=round((accepted + rows) / rows, 3) if rows else None)
    return result


def arrival_offsets(num_requests: int, request_rate: float, rng: random.Random) -> list[float]:
    """Seconds from the start at which each request arrives: 0 for the first, then exponential gaps of
    mean 1 / request_rate (a Poisson process); all 0 when request_rate is inf."""
    offsets = [0.0] * num_requests
    if math.isinf(request_rate):
        return offsets
    for i in range(1, num_requests):
        offsets[i] = offsets[i - 1] + rng.expovariate(request_rate)
    return offsets


def bench_metrics(traces: Sequence[RequestTrace], elapsed: float, input_len: int,
                  decode_steps: Sequence[float] = ()) -> dict[str, Any]:
    """Throughput and latency of finished requests over `elapsed` seconds.

    Args:
        decode_steps: seconds of each `step()` call that ran a decode step.
    Returns:
        elapsed_s, num_completed, finish_reasons (reason -> count), request_throughput (requests/s),
        output_tokens_per_s, total_tokens_per_s (prompt + output), num_decode_steps, and for each of
        ttft, tpot, itl and decode_step mean_<m>_ms, p50_<m>_ms, p90_<m>_ms, p99_<m>_ms (None when there
        is no such value, e.g. TPOT and ITL of one-token outputs). Rates and times are rounded to 2 and 3
        decimals.
    Raises:
        ValueError: elapsed <= 0.
    """
    if not elapsed > 0:
        raise ValueError(f"elapsed={elapsed!r} must be > 0 seconds")
    output_tokens = sum(len(t.token_times) for t in traces)
    ttft = [t.token_times[0] - t.start for t in traces if t.token_times]
    tpot = [(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1) for t in traces
            if len(t.token_times) > 1]
    itl = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:])]
    result: dict[str, Any] = {
        "elapsed_s": round(elapsed, 4),
        "num_completed": len(traces),
        "finish_reasons": dict(sorted(Counter(t.finish_reason for t in traces).items())),
        "request_throughput": round(len(traces) / elapsed, 2),
        "output_tokens_per_s": round(output_tokens / elapsed, 2),
        "total_tokens_per_s": round((output_tokens + len(traces) * input_len) / elapsed, 2),
        "num_decode_steps": len(decode_steps),
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("decode_step", list(decode_steps))):
        result.update(_summary(name, values))
    return result


def _summary(name: str, seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {f"{key}_{name}_ms": None for key in ("mean", *(f"p{p}" for p in PERCENTILES))}
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    summary: dict[str, float | None] = {f"mean_{name}_ms": round(float(ms.mean()), 3)}
    for p, value in zip(PERCENTILES, np.percentile(ms, PERCENTILES)):
        summary[f"p{p}_{name}_ms"] = round(float(value), 3)
    return summary


def _run_to_completion(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> None:
    for prompt in prompts:
        engine.add_request(None, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def _run_timed(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, offsets: list[float],
               max_concurrency: int | None, bar: tqdm) -> tuple[list[RequestTrace], float, list[float]]:
    """Send the prompts at their arrival offsets; returns the traces (in finishing order), the
    seconds from the start to the last finish and the seconds of each decode `step()` call."""
    starts: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    traces: list[RequestTrace] = []
    decode_steps: list[float] = []
    t0 = time.perf_counter()
    # Times at which each free concurrency slot became free; a request starts no earlier.
    free_slots: deque[float] = deque([t0] * max_concurrency) if max_concurrency is not None else deque()
    next_prompt = 0
    last_finish = t0
    while next_prompt < len(prompts) or starts:
        now = time.perf_counter()
        while (next_prompt < len(prompts) and t0 + offsets[next_prompt] <= now
               and (max_concurrency is None or free_slots)):
            arrival = t0 + offsets[next_prompt]
            request_id = engine.add_request(None, prompts[next_prompt], params, output_kind=OutputKind.DELTA)
            starts[request_id] = max(arrival, free_slots.popleft()) if max_concurrency is not None else arrival
            token_times[request_id] = []
            next_prompt += 1
        if not engine.has_unfinished_requests():
            if starts:
                raise RuntimeError("the engine went idle before every request finished")
            time.sleep(max(0.0, t0 + offsets[next_prompt] - time.perf_counter()))
            continue
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if engine.last_step_kind is StepKind.DECODE:
            decode_steps.append(now - before)
        for out in outputs:
            if out.request_id not in starts:
                continue
            token_times[out.request_id].extend([now] * len(out.outputs[0].token_ids))   # the new tokens
            if out.finished:
                traces.append(RequestTrace(starts.pop(out.request_id), tuple(token_times.pop(out.request_id)),
                                           str(out.outputs[0].finish_reason)))
                if max_concurrency is not None:
                    free_slots.append(now)
                last_finish = now
                bar.update(1)
    return traces, last_finish - t0, decode_steps


def _int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidBenchArgs(f"{name}={value!r} must be an integer in [{low}, {high}]", name)
