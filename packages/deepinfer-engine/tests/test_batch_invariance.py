"""EngineArgs.batch_invariant end to end: one greedy request's logits, at every step, are bitwise the
same whether it runs alone or among 1, 7 or 63 other requests of other lengths (their prompts
prefilled in the same step, their tokens decoded in the same steps), on the embedded tiny model.

The logits are captured where the worker hands them to the sampler (`ModelRunner.forward`). The
control: with the flag off, some batch changes the request's logits somewhere, so the check is not
vacuous. CPU in CI; on a GPU (marked `gpu`) the same in bfloat16 with the Triton kernels, CUDA graphs
on and off (docs/batch_invariance.md has the recorded run).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from deepinfer.engine import EngineArgs, LLMEngine, SamplingParams

BATCH_SIZES = (2, 8, 64)
STEPS = 3                          # logits rows per request: the prefill's, then two decode steps
TARGET = [17, 923, 3051, 88, 402, 7, 1999, 640, 31, 2718, 1414, 77]     # the request under test
_draw = random.Random(0)
OTHERS = [[_draw.randrange(4, 4096) for _ in range(_draw.randint(3, 20))] for _ in range(max(BATCH_SIZES) - 1)]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny CPU ops on several threads spend most of their time waiting for each other (minutes on a
    busy runner); the kernel tests check the twins at several thread counts."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_engine(batch_invariant: bool, device: str = "cpu", dtype: str = "float32",
                enforce_eager: bool = True) -> LLMEngine:
    args = EngineArgs(device=device, dtype=dtype, max_num_seqs=max(BATCH_SIZES), max_model_len=128,
                      kv_cache_memory_mb=16, enforce_eager=enforce_eager, batch_invariant=batch_invariant)
    return LLMEngine(args)


class LogitsRecorder:
    """Wraps an engine's `runner.forward` and keeps, per request id, the logits rows it returned and
    the number of requests each of those steps sampled."""

    def __init__(self, engine: LLMEngine) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.step_sizes: dict[str, list[int]] = {}
        forward = engine.runner.forward

        def recording_forward(step):
            logits = forward(step)
            for row, seq_id in enumerate(step.sample_seq_ids):
                # A device copy: a host read here would trip the ZOS sync guard around a graph replay.
                self.rows.setdefault(seq_id, []).append(logits[row].detach().clone())
                self.step_sizes.setdefault(seq_id, []).append(len(step.sample_seq_ids))
            return logits

        engine.runner.forward = recording_forward


_run_ids = itertools.count()


def target_logits(engine: LLMEngine, recorder: LogitsRecorder, batch_size: int) -> tuple[list[torch.Tensor], int]:
    """Run TARGET with batch_size − 1 others (greedy, STEPS tokens each) to completion; returns the
    target's logits rows and the largest step it shared."""
    run = next(_run_ids)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    target_id = engine.add_request(f"{run}-target", TARGET, params)
    for i, prompt in enumerate(OTHERS[:batch_size - 1]):
        engine.add_request(f"{run}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    rows = recorder.rows.pop(target_id)
    # Under ZOS the step launched before the last token was seen runs too (its token is dropped).
    assert len(rows) in (STEPS, STEPS + 1)
    return rows[:STEPS], max(recorder.step_sizes.pop(target_id)[:STEPS])


def check_invariance(device: str, dtype: str, enforce_eager: bool) -> None:
    engine = make_engine(True, device, dtype, enforce_eager)
    recorder = LogitsRecorder(engine)
    alone, shared = target_logits(engine, recorder, 1)
    assert shared == 1
    for batch_size in BATCH_SIZES:
        rows, shared = target_logits(engine, recorder, batch_size)
        assert shared == batch_size            # its prefill and decode steps really ran batched
        for step, (a, b) in enumerate(zip(alone, rows)):
            assert torch.equal(a, b), f"step {step} in a batch of {batch_size}: max |Δ| {(a - b).abs().max():.3g}"


def test_a_request_s_logits_do_not_depend_on_its_batch() -> None:
    check_invariance("cpu", "float32", enforce_eager=True)


def test_without_the_flag_the_batch_changes_the_logits() -> None:
    """The control: the default kernels (MKL GEMMs picked by row count, ...) give the same request
    other bits in some batch, though close ones."""
    engine = make_engine(False)
    recorder = LogitsRecorder(engine)
    alone, _ = target_logits(engine, recorder, 1)
    differs = False
    for batch_size in BATCH_SIZES:
        rows, _ = target_logits(engine, recorder, batch_size)
        for a, b in zip(alone, rows):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            differs |= not torch.equal(a, b)
    assert differs


def test_the_flag_reaches_the_model_runner() -> None:
    assert make_engine(True).runner.ops.batch_invariant
    assert not make_engine(False).runner.ops.batch_invariant


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "enforce_eager"), [("bfloat16", False), ("bfloat16", True), ("float32", True)],
                         ids=["bf16-cuda-graphs", "bf16-eager", "fp32-eager"])
def test_a_request_s_logits_do_not_depend_on_its_batch_on_the_gpu(dtype: str, enforce_eager: bool) -> None:
    check_invariance("cuda", dtype, enforce_eager)


def test_the_engine_s_sampler_samples_through_the_invariant_kernel_set(monkeypatch) -> None:
    """On CUDA the default sampler picks the reference or the Triton kernel by batch size; with the
    flag on it must ask for the invariant set, whose sampler is the same at every size."""
    import deepinfer.engine.sampling.sampler as sampler_module
    asked = []
    kernels_for = sampler_module.kernels_for

    def spy(device, batch_invariant=False):
        asked.append(batch_invariant)
        return kernels_for(device, batch_invariant=batch_invariant)

    monkeypatch.setattr(sampler_module, "kernels_for", spy)
    for flag in (True, False):
        engine = make_engine(flag)
        engine.add_request(None, TARGET, SamplingParams(temperature=0.8, seed=1, max_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        assert asked and set(asked) == {flag}
        asked.clear()
