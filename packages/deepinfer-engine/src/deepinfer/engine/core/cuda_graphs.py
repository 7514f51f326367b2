"""Decode CUDA graphs keyed by the number of query tokens (docs/design.md §7.4).

Sizes 1, 2, 4, … up to `interval`, then every `interval` up to the maximum. A step of n sequences
replays the smallest graph ≥ n; padding rows feed token 0 at position 0 with an all-zero block table
and state slot 0, so whatever they write lands in the reserved block 0 / dummy slot 0.

Under expert parallelism the graphs capture each MoE layer's fixed-capacity exchange
(`ForwardBatch.decode_step`: equal-split all-to-alls, no host read; padding rows are routed and
exchanged like real ones, their results dropped); every rank captures the same sizes in the same
order, so the collectives of warm-up and capture match. Not yet run on GPUs: NCCL all-to-alls inside
these graphs are untested.

`capture_graph` captures every graph of the engine (these, the draft walks, the verify tails). With
`emulate=True` (`DEEPINFER_EMULATE_CUDA_GRAPHS`, CPU tests) it returns a `CpuGraph` instead: the same
code stages the same static inputs and reads the same static outputs, and `replay` re-runs the
captured function into them, so the graph path's staging is tested on the CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from deepinfer.kernels import KernelSet
from deepinfer.model import CausalLM, ForwardBatch, ModelCache
from deepinfer.spec import cuda_graph_key, cuda_graph_sizes

from .block_tables import RowBlockTables

Out = TypeVar("Out")
STAGED_ROWS = 4     # rows of `DecodeGraphs.inputs`: token ids, positions, state slots, scheduler rows


def graph_sizes(max_size: int, interval: int = 8) -> tuple[int, ...]:
    """1, 2, 4, … < interval, then interval, 2·interval, … up to max_size (max_size itself included)."""
    if max_size < 1 or interval < 1:
        raise ValueError(f"max_size={max_size} and interval={interval} must be >= 1")
    sizes, s = [], 1
    while s < min(interval, max_size):
        sizes.append(s)
        s *= 2
    s = interval
    while s < max_size:
        sizes.append(s)
        s += interval
    sizes.append(max_size)
    return tuple(sorted(set(sizes)))


class DecodeGraphs:
    """Captured decode forwards over static input buffers.

    Args:
        model, cache: the model and the cache its graphs read and write.
        max_seqs: largest batch; max_blocks: block-table width; max_context_len: the context bound
            every graph gathers compressed entries for (the engine's max_model_len).
        interval: `DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL`.
        ops: the kernels the graphs capture (None: the model's default for its device); the runner
            passes the batch-invariant set with `EngineArgs.batch_invariant`.
        max_query_len: 1 = one query token per sequence; k + 1 under speculative decoding: the
            graphs then run multi-token decode batches (`ForwardBatch.multi_decode`: max_seqs counts
            query tokens, one virtual sequence each) and are keyed by total query tokens through
            `deepinfer.spec.cuda_graph_key`, the function the varlen policy sizes its steps with.
        emulate: `CpuGraph`s instead of CUDA graphs (`capture_graph`; any device, for tests).
    """

    def __init__(self, model: CausalLM, cache: ModelCache, *, max_seqs: int, max_blocks: int,
                 max_context_len: int, interval: int = 8, ops: KernelSet | None = None,
                 max_query_len: int = 1, emulate: bool = False) -> None:
        device = model.embed.weight.device
        if device.type != "cuda" and not emulate:
            raise ValueError(f"CUDA graphs need a CUDA model, got device {device}")
        self.model, self.cache, self.ops, self.emulated = model, cache, ops, emulate
        self.interval, self.max_query_len = interval, max_query_len
        self.sizes = graph_sizes(max_seqs, interval) if max_query_len == 1 else cuda_graph_sizes(max_seqs, interval)
        max_seqs = self.sizes[-1]
        self.max_context_len = max_context_len
        # The static inputs: one int64 [STAGED_ROWS, max_seqs] tensor (token ids, positions, state
        # slots, and the scheduler rows the engine keys per-row state by, which the graphs do not
        # read), so a step's host inputs reach it in one copy (`stage`), plus the block tables. Verify
        # graphs get one more column, which no graph reads: the draft walk's writes that belong to no
        # token land there (`DraftGraphs`).
        extra = 1 if max_query_len > 1 else 0
        self.inputs = torch.zeros(STAGED_ROWS, max_seqs + extra, dtype=torch.int64, device=device)
        self.token_ids, self.positions, self.state_slots, self.seq_rows = self.inputs
        self.block_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        # every scheduler row's block table, brought up to date by diff; `stage` gathers a step's rows
        self.row_tables = RowBlockTables(max_blocks, device)
        self.rows = torch.arange(max_seqs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph | CpuGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self.pool = None
        for size in reversed(self.sizes):          # largest first, so smaller graphs reuse its pool
            self._capture(size)

    def forget_rows(self) -> None:
        """A new scheduler: its rows and table versions say nothing about what `row_tables` holds."""
        self.row_tables = RowBlockTables(self.row_tables.max_blocks, self.row_tables.device)

    def _batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            token_ids=self.token_ids[:size], positions=self.positions[:size],
            cu_seqlens=tuple(range(size + 1)), start_positions=(0,) * size,
            block_tables=self.block_tables[:size], state_slots=self.state_slots[:size],
            logits_indices=self.rows[:size], max_context_len=self.max_context_len, uniform_decode=True,
            max_query_len=self.max_query_len, decode_step=True,
        )

    @torch.no_grad()
    def _capture(self, size: int) -> None:
        batch = self._batch(size)
        graph, self.outputs[size], self.pool = capture_graph(lambda: self.model(batch, self.cache, self.ops),
                                                             self.pool, emulate=self.emulated)
        self.graphs[size] = graph

    def bucket(self, num_seqs: int) -> int | None:
        """The graph size a step of num_seqs sequences (query tokens, under multi-token decode) replays
        (None: larger than every graph)."""
        if self.max_query_len > 1:
            key = cuda_graph_key(num_seqs, self.interval)
            return key if key <= self.sizes[-1] else None
        return next((s for s in self.sizes if s >= num_seqs), None)

    @torch.no_grad()
    def run(self, batch: ForwardBatch) -> Tensor:
        """Replay for a uniform decode batch; returns logits [num_seqs, vocab] (a fresh tensor)."""
        n = batch.num_seqs
        size = self.bucket(n)
        if size is None or not batch.uniform_decode or batch.max_query_len > self.max_query_len:
            raise ValueError(f"no graph for a batch of {n} sequences (uniform_decode={batch.uniform_decode}, "
                             f"max_query_len={batch.max_query_len}; captured {self.max_query_len})")
        width = batch.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block tables of width {width} exceed the captured {self.block_tables.shape[1]}")
        self.token_ids[:n].copy_(batch.token_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.state_slots[:n].copy_(batch.state_slots, non_blocking=True)
        self._pad_and_copy_tables(n, size, batch.block_tables)
        self.graphs[size].replay()
        return self.outputs[size][:n].clone()

    def stage(self, inputs: Tensor, size: int | None = None) -> int:
        """Copy one step's inputs into the static buffers (asynchronously, from pinned host memory)
        and gather its block tables on the device from `row_tables`, for `replay`; returns the graph
        size the step replays.

        Args:
            inputs: [STAGED_ROWS, n] int64 on the host (pinned) or the device: token ids (-1 where the
                caller fills the token on the device afterwards), positions, state slots, scheduler rows,
                whose rows of `row_tables` the caller has brought up to date (`RowBlockTables.update`).
            size: replay this graph size, >= n (lockstep DP ranks agree on one: `replay(n, size)`);
                None = the smallest that holds n.
        Raises:
            ValueError: no graph holds n sequences (or `size` is not a captured size >= n).
        """
        n = inputs.shape[1]
        size = self.bucket(n) if size is None else size
        if size is None or size < n or size not in self.graphs or inputs.shape[0] != STAGED_ROWS:
            raise ValueError(f"no graph for a batch of {n} sequences (inputs {list(inputs.shape)})")
        self.inputs[:, :n].copy_(inputs, non_blocking=True)
        self.row_tables.gather(self.seq_rows[:n], self.block_tables[:n])     # after the copy: same stream
        if size > n:
            self.block_tables[n:size].zero_()
            self.inputs[:, n:size].zero_()
        return size

    def stage_host(self, inputs: np.ndarray, block_tables: np.ndarray) -> int:
        """`stage` for inputs and block tables known on the host: host-to-device copies only (no kernel:
        the padding is done on the host); returns the graph size.

        Args:
            inputs: [STAGED_ROWS, n] int64 (as `stage`'s; rows the caller fills on the device after the
                copy may hold anything).
            block_tables: [n, width] int32 each row's block table, width <= the captured width.
        Raises:
            ValueError: no graph holds n, or the tables are wider than the captured ones.
        """
        n = inputs.shape[1]
        size = self.bucket(n)
        width = block_tables.shape[1]
        if size is None or inputs.shape[0] != STAGED_ROWS or width > self.block_tables.shape[1]:
            raise ValueError(f"no graph for inputs {list(inputs.shape)} and block tables {list(block_tables.shape)}")
        padded = np.zeros((STAGED_ROWS, size), dtype=np.int64)
        padded[:, :n] = inputs
        tables = np.zeros((size, self.block_tables.shape[1]), dtype=np.int32)
        tables[:n, :width] = block_tables
        for row in range(STAGED_ROWS):         # contiguous destinations: plain copies, no kernel
            copy_into(self.inputs[row, :size], padded[row])
        copy_into(self.block_tables[:size], tables)
        return size

    def replay(self, n: int, size: int | None = None) -> Tensor:
        """Replay the graph of `stage`'s step of n sequences (of `size`, as staged; None = the smallest
        that holds n); returns its logits [n, vocab], a view of the graph's output, valid until the
        next replay (work queued after it on the stream, such as sampling, reads it in time)."""
        size = self.bucket(n) if size is None else size
        if size is None or size not in self.graphs:
            raise ValueError(f"no decode graph holds a step of {n} (the largest holds {self.sizes[-1]})")
        self.graphs[size].replay()
        return self.outputs[size][:n]

    def _pad_and_copy_tables(self, n: int, size: int, block_tables: Tensor) -> None:
        """The block tables of n rows (zero past their width), and padding rows n..size pointed at
        the dummy block 0 / slot 0 with token 0 at position 0."""
        width = block_tables.shape[1]
        self.block_tables[:size].zero_()
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        if size > n:
            self.inputs[:, n:size].zero_()


def copy_into(dst: Tensor, array: np.ndarray) -> None:
    """dst ← array without a wait: on CUDA from pinned memory with a non-blocking copy (the caching host
    allocator keeps the pinned block until the copy has run; a contiguous `dst` makes it a plain copy,
    no kernel), directly on the CPU."""
    src = torch.from_numpy(np.ascontiguousarray(array))
    if dst.device.type == "cuda":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


class CpuGraph:
    """A stand-in for `torch.cuda.CUDAGraph` where none can be captured (`capture_graph(emulate=True)`):
    it keeps the captured function and its first outputs (a tensor, or a dataclass of tensors); `replay`
    runs the function again and copies what it returns into those outputs, which stay the graph's static
    outputs, as a CUDA graph's do. Unlike a CUDA graph it re-reads the Python state it closes over.
    A replay runs outside `forbid_cuda_sync`'s CPU emulation: a graph replay launches nothing and reads
    nothing on the host, whatever the eager ops it stands in for do."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self.outputs = fn()

    def replay(self) -> None:
        with torch.no_grad(), torch._C.DisableTorchFunction():
            _copy_outputs(self.outputs, self._fn())

    def pool(self) -> None:
        return None


def capture_graph(fn: Callable[[], Out], pool: Any, *, emulate: bool = False) -> tuple[Any, Out, Any]:
    """One graph of `fn` (which reads and writes static buffers only): on CUDA two warm-up runs on a side
    stream (allocations, lazy inits, Triton compiles) and the capture into `pool`; with `emulate` a
    `CpuGraph` (any device). Returns (the graph, its static outputs, the pool for the next capture)."""
    if emulate:
        graph = CpuGraph(fn)
        return graph, graph.outputs, pool
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph, pool=pool):
        outputs = fn()
    return cuda_graph, outputs, cuda_graph.pool()


def _copy_outputs(static: Any, fresh: Any) -> None:
    if isinstance(static, Tensor):
        static.copy_(fresh)
        return
    for field in dataclasses.fields(static):
        _copy_outputs(getattr(static, field.name), getattr(fresh, field.name))
