"""The DSpark draft walk of a speculative decode step over static buffers, one CUDA graph per size.

A speculative decode step drafts for its m drafting rows (docs/spec.md): the anchor of each row (its
last token: known on the host, or, under ZOS, `ModelRunner.row_tokens` of the step in flight) and its
place (moved back by the positions the step in flight did not use), then `DSparkDraft.propose` — the
parallel draft forward over [anchor, noise × (k − 1)], the Markov walk with `DraftSampler` and the
confidence head. `DraftGraphs` runs all of it from one static input buffer (`stage`), for a padded
row count keyed like the verify forward's graphs (`deepinfer.spec.cuda_graph_key`, here of the
drafting rows), and leaves the results in static outputs:

- on CUDA (bfloat16, `capture=True`) every size is captured as one CUDA graph, so the walk is one
  graph launch with no host synchronisation (`ModelRunner`'s verify forward is the step's other one);
- elsewhere (the CPU, float32, `enforce_eager`) `replay` runs the same function eagerly on the same
  static buffers, padding included, so the CPU tests cover the code the graphs capture.

Where the step's rows all draft, the walk also writes the verify forward's inputs: each row's fed
tokens (anchor, drafts) and their positions into the runner's flat `fed_tokens` / `fed_positions`
(on CUDA the verify graphs' static token ids and positions), at the places the host laid out
(`FIRST`, `QUERY_LEN`), so nothing runs between the two replays. Padding rows (size − m of them)
draft from token 0 at position 0 of the dummy state slot 0, whose ring rows nothing reads. The
target-layer capture that fills the rings runs inside the verify forward (`DSparkDraft.write_context`,
called by the model's forward), so it is in that graph.

The graphs read the runner's per-row buffers (`row_tokens`, `row_emitted`) where they were at
capture; `ModelRunner.ensure_rows` is asked for `row_capacity` rows first, and should the scheduler
ever hand out a row beyond them (the buffers then move), `replay` runs the walk eagerly instead of
replaying a graph that would read the old buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from deepinfer.model import DSparkDraft
from deepinfer.spec import DraftSampler, cuda_graph_key, cuda_graph_sizes

from ..core.cuda_graphs import CpuGraph, capture_graph, copy_into
from ..core.model_runner import ModelRunner

# Rows of `DraftGraphs.inputs`, per drafting row: the anchor token as the host knows it (any value
# where in flight), the scheduler row, the anchor's position if nothing is in flight, the output
# tokens counted on the host, the state slot, 1 if a step of the row is in flight, the draft seed;
# then where its tokens go in the verify forward's flat inputs: the index of its first token and how
# many it feeds (0 = none: the caller lays the forward's inputs out itself).
ANCHOR, ROW, POSITION, OUTPUTS, SLOT, IN_FLIGHT, SEED, FIRST, QUERY_LEN = range(9)
STAGED_ROWS = 9


@dataclass(frozen=True, slots=True)
class DraftWalk:
    """The static outputs of one walk of `size` padded rows (views; the first m rows are the step's).

    Attributes:
        tokens: [size, k + 1] int64: the anchor, then the k drafts (draft j guesses position
            positions + j + 1).
        positions: [size] int64 the anchor's position (after the ZOS move).
        shift: [size] int64 positions the anchor moved back (k + 1 − emitted where in flight, else 0).
        output_positions: [size] int64 output position of the first draft.
        logits: [size, k, vocab] float32 the Markov-corrected logits each draft was drawn from.
        confidence: [size, k] float32 the confidence head's acceptance estimates.
    """

    tokens: Tensor
    positions: Tensor
    shift: Tensor
    output_positions: Tensor
    logits: Tensor
    confidence: Tensor


class DraftGraphs:
    """Static-shape draft walks for up to `max_rows` drafting rows (module docstring).

    Args:
        draft: the attached draft head.
        runner: the engine's `ModelRunner` (its cache holds the rings; its per-row buffers hold the
            tokens of steps in flight; its kernel set is the one captured).
        max_rows: the most drafting rows of a step (the engine's max_num_seqs).
        interval: `DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL`.
        capture: capture one CUDA graph per size (needs a CUDA runner, or one whose graphs are emulated:
            `CpuGraph`s then); False = run eagerly.
        row_capacity: scheduler rows the runner's per-row buffers hold before the graphs are captured.
    Raises:
        ValueError: capture=True on a non-CUDA runner, a runner without `fed_tokens`, or max_rows < 1.
    """

    def __init__(self, draft: DSparkDraft, runner: ModelRunner, *, max_rows: int, interval: int = 8,
                 capture: bool = False, row_capacity: int = 1024) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows} must be >= 1")
        device = runner.device
        self.emulated = runner.graphs is not None and runner.graphs.emulated
        if capture and device.type != "cuda" and not self.emulated:
            raise ValueError(f"draft CUDA graphs need a CUDA runner, got device {device}")
        if runner.fed_tokens is None or runner.fed_positions is None:
            raise ValueError("the runner has no verify inputs to lay out (ModelRunner(max_verify_tokens=...))")
        self._fed: tuple[Tensor, Tensor] = (runner.fed_tokens, runner.fed_positions)
        self.draft, self.runner, self.k, self.interval = draft, runner, draft.block_size, interval
        self.sizes = cuda_graph_sizes(max_rows, interval)
        size = self.sizes[-1]
        self.inputs = torch.zeros(STAGED_ROWS, size, dtype=torch.int64, device=device)
        self.temperature = torch.zeros(size, dtype=torch.float32, device=device)
        runner.ensure_rows(max(row_capacity, size))
        self._row_buffers = (runner.row_tokens, runner.row_emitted)     # what the graphs read
        self.graphs: dict[int, torch.cuda.CUDAGraph | CpuGraph] = {}
        self.outputs: dict[int, DraftWalk] = {}
        self.pool = None
        if capture:
            for s in reversed(self.sizes):        # largest first: the smaller ones reuse its pool
                self._capture(s)

    def bucket(self, num_rows: int) -> int:
        """The padded size of a walk of num_rows drafting rows.

        Raises:
            ValueError: num_rows is not in [1, the largest size].
        """
        if not 1 <= num_rows <= self.sizes[-1]:
            raise ValueError(f"a draft walk of {num_rows} rows: must be in [1, {self.sizes[-1]}]")
        return cuda_graph_key(num_rows, self.interval)

    def stage(self, host: np.ndarray, temperature: np.ndarray) -> int:
        """Copy one step's drafting rows into the static inputs (host-to-device copies only, padded
        with zeros to the walk's size); returns that size.

        Args:
            host: [STAGED_ROWS, m] int64 (rows ANCHOR … SEED above).
            temperature: [m] float32, 0 = greedy.
        """
        m = host.shape[1]
        size = self.bucket(m)
        if host.shape[0] != STAGED_ROWS or temperature.shape != (m,):
            raise ValueError(f"staged inputs {list(host.shape)} and temperature {list(temperature.shape)} must be "
                             f"[{STAGED_ROWS}, m] and [m]")
        padded = np.zeros((STAGED_ROWS, size), dtype=np.int64)
        padded[:, :m] = host
        temperatures = np.zeros(size, dtype=np.float32)
        temperatures[:m] = temperature
        for row in range(STAGED_ROWS):         # contiguous destinations: plain copies, no kernel
            copy_into(self.inputs[row, :size], padded[row])
        copy_into(self.temperature[:size], temperatures)
        return size

    def replays_graph(self, size: int) -> bool:
        """Whether `replay(size)` replays a CUDA graph: one was captured for the size, and the runner's
        per-row buffers are still those it reads."""
        captured_tokens, captured_emitted = self._row_buffers
        return (size in self.graphs and captured_tokens is self.runner.row_tokens
                and captured_emitted is self.runner.row_emitted)

    @torch.no_grad()
    def replay(self, size: int) -> DraftWalk:
        """Run the walk of the staged inputs (`stage`'s size): a graph replay where `replays_graph`,
        else the same function eagerly."""
        if self.replays_graph(size):
            self.graphs[size].replay()
            return self.outputs[size]
        return self._walk(size)

    def _walk(self, size: int) -> DraftWalk:
        """The walk over inputs[:, :size] (what the graphs capture)."""
        k, runner = self.k, self.runner
        inputs = self.inputs[:, :size]
        rows = inputs[ROW]
        flying = inputs[IN_FLIGHT] != 0
        emitted = torch.where(flying, runner.row_emitted.index_select(0, rows), 0)
        anchors = torch.where(flying, runner.row_tokens.index_select(0, rows), inputs[ANCHOR])
        shift = torch.where(flying, k + 1 - emitted, 0)
        positions = inputs[POSITION] - shift
        output_positions = inputs[OUTPUTS] + emitted
        sampler = DraftSampler(self.temperature[:size], inputs[SEED], output_positions)
        prop = self.draft.propose(anchors, positions, inputs[SLOT], runner.cache, sample=sampler, ops=runner.ops)
        tokens = torch.cat((anchors[:, None], prop.token_ids), dim=1)
        # the verify forward's inputs: token c of the row (c < its query length) at FIRST + c, the rest
        # (and padding rows) to the buffers' last entry, which no forward reads
        fed_tokens, fed_positions = self._fed
        columns = torch.arange(k + 1, device=tokens.device)[None, :]
        index = torch.where(columns < inputs[QUERY_LEN][:, None], inputs[FIRST][:, None] + columns,
                            fed_tokens.shape[0] - 1).flatten()
        fed_tokens.index_put_((index,), tokens.flatten())
        fed_positions.index_put_((index,), (positions[:, None] + columns).flatten())
        return DraftWalk(tokens, positions, shift, output_positions, prop.logits, prop.confidence)

    def _capture(self, size: int) -> None:
        graph, self.outputs[size], self.pool = capture_graph(lambda: self._walk(size), self.pool,
                                                             emulate=self.emulated)
        self.graphs[size] = graph

