"""Greedy verification of a speculative decode step in graphs keyed by the step's total query tokens.

After the verify forward (`ModelRunner.verify_forward_static`: one CUDA graph replay of T tokens), a
step whose rows all draft greedily needs only `deepinfer.spec.greedy_verify_flat` over the forward's
own logits, then each row's last token and count in the runner's per-row buffers for the next step
(`ModelRunner.record_emitted`) and one results block for the host. `VerifyTails` captures that as
one more CUDA graph per verify size T, reading the forward graph's logits of the same size where they
are; on the CPU (or without graphs) `replay` runs the same function eagerly on the same static
buffers, with the eager forward's logits. Rows that sample, follow a grammar or want logprobs are
verified outside (`SpeculativeDecoder._launch_verify`).

Static inputs: per token, its row in the step and its column (padding tokens: row = `max_rows`, the
grid's extra row); per row of the step, the scheduler row whose per-row buffers take its last token
(padding rows: the buffers' last row, `dummy_row`, which no scheduler row reaches while the graphs
are used) and the drafts it verified.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from deepinfer.spec import greedy_verify_flat

from ..core.cuda_graphs import CpuGraph, capture_graph, copy_into
from ..core.model_runner import ModelRunner
from ..sampling.sampler import MAX_LOGIT_MAGNITUDE

TOKEN_ROW, COLUMN = range(2)          # rows of `VerifyTails.layout`
TARGET_ROW, NUM_DRAFTS = range(2)     # rows of `VerifyTails.row_inputs`


class VerifyTails:
    """Greedy verification + per-row bookkeeping over static buffers (module docstring).

    Args:
        runner: the engine's `ModelRunner`: its graphs' logits (CUDA), the fed tokens (`fed_tokens`: its
            graphs' static token ids on CUDA, the buffer the eager forward reads elsewhere) and per-row
            buffers.
        k: drafts per row.
        max_rows: rows of a step at most (max_num_seqs).
        capture: capture one graph per size of `runner.graphs` (needs them; `CpuGraph`s where they are
            emulated); False = eager.
    Raises:
        ValueError: a runner without `fed_tokens`, or capture=True without the runner's verify graphs.
    """

    def __init__(self, runner: ModelRunner, *, k: int, max_rows: int, capture: bool = False) -> None:
        device = runner.device
        if runner.fed_tokens is None:
            raise ValueError("the runner has no verify inputs (ModelRunner(max_verify_tokens=...))")
        self.runner, self.k, self.max_rows = runner, k, max_rows
        self._fed_tokens: Tensor = runner.fed_tokens       # the tokens the verify forward fed
        graphs = runner.graphs
        max_tokens = graphs.sizes[-1] if graphs is not None else max_rows * (k + 1)
        self.layout = torch.zeros(2, max_tokens, dtype=torch.int64, device=device)
        self.row_inputs = torch.zeros(2, max_rows, dtype=torch.int64, device=device)
        self.dummy_row = runner.row_tokens.shape[0] - 1
        self.row_inputs[TARGET_ROW].fill_(self.dummy_row)
        self._row_buffers = (runner.row_tokens, runner.row_emitted)
        self.graphs: dict[int, torch.cuda.CUDAGraph | CpuGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self.pool = None
        if capture:
            if graphs is None or (device.type != "cuda" and not graphs.emulated):
                raise ValueError("verify tail CUDA graphs need the runner's verify CUDA graphs")
            for size in reversed(graphs.sizes):
                self._capture(size)

    def usable(self, rows: np.ndarray) -> bool:
        """Whether a step of these scheduler rows can run here: at most max_rows of them, every one
        below `dummy_row`, and the runner's per-row buffers still those the tails write."""
        return len(rows) <= self.max_rows and int(rows.max()) < self.dummy_row and self._buffers_unmoved()

    def _buffers_unmoved(self) -> bool:
        tokens, emitted = self._row_buffers
        return tokens is self.runner.row_tokens and emitted is self.runner.row_emitted

    def stage(self, token_rows: np.ndarray, columns: np.ndarray, rows: np.ndarray, query_lens: np.ndarray,
              size: int) -> None:
        """Copy a step's layout into the static inputs (host-to-device copies only).

        Args:
            token_rows / columns: [total_q] int64 each token's row in the step and column.
            rows: [n] the rows' scheduler rows; query_lens: [n] their query lengths.
            size: the padded token count (the verify graph's size, or total_q when eager).
        """
        total_q, n = len(token_rows), len(rows)
        layout = np.zeros((2, size), dtype=np.int64)
        layout[TOKEN_ROW] = self.max_rows                       # padding tokens: the grid's extra row
        layout[TOKEN_ROW, :total_q] = token_rows
        layout[COLUMN, :total_q] = columns
        per_row = np.zeros((2, self.max_rows), dtype=np.int64)
        per_row[TARGET_ROW] = self.dummy_row
        per_row[TARGET_ROW, :n] = rows
        per_row[NUM_DRAFTS, :n] = query_lens - 1
        for row in range(2):                  # contiguous destinations: plain copies, no kernel
            copy_into(self.layout[row, :size], layout[row])
        copy_into(self.row_inputs, per_row)

    @torch.no_grad()
    def replay(self, size: int, logits: Tensor) -> Tensor:
        """Verify the staged step and record its rows' last tokens; returns [max_rows, k + 4] int64 (output
        ids, accepted drafts, 1 = finite logits, drafts verified) per row of the step: a graph's static
        output where captured (valid until the next replay), else computed now from `logits` [size, vocab]."""
        if size in self.graphs and self._buffers_unmoved():
            self.graphs[size].replay()
            return self.outputs[size]
        return self._tail(logits, size)

    def _tail(self, logits: Tensor, size: int) -> Tensor:
        k, runner = self.k, self.runner
        fed = self._fed_tokens[:size]
        result = greedy_verify_flat(logits.float(), fed, self.layout[TOKEN_ROW, :size], self.layout[COLUMN, :size],
                                    self.max_rows, k, MAX_LOGIT_MAGNITUDE)
        last = result.output_ids.gather(1, result.num_accepted[:, None])[:, 0]
        runner.record_emitted(self.row_inputs[TARGET_ROW], last, result.num_accepted + 1)
        return torch.cat((result.output_ids, result.num_accepted[:, None], result.finite[:, None].long(),
                          self.row_inputs[NUM_DRAFTS, :, None]), dim=1)

    def _capture(self, size: int) -> None:
        graphs = self.runner.graphs
        assert graphs is not None, "captured only over the runner's verify graphs"
        logits = graphs.outputs[size]
        graph, self.outputs[size], self.pool = capture_graph(lambda: self._tail(logits, size), self.pool,
                                                             emulate=graphs.emulated)
        self.graphs[size] = graph
