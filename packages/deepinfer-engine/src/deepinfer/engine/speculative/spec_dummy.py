"""Speculative work over the dummy state slot 0 and block 0 (docs/design.md §7.2, §9): the start-up
measurements of the varlen policy's curves (a verify forward per graph size, the draft walk and the
verification per number of rows) and the dummy verify forward an idle lockstep rank runs while its
peers verify (`SpeculativeDecoder.idle_verify`).

Every token sits at position 0 of slot 0 with an all-zero block table: what the forwards write lands in
the reserved block and the dummy slot, as a CUDA graph's padding rows do.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from deepinfer.model import DSparkDraft
from deepinfer.sched import DecodeBatch
from deepinfer.spec import DraftSampler, VerifyInput, gather_verify_logits, verify

from ..core.model_runner import ModelRunner


class DummySpecSteps:
    """Dummy verify forwards, draft walks and verifications of a given size.

    Args:
        draft: the attached draft head (k = its block size).
        runner: the model runner (its cache, graphs and device).
    """

    def __init__(self, draft: DSparkDraft, runner: ModelRunner) -> None:
        self.draft, self.runner, self.k = draft, runner, draft.block_size

    @torch.no_grad()
    def verify_forward(self, total_q: int) -> None:
        """One verify forward of total_q dummy tokens in rows of up to k + 1: the graph replay
        `ModelRunner.verify_forward` runs for that many tokens, else the eager forward it runs."""
        runner = self.runner
        graphs = runner.graphs
        if graphs is not None and runner.verify_replays_graph(total_q):
            graphs.inputs.zero_()                   # every token: position 0 of the dummy slot 0, block 0
            graphs.block_tables.zero_()
            graphs.replay(total_q)
            return
        width = self.k + 1
        num_rows = -(-total_q // width)
        query_lens = np.full(num_rows, width, dtype=np.int32)
        query_lens[-1] = total_q - width * (num_rows - 1)
        zeros = np.zeros(num_rows, dtype=np.int32)
        d = DecodeBatch(seq_ids=tuple(map(str, range(num_rows))), rows=zeros, query_lens=query_lens,
                        seq_lens=np.full(num_rows, width, dtype=np.int32), block_tables=zeros[:, None],
                        state_slots=zeros, last_token_ids=zeros, table_versions=zeros.astype(np.int64),
                        in_flight=np.zeros(num_rows, dtype=np.bool_), rows_generation=0)
        runner.verify_forward(d, torch.zeros((num_rows, width), dtype=torch.int64, device=runner.device))

    @torch.no_grad()
    def draft_walk(self, num_rows: int) -> None:
        """`DSparkDraft.propose` for num_rows greedy rows anchored at position 0 of slot 0."""
        device = self.runner.device
        zeros = torch.zeros(num_rows, dtype=torch.int64, device=device)
        sampler = DraftSampler(torch.zeros(num_rows, dtype=torch.float32, device=device), zeros, zeros)
        self.draft.propose(zeros, zeros, zeros, self.runner.cache, sample=sampler, ops=self.runner.ops)

    @torch.no_grad()
    def verification(self, num_rows: int) -> None:
        """`verify` of num_rows greedy rows of k drafts over seeded random logits: the work between a
        speculative step's verify forward and its copy back."""
        k, device = self.k, self.runner.device
        vocab = self.runner.model.cfg.vocab_size
        gen = torch.Generator(device=device).manual_seed(num_rows)
        logits = torch.randn((num_rows * (k + 1), vocab), generator=gen, device=device)
        query_lens = torch.full((num_rows,), k + 1, dtype=torch.int64, device=device)
        target = gather_verify_logits(logits, query_lens, k + 1)
        zeros = torch.zeros(num_rows, dtype=torch.int64, device=device)
        verify(VerifyInput(target, torch.zeros((num_rows, k), dtype=torch.int64, device=device),
                                    query_lens - 1, torch.zeros(num_rows, device=device), None, zeros, zeros))

    def timed(self, work: Callable[[int], None]) -> Callable[[int], float]:
        """`work` as a `profile_step_times` step: ms of one call (host clock around device syncs)."""
        cuda = self.runner.device.type == "cuda"

        def run(size: int) -> float:
            if cuda:
                torch.cuda.synchronize(self.runner.device)
            started = time.perf_counter()
            work(size)
            if cuda:
                torch.cuda.synchronize(self.runner.device)
            return (time.perf_counter() - started) * 1e3

        return run
