"""`deepinfer bench` and run_bench: argument checks, arrivals, concurrency, warm-up and the metrics."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import pytest

from deepinfer.engine import EngineArgs, LLMEngine
from deepinfer.engine.bench import (
    BenchWorkload,
    InvalidBenchArgs,
    RequestTrace,
    arrival_offsets,
    bench_metrics,
    run_bench,
)
from deepinfer.engine.cli import main


class _SpyEngine:
    """Delegates to an LLMEngine, recording each request's prompt and add time and the peak in flight."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.prompts: list[list[int]] = []
        self.add_times: list[float] = []
        self.in_flight = 0
        self.peak_in_flight = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(self, request_id: str | None, prompt: list[int], params: Any, **kwargs: Any) -> str:
        self.prompts.append(list(prompt))
        self.add_times.append(time.perf_counter())
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return self.engine.add_request(request_id, prompt, params, **kwargs)

    def step(self) -> list:
        outputs = self.engine.step()
        self.in_flight -= sum(out.finished for out in outputs)
        return outputs


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineArgs(max_num_seqs=8))


@pytest.mark.parametrize(
    ("kwargs", "fields", "message"),
    [
        (dict(num_prompts=0), ("num_prompts",), r"num_prompts=0 must be an integer in \[1, 1048576\]"),
        (dict(num_prompts=-3), ("num_prompts",), r"num_prompts=-3 must be"),
        (dict(num_prompts=2**20 + 1), ("num_prompts",), r"num_prompts=1048577 must be"),
        (dict(input_len=0), ("input_len",), r"input_len=0 must be an integer in \[1, "),
        (dict(output_len=0), ("output_len",), r"output_len=0 must be an integer in \[1, "),
        (dict(output_len=2.0), ("output_len",), r"output_len=2.0 must be an integer"),
        (dict(seed=-1), ("seed",), r"seed=-1 must be an integer in \[0, "),
        (dict(num_warmup=-1), ("num_warmup",), r"num_warmup=-1 must be an integer in \[0, 1048576\]"),
        (dict(request_rate=0.0), ("request_rate",), r"request_rate=0.0 must be > 0 requests/s \(inf = all at once\)"),
        (dict(request_rate=-2.0), ("request_rate",), r"request_rate=-2.0 must be > 0"),
        (dict(request_rate=math.nan), ("request_rate",), r"request_rate=nan must be > 0"),
        (dict(request_rate=True), ("request_rate",), r"request_rate=True must be > 0"),
        (dict(max_concurrency=0), ("max_concurrency",), r"max_concurrency=0 must be an integer in \[1, 1048576\]"),
    ],
)
def test_workload_fields_are_checked(kwargs: dict, fields: tuple[str, ...], message: str) -> None:
    with pytest.raises(InvalidBenchArgs, match=message) as caught:
        BenchWorkload(**({"num_prompts": 2, "input_len": 4, "output_len": 4} | kwargs))
    assert caught.value.fields == fields


def test_a_request_must_fit_max_model_len() -> None:
    BenchWorkload(1, 10, 6).check_fits(16)
    with pytest.raises(InvalidBenchArgs, match=r"input_len \+ output_len = 10 \+ 7 must be <= the engine's "
                                               r"max_model_len=16") as caught:
        BenchWorkload(1, 10, 7).check_fits(16)
    assert caught.value.fields == ("input_len", "output_len")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-prompts", "-3"], "argument --num-prompts: num_prompts=-3 must be an integer in [1, 1048576]"),
        (["--input-len", "0"], "argument --input-len: input_len=0 must be an integer in [1, 2147483647]"),
        (["--output-len", "0"], "argument --output-len: output_len=0 must be an integer in [1, 2147483647]"),
        (["--request-rate", "0"], "argument --request-rate: request_rate=0.0 must be > 0 requests/s"),
        (["--request-rate", "nan"], "argument --request-rate: request_rate=nan must be > 0 requests/s"),
        (["--max-concurrency", "0"], "argument --max-concurrency: max_concurrency=0 must be an integer in [1, "),
        (["--num-warmup", "-1"], "argument --num-warmup: num_warmup=-1 must be an integer in [0, 1048576]"),
        (["--num-prompts", "many"], "argument --num-prompts: invalid int value: 'many'"),
        (["--output-json", "/nonexistent/r.json"], "argument --output-json: folder '/nonexistent' does not exist"),
    ],
)
def test_bad_bench_flags_exit_2_before_loading(capsys: pytest.CaptureFixture[str], argv: list[str],
                                               message: str) -> None:
    assert main(["bench", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "loaded" not in captured.err
    assert captured.err.splitlines()[-1].startswith(f"deepinfer bench: error: {message}")


def test_arrivals_are_a_seeded_poisson_process() -> None:
    assert arrival_offsets(4, math.inf, random.Random(0)) == [0.0] * 4
    offsets = arrival_offsets(2001, 10.0, random.Random(5))
    assert offsets == arrival_offsets(2001, 10.0, random.Random(5))
    assert offsets[0] == 0.0 and all(b > a for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1] / 2000 == pytest.approx(0.1, rel=0.1)          # mean gap 1 / rate


def test_requests_depend_on_the_seed_only() -> None:
    base = BenchWorkload(3, 5, 2, seed=4).requests(vocab_size=100)
    assert BenchWorkload(3, 5, 2, seed=4, num_warmup=2).requests(100).prompts == base.prompts
    assert BenchWorkload(3, 5, 2, seed=5).requests(100).prompts != base.prompts
    warmup = BenchWorkload(3, 5, 2, seed=4, num_warmup=2).requests(100).warmup_prompts
    assert len(warmup) == 2 and not set(map(tuple, warmup)) & set(map(tuple, base.prompts))
    assert all(len(p) == 5 and all(0 <= t < 100 for t in p) for p in base.prompts + warmup)


def test_metrics_of_known_traces() -> None:
    traces = [RequestTrace(0.0, (1.0, 1.5, 2.5), "length"),     # TTFT 1, TPOT 0.75, ITL 0.5, 1
              RequestTrace(1.0, (1.25, 1.5), "length"),         # TTFT 0.25, TPOT 0.25, ITL 0.25
              RequestTrace(2.0, (4.0,), "stop")]                # TTFT 2
    assert bench_metrics(traces, elapsed=5.0, input_len=10, decode_steps=[0.002, 0.004, 0.003]) == {
        "elapsed_s": 5.0, "num_completed": 3, "finish_reasons": {"length": 2, "stop": 1},
        "request_throughput": 0.6, "output_tokens_per_s": 1.2, "total_tokens_per_s": 7.2, "num_decode_steps": 3,
        "mean_ttft_ms": 1083.333, "p50_ttft_ms": 1000.0, "p90_ttft_ms": 1800.0, "p99_ttft_ms": 1980.0,
        "mean_tpot_ms": 500.0, "p50_tpot_ms": 500.0, "p90_tpot_ms": 700.0, "p99_tpot_ms": 745.0,
        "mean_itl_ms": 583.333, "p50_itl_ms": 500.0, "p90_itl_ms": 900.0, "p99_itl_ms": 990.0,
        "mean_decode_step_ms": 3.0, "p50_decode_step_ms": 3.0, "p90_decode_step_ms": 3.8, "p99_decode_step_ms": 3.98,
    }
    one_token = bench_metrics([RequestTrace(0.0, (0.5,), "length")], elapsed=1.0, input_len=1)
    assert one_token["p99_tpot_ms"] is None and one_token["mean_itl_ms"] is None
    assert one_token["num_decode_steps"] == 0 and one_token["mean_decode_step_ms"] is None
    assert one_token["p50_ttft_ms"] == 500.0
    with pytest.raises(ValueError, match="elapsed=0.0 must be > 0 seconds"):
        bench_metrics(traces, elapsed=0.0, input_len=10)


def test_run_bench_warms_up_then_times_every_request(engine: LLMEngine) -> None:
    spy = _SpyEngine(engine)
    result = run_bench(spy, 4, 6, 3, seed=1, num_warmup=2)  # type: ignore[arg-type]
    workload = BenchWorkload(4, 6, 3, seed=1, num_warmup=2).requests(engine.model.cfg.vocab_size)
    assert spy.prompts == workload.warmup_prompts + workload.prompts
    assert result["num_completed"] == 4 and result["finish_reasons"] == {"length": 4}
    assert (result["num_prompts"], result["num_warmup"], result["request_rate"], result["max_concurrency"]) == \
        (4, 2, "inf", None)
    assert result["output_tokens_per_s"] * result["elapsed_s"] == pytest.approx(12, rel=0.01)
    for metric in ("ttft", "tpot", "itl"):
        values = [result[f"{key}_{metric}_ms"] for key in ("p50", "p90", "p99")]
        assert 0 < values[0] <= values[1] <= values[2]
    json.dumps(result, allow_nan=False)


def test_max_concurrency_bounds_the_requests_in_the_engine(engine: LLMEngine) -> None:
    capped, free = _SpyEngine(engine), _SpyEngine(engine)
    assert run_bench(capped, 5, 4, 2, max_concurrency=2)["num_completed"] == 5  # type: ignore[arg-type]
    run_bench(free, 5, 4, 2)  # type: ignore[arg-type]
    assert (capped.peak_in_flight, free.peak_in_flight) == (2, 5)


def test_requests_arrive_at_their_offsets(engine: LLMEngine) -> None:
    spy = _SpyEngine(engine)
    result = run_bench(spy, 4, 4, 2, seed=3, request_rate=10.0)  # type: ignore[arg-type]
    offsets = BenchWorkload(4, 4, 2, seed=3, request_rate=10.0).requests(engine.model.cfg.vocab_size).arrival_offsets
    assert min(b - a for a, b in zip(offsets, offsets[1:])) > 0.05     # gaps well above the slack below
    assert result["elapsed_s"] >= offsets[-1] and result["request_rate"] == 10.0
    for added, offset in zip(spy.add_times, offsets):
        assert added - spy.add_times[0] >= offset - 0.02          # never sent before its arrival


def test_run_bench_checks_its_arguments(engine: LLMEngine) -> None:
    with pytest.raises(InvalidBenchArgs, match="num_prompts=-3"):
        run_bench(engine, -3, 4, 4)
    with pytest.raises(InvalidBenchArgs, match=f"must be <= the engine's max_model_len={engine.max_model_len}"):
        run_bench(engine, 1, engine.max_model_len, 1)


def test_bench_command_prints_and_writes_the_result(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    assert main(["bench", "--num-prompts", "3", "--input-len", "4", "--output-len", "3", "--num-warmup", "1",
                 "--max-concurrency", "2", "--request-rate", "200", "--max-num-seqs", "4",
                 "--output-json", str(path)]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert json.loads(path.read_text()) == result
    assert (result["num_prompts"], result["num_completed"], result["max_concurrency"], result["dtype"]) == \
        (3, 3, 2, "float32")
    err_lines = [line for line in captured.err.splitlines() if line and not line.startswith("Loading weights")]
    assert err_lines[0].startswith("loaded ") and "3/3" in captured.err     # load line, then the progress bar


def test_bench_command_checks_lengths_against_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--max-model-len", "16", "--input-len", "10", "--output-len", "7"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "deepinfer bench: error: argument --input-len/--output-len: input_len + output_len = 10 + 7 must be <= the "
        "engine's max_model_len=16 (see --max-model-len)")
