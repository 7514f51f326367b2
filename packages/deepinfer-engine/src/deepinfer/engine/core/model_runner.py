"""ModelRunner: owns the model, its cache memory and the per-row device state of decode steps; turns
scheduler steps into model batches.

Per-row state (ZOS, docs/design.md §6): `row_tokens[row]` holds, on the device, the token last sampled for
the sequence at scheduler row `row` (`DecodeBatch.rows`, stable while the sequence lives). A decode step
whose sequences have a step in flight (`DecodeBatch.in_flight`) takes their input tokens from there, so
the host never waits for a sampled token before launching the next forward; only rows whose last token
the host already knows (new, or after a prefill) read it from the step's pinned host copy (where the
others stage `ON_DEVICE`, replaced on the device). Under
speculative decoding a verify step emits 1 … k + 1 tokens per row: `row_tokens` then holds the last of
them and `row_emitted[row]` how many (`record_emitted`), from which the next step, launched before the
host has read them, places its tokens (`verify_forward`'s `shift`).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm

import numpy as np
import torch
from torch import Tensor

from deepinfer.cache import PagedStream, StateRegion, plan_paged_layout, plan_state_layout
from deepinfer.kernels import kernels_for
from deepinfer.model import CausalLM, ForwardBatch, ModelCache
from deepinfer.sched import DecodeBatch, SchedulerOutput, StepKind

from ..device.staging import host_staging, to_device
from .cache_copies import SnapshotLayout, block_bytes
from .cuda_graphs import STAGED_ROWS, DecodeGraphs
from .prefix_memory import HostTierSize, PrefixMemory, host_tier_size

ON_DEVICE = -1      # the staged input token of a row whose last token is on the device (`row_tokens`)


@dataclass(frozen=True, slots=True)
class CachePlan:
    """How the cache memory was sized (reported by the engine)."""

    block_size: int
    num_kv_blocks: int
    num_state_slots: int
    paged_bytes: int
    state_bytes: int                    # the state slots
    state_size_to_disk: int
    num_snapshot_slots: int = 0         # prefix-cache state snapshots on the device
    snapshot_bytes: int = 0             # of one snapshot (`SnapshotLayout`; smaller than a state slot)
    num_host_blocks: int = 0            # the prefix cache's host tier: KV blocks and snapshots
    num_host_snapshots: int = 0
    host_bytes: int = 0                 # the host tier's pinned memory

    @property
    def snapshot_pool_bytes(self) -> int:
        """Device bytes of the snapshot pool (paid for out of the cache budget; its row 0 unused)."""
        return (self.num_snapshot_slots + 1) * self.snapshot_bytes if self.num_snapshot_slots else 0


@dataclass(frozen=True, slots=True)
class StepBatch:
    """A scheduler step turned into model input, plus which sequence each logits row belongs to."""

    batch: ForwardBatch | None          # None exactly when graph_seqs > 0: staged into the CUDA graphs
    sample_seq_ids: tuple[str, ...]     # sequences to sample, in logits-row order
    logits_rows: Tensor | None          # [len(sample_seq_ids)] rows of the forward's logits; None = all, in order
    rows: Tensor | None = None          # decode steps: [num_seqs] int64 scheduler row of each sequence (device)
    # prefill steps built with every row's logits (`prepare(..., all_logits_for=...)`): per such chunk
    # (seq_id, first logits row, number of rows, position of its first token); else empty
    prompt_spans: tuple[tuple[str, int, int, int], ...] = ()
    # prefill steps: [k, 3] int64 (state slot, prefix-cache snapshot id, position) saved once the forward
    # has run (`SchedulerOutput.save_states`); None = none
    save_states: Tensor | None = None
    graph_seqs: int = 0                 # > 0: a decode step of this many sequences already in the graphs'
                                        # static inputs (`DecodeGraphs.stage`); `batch` is None


def state_slot_bytes(model: CausalLM, block_size: int, max_backtracking: int) -> int:
    """Bytes of one state slot as the runner lays it out."""
    spec = model.cache_spec(block_size, max_backtracking)
    return plan_state_layout([StateRegion(r.name, r.num_bytes, r.stored) for r in spec.states], 2).slot_bytes


def snapshot_bytes(model: CausalLM, block_size: int, max_backtracking: int) -> int:
    """Bytes of one prefix-cache state snapshot (`SnapshotLayout`: the live rows at a block boundary)."""
    return SnapshotLayout.for_spec(model.cache_spec(block_size, max_backtracking)).num_bytes


def default_block_size(model: CausalLM) -> int:
    """The smallest multiple of every compress ratio that is ≥ 64 tokens."""
    grain = lcm(*[r for r in model.cfg.compress_ratios if r] or [1])
    return grain * max(1, -(-64 // grain))


class ModelRunner:
    """Allocates the paged KV and state buffers through deepinfer.cache's planner and runs forwards.

    Args:
        model: the loaded model (on its device).
        block_size: tokens per paged block.
        num_kv_blocks / budget_bytes: size the paged buffer by block count, or fit paged buffer + state
            slots into budget_bytes.
        num_state_slots: state slots (slot 0 the dummy).
        max_backtracking: spare ring slots for rejected draft tokens.
        graph_max_seqs: capture decode CUDA graphs up to this many sequences (CUDA only; None = eager).
        max_blocks_per_seq / max_model_len: the block-table width and context bound the graphs capture.
        graph_interval: spacing of graph sizes past the first powers of two.
        graph_max_query_len: k + 1 under speculative decoding: the graphs run verify steps
            (`verify_forward`), keyed by total query tokens, and graph_max_seqs counts query tokens.
        max_verify_tokens: speculative decoding: the most query tokens of a verify step (max_num_seqs ×
            (k + 1)); sizes `fed_tokens` / `fed_positions` where no graph holds them. 0 = none.
        num_snapshot_slots: prefix-cache state snapshots (the scheduler's snapshot ids 1..n), in a
            pool of their own (`PrefixMemory`) paid for out of budget_bytes like the state slots.
        host_tier_bytes: host memory for the prefix cache's host tier (0 = none), split between KV
            blocks and snapshots as the device cache splits its bytes (`host_tier_size`).
        batch_invariant: run the batch-invariant kernels (`EngineArgs.batch_invariant`): each sequence's
            logits are then bitwise the same whatever else is in its step (docs/batch_invariance.md).
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        block_size: int,
        num_kv_blocks: int | None,
        budget_bytes: int | None,
        num_state_slots: int,
        max_backtracking: int,
        graph_max_seqs: int | None = None,
        max_blocks_per_seq: int = 0,
        max_model_len: int = 0,
        graph_interval: int = 8,
        graph_max_query_len: int = 1,
        batch_invariant: bool = False,
        num_snapshot_slots: int = 0,
        max_verify_tokens: int = 0,
        host_tier_bytes: int = 0,
        emulate_graphs: bool = False,
    ) -> None:
        self.model = model
        self.device = model.embed.weight.device
        self.ops = kernels_for(self.device, batch_invariant=batch_invariant)
        spec = model.cache_spec(block_size, max_backtracking)
        state = plan_state_layout([StateRegion(r.name, r.num_bytes, r.stored) for r in spec.states], num_state_slots)
        layout = SnapshotLayout.for_spec(spec)
        snapshot_pool_bytes = (num_snapshot_slots + 1) * layout.num_bytes if num_snapshot_slots else 0
        streams = [PagedStream(s.name, s.bytes_per_row, s.tokens_per_row) for s in spec.streams]
        fixed_bytes = state.total_bytes + snapshot_pool_bytes
        paged_budget = None if num_kv_blocks or budget_bytes is None else budget_bytes - fixed_bytes
        if paged_budget is not None and paged_budget <= 0:
            raise ValueError(f"the cache budget of {budget_bytes} B does not even hold the {num_state_slots} state "
                             f"slots and {num_snapshot_slots} prefix-cache snapshots ({fixed_bytes} B)")
        if streams:
            paged = plan_paged_layout(streams, block_size, num_blocks=num_kv_blocks, budget_bytes=paged_budget)
            num_blocks, paged_bytes = paged.num_blocks, paged.total_bytes
            offsets = {name: p.offset for name, p in paged.streams.items()}
        else:                      # a model of sliding-window layers only has no paged stream
            num_blocks, paged_bytes, offsets = num_kv_blocks or 2, 0, {}
        if num_blocks < 2:
            raise ValueError(f"the KV budget holds {num_blocks} block(s); at least 2 are needed (block 0 is reserved)")
        paged_buffer = torch.zeros(paged_bytes, dtype=torch.uint8, device=self.device)
        state_buffer = torch.zeros(state.total_bytes, dtype=torch.uint8, device=self.device)
        self.cache = ModelCache.from_buffers(
            spec, paged_buffer, offsets, num_blocks, state_buffer,
            {name: r.offset for name, r in state.regions.items()}, num_state_slots, state.slot_bytes,
        )
        host = HostTierSize(0, 0)
        if num_snapshot_slots and host_tier_bytes:
            host = host_tier_size(host_tier_bytes, block_bytes(self.cache), layout.num_bytes, num_blocks - 1,
                                  num_snapshot_slots)
        self.prefix = PrefixMemory(self.cache, layout, num_snapshot_slots, host, self.device) \
            if num_snapshot_slots else None
        self.plan = CachePlan(block_size, num_blocks, num_state_slots, paged_bytes, state.total_bytes,
                              state.state_size_to_disk, num_snapshot_slots, layout.num_bytes, host.num_blocks,
                              host.num_snapshots, 0 if self.prefix is None else self.prefix.host_bytes)
        self.row_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)   # [rows] last sampled token
        self.row_emitted = torch.zeros(0, dtype=torch.int64, device=self.device)  # [rows] tokens of its last step
        # None: every forward runs eagerly. A step replays a graph where `_graphs_for` finds one that holds it.
        self.graphs = self._decode_graphs(graph_max_seqs, max_blocks_per_seq, max_model_len, graph_interval,
                                          graph_max_query_len, emulate_graphs)
        self.fed_tokens, self.fed_positions = self._verify_inputs(graph_max_query_len, max_verify_tokens)

    def _decode_graphs(self, max_seqs: int | None, max_blocks: int, max_context_len: int, interval: int,
                       max_query_len: int, emulate: bool) -> DecodeGraphs | None:
        """The decode graphs, where they are wanted (max_seqs) and can run: CUDA graphs need the graph-safe
        kernels, which run in bfloat16 (grouped-GEMM MoE); emulated (tests), they are CPU stand-ins of
        the same static buffers on any device and dtype."""
        cuda_bf16 = self.device.type == "cuda" and self.model.embed.weight.dtype == torch.bfloat16
        if not max_seqs or not (cuda_bf16 or emulate):
            return None
        return DecodeGraphs(self.model, self.cache, max_seqs=max_seqs, max_blocks=max_blocks,
                            max_context_len=max_context_len, interval=interval, ops=self.ops,
                            max_query_len=max_query_len, emulate=emulate)

    def _verify_inputs(self, max_query_len: int, max_verify_tokens: int) -> tuple[Tensor | None, Tensor | None]:
        """Speculative decoding: the flat token ids and positions of a verify forward as the draft walk
        writes them (`DraftGraphs`), one spare entry last: the verify graphs' own static inputs where
        they are captured, else buffers the eager forward reads (`verify_forward_static`); None without."""
        if max_query_len > 1 and self.graphs is not None:
            return self.graphs.token_ids, self.graphs.positions
        if max_verify_tokens:
            tokens, positions = torch.zeros(2, max_verify_tokens + 1, dtype=torch.int64, device=self.device)
            return tokens, positions
        return None, None

    def forget_rows(self) -> None:
        """A new scheduler: its rows and table versions say nothing about what the per-row buffers hold."""
        if self.graphs is not None:
            self.graphs.forget_rows()

    def _graphs_for(self, size: int) -> DecodeGraphs | None:
        """The decode graphs when one of them holds a step of `size` sequences (query tokens under
        multi-token decode); None: the step runs eagerly."""
        graphs = self.graphs
        return graphs if graphs is not None and graphs.bucket(size) is not None else None

    def apply_cache_ops(self, out: SchedulerOutput) -> None:
        """The prefix cache's copies to and from host memory, copy-on-write clones, zeroing and
        prefix-cache restores the scheduler asked for (before the forward; its snapshot saves run
        after it, in `forward_all`)."""
        if self.prefix is not None:
            self.prefix.copy_out_and_in(out)
        if len(out.clone_states):
            pairs = torch.as_tensor(np.asarray(out.clone_states), dtype=torch.int64, device=self.device)
            self.cache.copy_slots(pairs[:, 0], pairs[:, 1])
        if len(out.clone_blocks):
            pairs = torch.as_tensor(np.asarray(out.clone_blocks), dtype=torch.int64, device=self.device)
            self.cache.copy_blocks(pairs[:, 0], pairs[:, 1])
        if len(out.zero_states):
            self.cache.zero_slots(torch.as_tensor(np.asarray(out.zero_states), dtype=torch.int64, device=self.device))
        if self.prefix is not None:
            self.prefix.restore(out)

    def prepare(self, out: SchedulerOutput, *, all_logits_for: frozenset[str] = frozenset()) -> StepBatch | None:
        """The model batch of a PREFILL or DECODE step (None for empty / idle steps).

        Args:
            all_logits_for: sequence ids whose prefill chunks need the logits of every row (prompt
                logprobs); when one is in the step, it is built with logits for every row and
                `StepBatch.prompt_spans` says where each such chunk's rows are (`forward_all`).
        """
        if out.kind is StepKind.PREFILL and out.prefill:
            return self._prefill_step(out, all_logits_for)
        if out.kind is StepKind.DECODE and out.decode is not None and out.decode.num_seqs:
            return self._decode_step(out.decode)
        return None

    def _prefill_step(self, out: SchedulerOutput, all_logits_for: frozenset[str]) -> StepBatch:
        """A prefill step's batch: the last row's logits of each chunk that completes its prompt, or
        every row's when a chunk of `all_logits_for` is in the step (`StepBatch.prompt_spans`)."""
        chunks = out.prefill
        wanted = [i for i, c in enumerate(chunks) if c.seq_id in all_logits_for] if all_logits_for else []
        batch = ForwardBatch.build(
            [c.token_ids.tolist() for c in chunks], [c.start for c in chunks],
            [c.block_table.tolist() for c in chunks], [c.state_slot for c in chunks],
            logits="all" if wanted else "last", device=self.device,
        )
        done = [i for i, c in enumerate(chunks) if c.completes_prefill]
        saves = self._to_device(out.save_states.astype(np.int64)) if len(out.save_states) else None
        if not wanted:
            return StepBatch(batch, tuple(chunks[i].seq_id for i in done),
                             torch.tensor(done, dtype=torch.int64, device=self.device), save_states=saves)
        ends = np.cumsum([len(c.token_ids) for c in chunks])
        spans = tuple((chunks[i].seq_id, int(ends[i]) - len(chunks[i].token_ids), len(chunks[i].token_ids),
                       int(chunks[i].start)) for i in wanted)
        return StepBatch(batch, tuple(chunks[i].seq_id for i in done),
                         torch.tensor([int(ends[i]) - 1 for i in done], dtype=torch.int64, device=self.device),
                         prompt_spans=spans, save_states=saves)

    def _decode_step(self, d: DecodeBatch) -> StepBatch:
        if (d.query_lens != 1).any():   # speculative decode steps go through `verify_forward`
            raise ValueError(f"decode query lengths {d.query_lens.tolist()} must all be 1 here; a step with "
                             "drafts runs through verify_forward")
        n = d.num_seqs
        self.ensure_rows(int(d.rows.max()) + 1)
        in_flight = bool(d.in_flight.any())              # ZOS: some rows' tokens are still on the device
        graphs = self.graphs
        if graphs is not None and graphs.bucket(n) is not None:
            return self._staged_decode_step(d, in_flight, graphs)
        host_tokens_and_rows = np.empty((2, n), dtype=np.int64)
        _stage_tokens(d, in_flight, host_tokens_and_rows[0])
        host_tokens_and_rows[1] = d.rows
        staged = self._to_device(host_tokens_and_rows)
        tokens, rows = staged[0], staged[1]
        if in_flight:
            tokens = torch.where(tokens == ON_DEVICE, self.row_tokens.index_select(0, rows), tokens)
        batch = ForwardBatch.decode(tokens, d.seq_lens, d.block_tables, d.state_slots, device=self.device,
                                    to_device=self._to_device)
        return StepBatch(batch, tuple(d.seq_ids), None, rows)

    def _staged_decode_step(self, d: DecodeBatch, in_flight: bool, graphs: DecodeGraphs) -> StepBatch:
        """A decode step that replays one of `graphs`: its inputs go straight into the graph's static
        buffers in one host-to-device copy from pinned memory, and its block tables are gathered on
        the device from `graphs.row_tables`, which copies only new rows and appended blocks (no
        `ForwardBatch`)."""
        n = d.num_seqs
        if d.seq_lens.min() < 1:
            raise ValueError(f"seq_lens must be >= 1, got {int(d.seq_lens.min())}")
        host, inputs = host_staging((STAGED_ROWS, n), self.device)
        _stage_tokens(d, in_flight, host[0])
        np.subtract(d.seq_lens, 1, out=host[1])
        host[2] = d.state_slots
        host[3] = d.rows
        graphs.row_tables.update(d.rows, d.table_versions, d.block_tables)    # new rows, appended blocks
        graphs.stage(inputs)
        rows = graphs.seq_rows[:n]
        if in_flight:
            tokens = graphs.token_ids[:n]
            tokens.copy_(torch.where(tokens == ON_DEVICE, self.row_tokens.index_select(0, rows), tokens))
        return StepBatch(None, tuple(d.seq_ids), None, rows, graph_seqs=n)

    @torch.no_grad()
    def verify_forward(self, d: DecodeBatch, tokens: Tensor, shift: Tensor | None = None,
                       query_lens: Tensor | None = None, graph_size: int | None = None) -> Tensor:
        """The verify forward of a speculative decode step: the model's multi-token decode
        (`ForwardBatch.multi_decode`, static shapes; DeepSeek-V4 and V4.1), replayed from the CUDA
        graph keyed by the step's total query tokens when there is one, else eager.

        Args:
            d: the decode step; sequence i reserved positions [seq_lens[i] − m, seq_lens[i]) with m =
                tokens.shape[1] (nextn + 1) and feeds its first query_lens[i] of them.
            tokens: [num_seqs, nextn + 1] int64 on the device: the anchor (last token), then the drafts.
            shift: ZOS: [num_seqs] int64 on the device, how many positions before the reserved ones each
                row's anchor really is (the reservation of its step in flight that the step did not use:
                nextn + 1 − `row_emitted`; 0 for rows without one); None = 0 for every row.
            query_lens: ZOS: [num_seqs] int64 on the device, the query lengths split on the device (same
                sum as d.query_lens, which they replace); the step's tokens are then laid out on the
                device. None = d.query_lens.
            graph_size: run the forward over this many tokens, padding past sum(query_lens) (lockstep DP
                ranks under expert parallelism agree on it: `spec_lockstep`); None = no padding (the
                graph of the step's own key).
        Returns:
            float32 logits [sum(query_lens), vocab] of every fed row, sequence by sequence.
        """
        if query_lens is not None:
            return self._verify_forward_device_split(d, tokens, shift, query_lens, graph_size)
        query_lens = d.query_lens.astype(np.int64)
        width = tokens.shape[1]
        token_rows = np.repeat(np.arange(d.num_seqs), query_lens)          # the row of each fed token
        ends = np.cumsum(query_lens)
        columns = np.arange(int(ends[-1])) - np.repeat(ends - query_lens, query_lens)
        positions = d.seq_lens.astype(np.int64)[token_rows] - width + columns
        flat = token_rows * width + columns                                   # into tokens.flatten()
        fed = tokens.flatten().index_select(0, self._to_device(flat))
        total_q = len(flat)
        token_shift = None if shift is None else shift.index_select(0, self._to_device(token_rows))
        size = max(total_q, graph_size or 0)
        graphs = self._graphs_for(size)
        if graphs is not None:
            # a replay of the graph keyed by total_q: per token (-1: filled below on the device), its
            # position, its row's state slot and scheduler row (the graphs gather the block tables by it)
            host, inputs = host_staging((STAGED_ROWS, total_q), self.device)
            host[0] = -1
            host[1] = positions
            host[2] = d.state_slots[token_rows]
            host[3] = d.rows[token_rows]
            graphs.row_tables.update(d.rows, d.table_versions, d.block_tables)
            graphs.stage(inputs, graphs.bucket(size))
            graphs.token_ids[:total_q].copy_(fed)
            if token_shift is not None:
                graphs.positions[:total_q].sub_(token_shift)
            return graphs.replay(total_q, graphs.bucket(size))   # float32 [total_q, vocab], valid until
                                                                # the next replay
        placed = positions if token_shift is None else self._to_device(positions) - token_shift
        return self._eager_verify(d, fed, placed, token_rows, width, int(positions.max()) + 1, size)

    def _eager_verify(self, d: DecodeBatch, fed: Tensor, positions: np.ndarray | Tensor,
                      token_rows: np.ndarray | Tensor, width: int, max_context_len: int, size: int) -> Tensor:
        """The eager verify forward over [total_q] tokens (positions and rows on the host or the
        device), padded to `size` tokens (token 0 at position 0 of a row with the dummy state slot 0
        and an all-zero block table, as a graph pads); returns the float32 logits of the step's own."""
        total_q = fed.shape[0]
        block_tables, state_slots = d.block_tables, d.state_slots
        if size > total_q:
            fed = torch.cat((fed, fed.new_zeros(size - total_q)))
            positions = _padded(positions, size, 0)
            token_rows = _padded(token_rows, size, d.num_seqs)            # the padding row, after the others
            block_tables = np.concatenate((block_tables, np.zeros((1, block_tables.shape[1]), block_tables.dtype)))
            state_slots = np.concatenate((state_slots, np.zeros(1, state_slots.dtype)))
        batch = ForwardBatch.multi_decode(fed, positions, token_rows, block_tables, state_slots,
                                          max_query_len=width, max_context_len=max_context_len,
                                          device=self.device, to_device=self._to_device)
        return self.model(batch, self.cache, self.ops)[:total_q].float()

    def _verify_forward_device_split(self, d: DecodeBatch, tokens: Tensor, shift: Tensor | None,
                                     query_lens: Tensor, graph_size: int | None) -> Tensor:
        """`verify_forward` with query lengths known only on the device: the token layout (each token's
        row, column and position) is computed there, without a host read."""
        n, width = d.num_seqs, tokens.shape[1]
        total_q = int(d.query_lens.sum())
        host = np.empty((3, n), dtype=np.int64)
        np.subtract(d.seq_lens, width, out=host[0])
        host[1] = d.state_slots
        host[2] = d.rows
        first_positions, state_slots, rows = self._to_device(host)
        if shift is not None:
            first_positions = first_positions - shift
        token_rows = torch.repeat_interleave(torch.arange(n, device=self.device), query_lens, output_size=total_q)
        starts = torch.cumsum(query_lens, 0) - query_lens
        columns = torch.arange(total_q, device=self.device) - starts.index_select(0, token_rows)
        fed = tokens.flatten().index_select(0, token_rows * width + columns)
        positions = first_positions.index_select(0, token_rows) + columns
        size = max(total_q, graph_size or 0)
        graphs = self._graphs_for(size)
        if graphs is not None:
            inputs = torch.stack((fed, positions, state_slots.index_select(0, token_rows),
                                  rows.index_select(0, token_rows)))
            graphs.row_tables.update(d.rows, d.table_versions, d.block_tables)
            graphs.stage(inputs, graphs.bucket(size))
            return graphs.replay(total_q, graphs.bucket(size))
        return self._eager_verify(d, fed, positions, token_rows, width, int(d.seq_lens.max()), size)

    def stage_verify_static(self, d: DecodeBatch, token_rows: np.ndarray) -> int:
        """Stage the verify forward of a step whose token ids and positions the draft walk writes into
        `fed_tokens` / `fed_positions` (queue this before that walk): on CUDA each token's state slot,
        scheduler row and block table go straight into the graph's static inputs (host-to-device copies,
        no kernel); returns the graph size (total_q without graphs).

        Args:
            d: the decode step; token_rows: [total_q] int64 each token's row in it.
        """
        total_q = len(token_rows)
        graphs = self._graphs_for(total_q)
        if graphs is None:
            return total_q
        inputs = np.zeros((STAGED_ROWS, total_q), dtype=np.int64)     # token ids and positions: the walk's
        inputs[2] = d.state_slots[token_rows]
        inputs[3] = d.rows[token_rows]
        return graphs.stage_host(inputs, d.block_tables[token_rows])

    @torch.no_grad()
    def verify_forward_static(self, d: DecodeBatch, token_rows: np.ndarray) -> Tensor:
        """The verify forward of `stage_verify_static`'s step: the graph replay keyed by total_q on CUDA,
        else the eager multi-token decode over `fed_tokens` / `fed_positions`. Returns float32 logits
        [total_q, vocab] (on CUDA a view of the graph's output, padding rows after them in it)."""
        total_q = len(token_rows)
        graphs = self._graphs_for(total_q)
        if graphs is not None:
            return graphs.replay(total_q)
        if self.fed_tokens is None or self.fed_positions is None:
            raise ValueError("verify_forward_static needs the runner's verify inputs (max_verify_tokens > 0)")
        width = self.graphs.max_query_len if self.graphs is not None else int(d.query_lens.max())
        batch = ForwardBatch.multi_decode(self.fed_tokens[:total_q], self.fed_positions[:total_q], token_rows,
                                          d.block_tables, d.state_slots, max_query_len=width,
                                          max_context_len=int(d.seq_lens.max()), device=self.device,
                                          to_device=self._to_device)
        return self.model(batch, self.cache, self.ops).float()

    def verify_replays_graph(self, total_q: int) -> bool:
        """Whether `verify_forward` of total_q query tokens replays a CUDA graph."""
        return self._graphs_for(total_q) is not None

    def record_sampled(self, step: StepBatch, token_ids: Tensor) -> None:
        """Keep a decode step's sampled tokens ([num_seqs] int64, on the device) by row, for the next
        step's input (no host copy, no wait)."""
        if step.rows is not None:
            self.row_tokens.index_copy_(0, step.rows, token_ids)

    def record_emitted(self, rows: Tensor, last_tokens: Tensor, num_emitted: Tensor) -> None:
        """Keep, by scheduler row, the last token a speculative decode step emitted for each of its rows
        and how many it emitted (all [m] int64 on the device; no host copy, no wait)."""
        self.row_tokens.index_copy_(0, rows, last_tokens)
        self.row_emitted.index_copy_(0, rows, num_emitted)

    def ensure_rows(self, num_rows: int) -> None:
        """Grow the per-row buffers to at least num_rows rows (doubling; device-side copy, no wait)."""
        if num_rows > self.row_tokens.shape[0]:
            size = max(num_rows, 2 * self.row_tokens.shape[0], 64)
            for name in ("row_tokens", "row_emitted"):
                grown = torch.zeros(size, dtype=torch.int64, device=self.device)
                old = getattr(self, name)
                grown[: old.shape[0]] = old
                setattr(self, name, grown)

    def _to_device(self, array: np.ndarray) -> Tensor:
        return to_device(array, self.device)

    def replays_graph(self, step: StepBatch) -> bool:
        """Whether `forward(step)` replays a CUDA graph (rather than running the model eagerly)."""
        return self.graphs is not None and self._graphs_running(step) is not None

    def _graphs_running(self, step: StepBatch) -> DecodeGraphs | None:
        """The graphs that run `step`: those it was staged into, or for a uniform decode batch one
        of them holds (`DecodeGraphs.run`); None: the model runs eagerly."""
        batch = step.batch
        if self.graphs is None or (batch is not None and not batch.uniform_decode):
            return None
        return self._graphs_for(step.graph_seqs if batch is None else batch.num_seqs)

    @torch.no_grad()
    def forward(self, step: StepBatch) -> Tensor:
        """Run the model (a CUDA-graph replay for decode steps that fit one); returns float32 logits
        [len(step.sample_seq_ids), vocab]."""
        return self.forward_all(step)[0]

    @torch.no_grad()
    def forward_all(self, step: StepBatch) -> tuple[Tensor, Tensor | None]:
        """`forward`, plus the logits of every row when the step has `prompt_spans` (else None)."""
        batch, graphs = step.batch, self._graphs_running(step)
        if batch is None:                   # staged into the graphs' static inputs (`_staged_decode_step`)
            if graphs is None:
                raise ValueError(f"a decode step of {step.graph_seqs} sequences staged for CUDA graphs that "
                                 "this runner has not captured")
            logits = graphs.replay(step.graph_seqs)
        elif graphs is not None:
            logits = graphs.run(batch)
        else:
            logits = self.model(batch, self.cache, self.ops)
        if step.save_states is not None and self.prefix is not None:    # the state these chunks leave
            self.prefix.save(step.save_states)
        sampled = logits if step.logits_rows is None else logits[step.logits_rows]
        return sampled, logits if step.prompt_spans else None


def _padded(values: np.ndarray | Tensor, size: int, fill: int) -> np.ndarray | Tensor:
    """`values` ([n] on the host or the device) followed by `fill` up to `size` entries."""
    if isinstance(values, Tensor):
        return torch.cat((values, values.new_full((size - values.shape[0],), fill)))
    return np.concatenate((values, np.full(size - len(values), fill, dtype=values.dtype)))


def _stage_tokens(d: DecodeBatch, in_flight: bool, out: np.ndarray) -> None:
    """A decode step's input tokens as staged for the device: the last known token of each row,
    `ON_DEVICE` for rows with a step in flight."""
    if not in_flight:
        out[...] = d.last_token_ids
    elif d.in_flight.all():           # the steady ZOS step: every row's token is on the device
        out.fill(ON_DEVICE)
    else:
        np.copyto(out, np.where(d.in_flight, ON_DEVICE, d.last_token_ids))
