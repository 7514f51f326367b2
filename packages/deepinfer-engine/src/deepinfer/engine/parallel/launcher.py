"""Starting the DP ranks: spawned from `LLM` (one process per rank), or this process under torchrun.

Spawned: the caller's process is the front. It starts `data_parallel_size` processes with
torch.multiprocessing's "spawn" method, each running `rank_main`, rendezvous on a free local TCP port.
Each `generate` call goes to every rank's inbox (the ranks run it SPMD, `DPRank.generate`); rank 0
sends back the outputs. While it waits the front watches the processes: when one exits, the others
are given `distributed_timeout_s` to fail on their own (their collectives break or time out), are
then terminated, and `RankFailure` names the rank that died first and what each rank reported.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from ..config.engine_args import EngineArgs, InvalidEngineArgs
from ..config.env import TorchrunEnv
from ..core.intake import PromptInput
from ..core.outputs import RequestOutput
from ..core.stats import RebalanceStats
from ..sampling.sampling_params import SamplingParams
from .rank import DPRank, RankFailure, RankSpec

_POLL_S = 0.05


def rank_main(spec: RankSpec, args: EngineArgs, inbox: Any, outbox: Any) -> None:
    """The entry point of a spawned rank: build the rank, then serve ("generate", prompts, params)
    messages until ("stop",). Errors go to `outbox` as ("error", rank, text) and exit the process.
    The host's cores are shared out among the ranks (torch's intra-op threads), as torchrun does."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    try:
        rank = DPRank(args, spec)
        outbox.put(("ready", spec.rank))
        while (message := inbox.get())[0] == "generate":
            try:
                outputs = rank.generate(message[1], message[2])
            except ValueError as err:      # a bad prompt: every rank checked every prompt, none ran
                if spec.rank == 0:
                    outbox.put(("invalid", 0, str(err)))
                continue
            if spec.rank == 0:
                outbox.put(("result", 0, outputs, rank.rebalances))
        rank.close()
    except BaseException as err:        # reported to the front, then the process exits
        detail = "".join(traceback.format_exception_only(type(err), err)).strip()
        outbox.put(("error", spec.rank, detail))
        raise SystemExit(1) from None


def start_ranks(args: EngineArgs, torchrun: TorchrunEnv | None) -> SpawnedRanks | DPRank:
    """The DP ranks of `args`: under torchrun (`torchrun` not None) this process is rank RANK and
    rendezvous through MASTER_ADDR / MASTER_PORT; otherwise the ranks are spawned.

    Raises:
        InvalidEngineArgs: torchrun's WORLD_SIZE differs from data_parallel_size.
        RankFailure: a rank could not start.
    """
    if torchrun is None:
        return SpawnedRanks(args)
    if torchrun.world_size != args.data_parallel_size:
        raise InvalidEngineArgs(f"data_parallel_size={args.data_parallel_size} must equal torchrun's WORLD_SIZE="
                                f"{torchrun.world_size}", "data_parallel_size")
    spec = RankSpec(torchrun.rank, torchrun.world_size, f"tcp://{torchrun.master_addr}:{torchrun.master_port}")
    return DPRank(args, spec)


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (the rendezvous of spawned ranks)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SpawnedRanks:
    """`data_parallel_size` rank processes driven from this process.

    Raises:
        RankFailure: a rank failed to start (its error in the message).
    """

    def __init__(self, args: EngineArgs) -> None:
        ctx = mp.get_context("spawn")
        self._timeout_s = args.distributed_timeout_s
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(args.data_parallel_size)]
        self._procs = [ctx.Process(target=rank_main, name=f"deepinfer-dp-rank-{rank}", daemon=True,
                                   args=(RankSpec(rank, args.data_parallel_size, init_method), args, inbox,
                                         self._outbox))
                       for rank, inbox in enumerate(self._inboxes)]
        for proc in self._procs:
            proc.start()
        ready = 0
        while ready < len(self._procs):
            ready += self._receive("ready") is not None
        self.rebalances: tuple[RebalanceStats, ...] = ()

    @property
    def pids(self) -> tuple[int, ...]:
        """The rank processes' ids, by rank."""
        return tuple(proc.pid for proc in self._procs)

    def generate(self, prompts: Sequence[PromptInput], params: Sequence[SamplingParams]) -> list[RequestOutput]:
        """`DPRank.generate` on every rank; the outputs in prompt order.

        Raises:
            ValueError: a bad prompt or request (nothing ran; the ranks go on serving).
            RankFailure: a rank died or reported an error (then every rank is stopped).
        """
        for inbox in self._inboxes:
            inbox.put(("generate", list(prompts), list(params)))
        message = None
        while message is None:
            message = self._receive("result")
        outputs, self.rebalances = message[2], message[3]
        return outputs

    def _receive(self, kind: str) -> tuple | None:
        """The next message of `kind` from the ranks, or None after a poll interval; raises on a
        rank's error or death."""
        try:
            message = self._outbox.get(timeout=_POLL_S)
        except queue.Empty:
            if not all(proc.is_alive() for proc in self._procs):
                self._fail({})
            return None
        if message[0] == "error":
            self._fail({message[1]: message[2]})
        if message[0] == "invalid":
            raise ValueError(message[2])
        return message if message[0] == kind else None

    def _fail(self, errors: dict[int, str]) -> None:
        """Give the other ranks the timeout to fail on their own, stop the rest, raise RankFailure
        naming the ranks that died without a word, then what each failing rank reported."""
        deadline = time.monotonic() + self._timeout_s
        while any(proc.is_alive() for proc in self._procs) and time.monotonic() < deadline:
            try:
                message = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if message[0] == "error":
                errors.setdefault(message[1], message[2])
        stopped = [rank for rank, proc in enumerate(self._procs) if proc.is_alive()]
        self.close()
        parts = [f"DP rank {rank} exited with code {proc.exitcode}" for rank, proc in enumerate(self._procs)
                 if rank not in errors and rank not in stopped]
        parts += [f"rank {rank}: {text}" for rank, text in sorted(errors.items())]
        if stopped:
            parts.append(f"ranks {stopped} still running after {self._timeout_s} s were stopped")
        raise RankFailure("; ".join(parts))

    def close(self) -> None:
        """Stop every rank (politely, then by force after the timeout)."""
        for inbox, proc in zip(self._inboxes, self._procs):
            if proc.is_alive():
                inbox.put(("stop",))
        deadline = time.monotonic() + self._timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join()
