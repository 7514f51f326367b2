"""Host time of one steady-state decode step of `LLMEngine` (issue #17), without the model forward.

    .venv/bin/python benchmarks/engine_host_step.py [--num-seqs 32 256 1024] [--steps 100] [--repeats 5]
    .venv/bin/python benchmarks/engine_host_step.py --emulate-graphs --num-speculative-tokens 5 [--num-seqs 1 16 64]

The engine is built on the embedded model (bf16, CPU) with max_num_seqs and num_kv_blocks large
enough for N running requests, then its model forward is replaced by a stand-in that returns
ready-made float32 logits of the right shape ([rows asked for, vocab_size], one fixed random tensor)
without computing anything: only the host work of `engine.step()` is timed (schedule, the cache ops
and the model batch, the sampling batch, post-processing and the outputs). The N greedy requests
(ignore_eos, prompts of --prompt-len tokens, so the decode block tables are about prompt_len /
block_size wide: 64 blocks with the defaults) are prefilled and brought into steady decode before
timing starts.

Phases, timed with time.perf_counter around the engine's calls (the methods are wrapped):
  schedule   `Scheduler.schedule()` (the step-kind vote included)
  prepare    `ModelRunner.apply_cache_ops` + `ModelRunner.prepare` (the step's input tensors)
  sampling   `SamplingStage.launch` + `SamplingStage.collect`: row parameters, the sampling batch,
             the sampler and reading its tokens back; `sampler math` is the Sampler call
             alone (tensor work that runs on the device in a GPU engine: logsumexp + argmax over
             [N, 4096] on this CPU), reported separately so the pure host part is visible
  post       `PlainStep._post_process` (stop checks, detokenization, handing tokens back; on an
             engine before the Step protocol, `LLMEngine._post_process`)
  outputs    the rest of `step()`: building the RequestOutputs of the changed requests
The sampler math is in the total; "host" = total − sampler math − forward stand-in.

--emulate-graphs runs the CUDA-graph code paths (`DEEPINFER_EMULATE_CUDA_GRAPHS`: `CpuGraph` stand-ins
of the decode / verify graphs, the real staging): the graphs are captured on the real model, then each
replay runs the stand-in model; the replay is the "forward" taken out of "host".
--num-speculative-tokens K builds a speculative engine (the embedded model's DSpark head, varlen on)
whose varlen policy keeps every row plain (issue #31: a speculative engine's step where no row drafts):
the policy's start-up curves are faked, for this process only, to a verify forward whose every query
token costs as much as a whole step, under which drafting cannot pay (`VarlenVerifyPolicy.plain_only`);
"post" is then `PlainStep._post_process` or `SpeculativeDecoder._commit`, whichever the step ran.

--clock thread times the CPU time of the stepping thread instead of wall time: on a shared machine it
leaves out the time other processes hold the core (the sampler math then counts only this thread's
share of torch's work; the host phases are this thread's own Python and numpy work).

Each repeat times --steps consecutive steps of one engine (after --warmup untimed ones) and keeps
the per-step median and p90; the table shows the median over repeats of those numbers, because the
machine may be shared and noisy. Python's garbage collector stays on, as in a real engine.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from deepinfer.engine import EngineArgs, LLMEngine, OutputKind, SamplingParams
from deepinfer.engine.config.env import EngineEnv
from deepinfer.engine.speculative.spec_dummy import DummySpecSteps
from deepinfer.sched import StepKind

PHASES = ("schedule", "prepare", "sampling", "sampler math", "post", "outputs")


class StandInModel:
    """Returns slices of one ready-made logits tensor: [len(batch.logits_indices), vocab_size] float32."""

    def __init__(self, vocab_size: int, max_rows: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.logits = torch.randn(max_rows, vocab_size, generator=generator)

    def __call__(self, batch, cache, ops) -> torch.Tensor:
        return self.logits[: batch.logits_indices.shape[0]]


class PhaseClock:
    """Accumulates time per phase within one step (`now`: time.perf_counter or time.thread_time)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn: Callable) -> Callable:
        now = self.now

        def timed(*args, **kwargs):
            start = now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += now() - start
        return timed

    def take(self) -> dict[str, float]:
        taken, self.current = dict(self.current), defaultdict(float)
        return taken


# Start-up curves under which drafting never pays (`--num-speculative-tokens`): each verify token costs a
# whole step, the draft walk more; the measurement itself is skipped.
NEVER_PAYS = {"verify_forward": lambda tokens: 10.0 * tokens, "draft_walk": lambda rows: 50.0 * rows,
              "verification": lambda rows: 1.0}


def build_engine(num_seqs: int, prompt_len: int, block_size: int, max_decode_tokens: int,
                 num_speculative_tokens: int = 0, emulate_graphs: bool = False) -> LLMEngine:
    k = num_speculative_tokens
    blocks_per_seq = -(-(prompt_len + max_decode_tokens + 8 + 3 * k) // block_size)
    args = EngineArgs(
        model=None, device="cpu", dtype="bfloat16", seed=0, block_size=block_size,
        max_model_len=prompt_len + max_decode_tokens + 8 * block_size, max_num_seqs=num_seqs,
        num_kv_blocks=num_seqs * blocks_per_seq + 2, max_num_batched_tokens=max(8192, prompt_len),
        max_num_prompts=num_seqs, num_speculative_tokens=k,
    )
    env = EngineEnv(emulate_cuda_graphs=emulate_graphs, varlen_profile_cache="off")
    timed = DummySpecSteps.timed
    DummySpecSteps.timed = lambda self, work: NEVER_PAYS[work.__name__]     # this process only
    try:
        engine = LLMEngine(args, env=env)
    finally:
        DummySpecSteps.timed = timed
    if engine.spec is not None and not (engine.spec.varlen is not None and engine.spec.varlen.plain_only):
        raise RuntimeError("the speculative engine's varlen policy would draft")
    stand_in = StandInModel(engine.model.cfg.vocab_size, max(num_seqs * (k + 1), 64))
    engine.runner.model = stand_in
    if engine.runner.graphs is not None:       # captured on the real model; replays run the stand-in
        engine.runner.graphs.model = stand_in
    return engine


def run_repeat(num_seqs: int, steps: int, warmup: int, prompt_len: int, block_size: int,
               output_kind: OutputKind, now: Callable[[], float] = time.perf_counter,
               num_speculative_tokens: int = 0, emulate_graphs: bool = False) -> dict[str, list[float]]:
    # Requests admitted early decode while later ones prefill: room for those steps too.
    engine = build_engine(num_seqs, prompt_len, block_size, steps + warmup + 1024, num_speculative_tokens,
                          emulate_graphs)
    rng = np.random.default_rng(num_seqs)
    vocab = engine.model.cfg.vocab_size
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + warmup + 1000)
    for index in range(num_seqs):
        engine.add_request(f"req-{index}", rng.integers(0, vocab, prompt_len).tolist(), params,
                           output_kind=output_kind)
    for _ in range(100_000):          # prefill everything, then the first decode steps
        engine.step()
        out = engine.scheduler.num_waiting
        if out == 0 and engine.scheduler.num_running == num_seqs:
            break
    clock = PhaseClock(now)
    scheduler, runner, sampling = engine.scheduler, engine.runner, engine.sampling
    schedule = scheduler.schedule
    kinds: list[StepKind] = []

    def schedule_and_note():
        out = schedule()
        kinds.append(out.kind)
        return out

    scheduler.schedule = clock.wrap("schedule", schedule_and_note)
    runner.apply_cache_ops = clock.wrap("prepare", runner.apply_cache_ops)
    runner.prepare = clock.wrap("prepare", runner.prepare)
    if runner.graphs is not None:              # the replay (the stand-in model) is the forward
        runner.graphs.replay = clock.wrap("forward", runner.graphs.replay)
    else:
        runner.forward = clock.wrap("forward", runner.forward)
        runner.verify_forward = clock.wrap("forward", runner.verify_forward)
    sampling.launch = clock.wrap("sampling", sampling.launch)
    sampling.collect = clock.wrap("sampling", sampling.collect)
    sampling.sampler = clock.wrap("sampler math", sampling.sampler)
    plain = getattr(engine, "plain_step", engine)      # engines before the Step protocol: the engine's own
    plain._post_process = clock.wrap("post", plain._post_process)
    if getattr(engine, "spec", None) is not None:
        engine.spec._commit = clock.wrap("post", engine.spec._commit)
    times: dict[str, list[float]] = defaultdict(list)
    for step in range(warmup + steps):
        kinds.clear()
        start = now()
        outputs = engine.step()
        total = now() - start
        phases = clock.take()
        # Under ZOS the first decode step reports nothing (its tokens are read by the next step).
        expected = 0 if output_kind is OutputKind.FINAL_ONLY or step == 0 else num_seqs
        if kinds != [StepKind.DECODE] or len(outputs) != expected:
            raise RuntimeError(f"step {step} is not a steady decode step of {num_seqs} sequences: {kinds}, "
                               f"{len(outputs)} outputs")
        if step < warmup:
            continue
        phases["outputs"] = total - sum(phases[p] for p in ("schedule", "prepare", "sampling", "post", "forward"))
        times["total"].append(total)
        times["host"].append(total - phases["sampler math"] - phases.get("forward", 0.0))
        for phase in PHASES:
            times[phase].append(phases[phase])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--output-kind", choices=[k.value for k in OutputKind], default="cumulative",
                        help="the requests' OutputKind (LLM.generate uses final_only, a server delta)")
    parser.add_argument("--num-speculative-tokens", type=int, default=0,
                        help="> 0: a speculative engine whose varlen policy keeps every row plain (module docstring)")
    parser.add_argument("--emulate-graphs", action="store_true",
                        help="run the CUDA-graph code paths with CpuGraph stand-ins (module docstring)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="wall: time.perf_counter; thread: CPU time of the stepping thread (time.thread_time), "
                             "which leaves out the time other processes of a shared machine hold the core")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; steps={args.steps} warmup={args.warmup} repeats={args.repeats} prompt_len={args.prompt_len} "
          f"block_size={args.block_size} output_kind={args.output_kind} clock={args.clock} "
          f"num_speculative_tokens={args.num_speculative_tokens} emulate_graphs={args.emulate_graphs}")
    columns = ("total", "host", *PHASES)
    print("| N | " + " | ".join(f"{c} ms" for c in columns) + " | total p90 ms |")
    print("|---:|" + "---:|" * (len(columns) + 1))
    for num_seqs in args.num_seqs:
        medians: dict[str, list[float]] = defaultdict(list)
        now = time.thread_time if args.clock == "thread" else time.perf_counter
        for _ in range(args.repeats):
            times = run_repeat(num_seqs, args.steps, args.warmup, args.prompt_len, args.block_size,
                               OutputKind(args.output_kind), now, args.num_speculative_tokens, args.emulate_graphs)
            for name, values in times.items():
                medians[name].append(statistics.median(values))
            medians["p90"].append(float(np.percentile(times["total"], 90)))
        cells = [f"{1e3 * statistics.median(medians[c]):.3f}" for c in (*columns, "p90")]
        print(f"| {num_seqs} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
