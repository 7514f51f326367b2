"""One DP rank: its process group, its `LLMEngine`, its share of the experts, and the lockstep loop.

Every rank of the group calls `DPRank.generate` with the same prompts (SPMD, as torchrun scripts do;
`launcher.SpawnedRanks` forwards each `LLM.generate` call to every rank). Each rank takes the prompts
that `assign_least_loaded` gives it, and all ranks then step together while any rank has work: every
`LLMEngine.step()` runs the scheduler's step-kind vote over the gloo group, a rank whose vote says
EMPTY_PROMPT / EMPTY_DECODE runs `run_ep_dummy_forward` of that kind so that its peers' all-to-alls
find it, and the finished outputs are gathered so that every rank returns all of them in prompt order.
Under speculative decoding with EP the ranks also agree on each decode step's verify size
(`spec_lockstep`): a rank without decode rows runs a dummy verify forward of it (`idle_verify`).

Under expert parallelism decode steps exchange fixed-capacity buffers (`deepinfer.model`'s
`moe_ep_fixed`: static shapes, no host read), so ZOS stays on. The exchange is attached before the
engine would capture its decode CUDA graphs, so they could hold it, but NCCL all-to-alls inside CUDA
graphs have not run on GPUs yet: on CUDA an EP rank decodes eagerly (`enforce_eager`) until they
have. Only the CPU path (gloo) is tested.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer.model import DeepseekV4Config, run_ep_dummy_forward
from deepinfer.sched import StepKind

from ..config.engine_args import EngineArgs
from ..core.intake import PromptInput
from ..core.outputs import OutputKind, RequestOutput
from ..core.stats import RebalanceStats
from ..frontends.core_loop import run_loop
from ..llm_engine import ExpertParallelSetup, LLMEngine, resolve_model_dir
from ..sampling.sampling_params import SamplingParams
from .dp_group import GlooStepVoteGroup
from .eplb_live import LiveBalancer, eplb_config, initial_slots

_EMPTY_STEPS = (StepKind.EMPTY_PROMPT, StepKind.EMPTY_DECODE)


class RankFailure(RuntimeError):
    """A DP rank died or stopped answering; the message names the rank."""


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Where this process sits in the DP group."""

    rank: int            # in [0, world_size)
    world_size: int      # = EngineArgs.data_parallel_size
    init_method: str     # torch.distributed rendezvous, e.g. "tcp://127.0.0.1:29500" or "env://"


def assign_least_loaded(costs: Sequence[int], world_size: int) -> list[int]:
    """The rank of each request, in order: each goes to the rank with the least work assigned so far
    (the sum of its requests' costs; ties to the lower rank)."""
    loads = [0] * world_size
    ranks = []
    for cost in costs:
        rank = loads.index(min(loads))
        loads[rank] += cost
        ranks.append(rank)
    return ranks


def _rank_args(args: EngineArgs, rank: int) -> EngineArgs:
    """The engine arguments of one rank: single-rank fields, its own GPU."""
    args = dataclasses.replace(args, data_parallel_size=1, expert_parallel=False, eplb=None,
                               eplb_redundant_experts_per_rank=None, eplb_window_steps=None,
                               eplb_interval_steps=None).resolved()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        args = dataclasses.replace(args, device=f"cuda:{rank % torch.cuda.device_count()}")
    return args


class DPRank:
    """Joins the DP group and builds this rank's engine.

    Args:
        args: the engine arguments (data_parallel_size = spec.world_size >= 2).
        spec: this process's rank and the rendezvous.

    Raises:
        ValueError: spec.world_size differs from args.data_parallel_size.
        RankFailure: the group could not be formed within args.distributed_timeout_s.
    """

    def __init__(self, args: EngineArgs, spec: RankSpec) -> None:
        if spec.world_size != args.data_parallel_size:
            raise ValueError(f"the launch has {spec.world_size} ranks but data_parallel_size="
                             f"{args.data_parallel_size}")
        self.spec = spec
        self._timeout_s = args.distributed_timeout_s
        engine_args = _rank_args(args, spec.rank)
        on_cuda = torch.device(engine_args.device).type == "cuda"
        if on_cuda:      # kernels launch, events record and NCCL binds on the current device: this rank's GPU
            torch.cuda.set_device(torch.device(engine_args.device))
        if args.expert_parallel and on_cuda:
            # The decode graphs could capture the fixed-capacity exchange, but NCCL all-to-alls inside
            # them have not run on GPUs yet: EP decode steps run eagerly there (ZOS stays on).
            engine_args = dataclasses.replace(engine_args, enforce_eager=True)
        timeout = timedelta(seconds=args.distributed_timeout_s)
        try:
            dist.init_process_group("cpu:gloo,cuda:nccl" if on_cuda else "gloo", init_method=spec.init_method,
                                    rank=spec.rank, world_size=spec.world_size, timeout=timeout)
        except RuntimeError as err:
            raise RankFailure(f"DP rank {spec.rank}: could not join the group of {spec.world_size}: {err}") from err
        vote_group = GlooStepVoteGroup.new_group(timeout_s=args.distributed_timeout_s)
        if vote_group is None:          # not on a group of every rank
            raise RankFailure(f"DP rank {spec.rank} is outside the vote group of all {spec.world_size} ranks")
        self.vote_group = vote_group
        self.balancer: LiveBalancer | None = None
        self.expert_parallel = args.expert_parallel
        if not args.expert_parallel:
            self.engine = LLMEngine(engine_args, vote_group=self.vote_group)
            return
        # The placement comes first, so that the rank loads its own experts only (every V4 layer is
        # MoE), and the engine attaches the exchange before it captures its decode graphs.
        cfg = DeepseekV4Config.from_model_dir(resolve_model_dir(engine_args.model))
        ep_size = spec.world_size
        config = eplb_config(args, ep_size) if args.eplb is not None else None
        slots = initial_slots(cfg.num_hidden_layers, cfg.n_routed_experts, ep_size, config)
        ep_group = dist.new_group(backend="nccl" if on_cuda else "gloo", timeout=timeout)
        self.engine = LLMEngine(engine_args, vote_group=self.vote_group,
                                expert_parallel=ExpertParallelSetup(ep_group, spec.rank, tuple(slots)))
        if config is not None:
            self.balancer = LiveBalancer(self.engine.model, config, ep_size, self.vote_group.process_group)

    @property
    def rebalances(self) -> tuple[RebalanceStats, ...]:
        """The re-placements adopted so far (empty without EPLB)."""
        return () if self.balancer is None else self.balancer.rebalances

    def generate(self, prompts: Sequence[PromptInput], params: Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run this rank's share of `prompts` in lockstep with its peers; every rank calls it with the
        same arguments and gets every output, in prompt order.

        Raises:
            ValueError: a bad prompt or request (checked on every rank before anything runs).
            RankFailure: a peer died or stopped answering.
        """
        engine = self.engine
        prepared = [engine.prepare_request(None, prompt, p, output_kind=OutputKind.FINAL_ONLY)
                    for prompt, p in zip(prompts, params)]     # every rank checks every prompt: all or none run
        costs = [req.num_prompt_tokens + (p.max_tokens or engine.max_model_len) for req, p in zip(prepared, params)]
        owners = assign_least_loaded(costs, self.spec.world_size)
        index_of = {req.request_id: index for index, (req, owner) in enumerate(zip(prepared, owners))
                    if owner == self.spec.rank}
        for req, owner in zip(prepared, owners):
            if owner == self.spec.rank:
                engine.enqueue(req)
        batch = _LockstepBatch(self, index_of)
        gathered: list[dict[int, RequestOutput] | None] = [None] * self.spec.world_size
        try:
            run_loop(self.step, batch)
            dist.all_gather_object(gathered, batch.finished, group=self.vote_group.process_group)
        except RuntimeError as err:
            raise RankFailure(f"DP rank {self.spec.rank}: a peer rank died or did not answer within "
                              f"{self._timeout_s} s: {err}") from err
        merged = {index: out for part in gathered for index, out in (part or {}).items()}
        return [merged[index] for index in range(len(prepared))]

    def step(self) -> list[RequestOutput]:
        """One engine step on this rank (every rank calls it as often): a dummy forward when the vote
        left this rank without work, then the step's expert counts to the balancer."""
        outputs = self.engine.step()
        kind = self.engine.last_step_kind
        spec = self.engine.spec
        if self.expert_parallel and kind is StepKind.EMPTY_DECODE and spec is not None:
            spec.idle_verify()          # the peers' verify size, agreed after the vote, as a dummy forward
        elif self.expert_parallel and kind in _EMPTY_STEPS:
            run_ep_dummy_forward(self.engine.model, self.engine.runner.ops, decode_step=kind is StepKind.EMPTY_DECODE)
        if self.balancer is not None and kind is not None and kind is not StepKind.IDLE:
            self.balancer.after_forward()
        return outputs

    def close(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()


class _LockstepBatch:
    """The `core_loop.Transport` of one `DPRank.generate` call: the rank's share of the prompts is
    queued up front; every rank steps while any has work (the vote), and keeps its finished outputs
    by prompt index."""

    def __init__(self, rank: DPRank, index_of: dict[str, int]) -> None:
        self._rank, self._index_of = rank, index_of
        self.finished: dict[int, RequestOutput] = {}

    def poll(self) -> None:
        """Nothing arrives during a call."""

    def has_work(self) -> bool:
        return self._rank.vote_group.any_true(self._rank.engine.has_unfinished_requests())

    def deliver(self, outputs: list[RequestOutput]) -> None:
        index_of = self._index_of
        for out in outputs:
            if out.finished and out.request_id in index_of:
                self.finished[index_of[out.request_id]] = out

    def idle(self) -> bool:
        return False            # no rank has work left: the call is done
