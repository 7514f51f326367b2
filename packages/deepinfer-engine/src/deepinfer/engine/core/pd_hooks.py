"""`LLMEngine`'s prefill/decode disaggregation hooks (docs/design.md §3.5, §15), a base of `LLMEngine`.

PROMPT engine: `PlainStep` calls `pe_prepare_save_kvcache` for the sequences a step prefilled (their
KV and state slot are copied to host memory while the scheduler still holds them), finishes them in
the scheduler, then `pe_do_save_kvcache` (each becomes a `PrefilledRequest`: first token, logprobs,
KV) and `send_processed_prompts` (they go to the `KVTransfer`).

COMPLETION engine: `add_request` orders the prefill (`order_prefill`, from `RequestIntake.enqueue`);
every `step()` first takes what arrived (`take_transfers`): a request's first token goes into it at
once (reported, so its time to first token does not wait for room), then the scheduler admits it
prefilled (`Scheduler.add_prefilled_seq`) and its KV and state are written into the blocks and slot
it got; one that finds no room waits, in arrival order, for the next step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from deepinfer.sched import EngineType, Scheduler, SchedulerOutput

from ..config.engine_args import EngineArgs
from .kv_handoff import (
    KVPayload,
    KVTransfer,
    ModelFingerprint,
    NullKVTransfer,
    PendingImports,
    PrefilledRequest,
    PrefillOrder,
    TransferFailed,
    export_kv,
    import_kv,
    model_fingerprint,
)
from .model_runner import ModelRunner
from .outputs import FINISH_PREFILLED
from .request import ParallelRequest, Request
from .steps import Changed

logger = logging.getLogger(__name__)

# With nothing to run but requests waiting for their KV, `step()` waits this long for a transfer.
IDLE_TRANSFER_WAIT_S = 0.05


class PrefillDecodeHooks:
    """The hooks (module docstring); state set up by `init_pd_split`, the rest is `LLMEngine`'s."""

    args: EngineArgs
    model_dir: Path
    max_model_len: int
    runner: ModelRunner
    scheduler: Scheduler
    _requests: dict[str, Request | ParallelRequest]
    kv_transfer: KVTransfer

    if TYPE_CHECKING:      # `intake.RequestIntake`, the other base of `LLMEngine`
        def _seq(self, seq_id: str) -> Request | None: ...

        def _forget_seq(self, seq_id: str) -> None: ...

    fingerprint: ModelFingerprint
    _pd: PendingImports
    _staged: list[tuple[Request, KVPayload | None]]       # copied out, not yet a PrefilledRequest
    _handoffs: list[PrefilledRequest]                      # made, not yet sent

    def init_pd_split(self) -> None:
        """Set up the prefill/decode transfer: this engine's fingerprint, and `KVTransfer.connect` (a
        peer serving another model is refused here, both named)."""
        self.fingerprint = model_fingerprint(self.args, self.model_dir, self.runner.cache, self.max_model_len)
        self._pd = PendingImports()
        self._staged, self._handoffs = [], []
        if self.args.engine_type is not EngineType.NORMAL:
            self.kv_transfer.connect(self.fingerprint)
        if self.args.engine_type is EngineType.PROMPT and isinstance(self.kv_transfer, NullKVTransfer):
            logger.warning("a PROMPT engine without a KVTransfer: its requests end as 'prefilled' and their KV is "
                           "dropped (LLMEngine(kv_transfer=...), or `deepinfer serve --pd-role prefill`)")

    def do_save_kvcache(self, seq_ids: Sequence[str]) -> None:
        """Save finished sequences' KV to a KV store (no-op: there is no KV store tier; docs/design.md §14)."""

    def should_copy_state(self, seq_id: str) -> bool:
        """Whether a handed-over sequence's state slot goes with its KV: whenever the model keeps state
        (V4 and V4.1 always do: window rings, compressor rows, Engram look-back)."""
        return bool(self.runner.cache.state)

    # ------------------------------------------------------------------ PROMPT engine

    def pe_prepare_save_kvcache(self, seq_ids: Sequence[str]) -> None:
        """PROMPT engine: copy the KV blocks and state slot of sequences this step prefilled to host
        memory, before the scheduler frees them. A request that already ended at its first token
        copies nothing."""
        block_size = self.runner.plan.block_size
        for seq_id in seq_ids:
            req = self._seq(seq_id)
            if req is None:
                continue
            kv = None
            if req.finish_reason is FINISH_PREFILLED:
                view = self.scheduler.get_seq(seq_id)
                num_blocks = -(-req.num_prompt_tokens // block_size)
                kv = export_kv(self.runner.cache, view.block_ids[:num_blocks], view.state_slot,
                               with_state=self.should_copy_state(seq_id))
            self._staged.append((req, kv))

    def pe_do_save_kvcache(self, seq_ids: Sequence[str]) -> None:
        """PROMPT engine: make each staged request a `PrefilledRequest` (its first token, logprobs and KV)."""
        for req, kv in self._staged:
            first = req.output_token_ids[0]
            logprobs = req.logprobs[0] if req.logprobs else None
            rank = req.logprob_entries[0][first].rank if req.logprob_entries else None
            self._handoffs.append(PrefilledRequest(req.request_id, tuple(req.prompt_token_ids), first, logprobs,
                                                   rank, kv, self.fingerprint.key))
        self._staged.clear()

    def send_processed_prompts(self, out: SchedulerOutput) -> None:
        """PROMPT engine: hand the step's prefilled requests to the `KVTransfer`."""
        handoffs, self._handoffs = self._handoffs, []
        for handoff in handoffs:
            self.kv_transfer.send(handoff)

    # ------------------------------------------------------------------ COMPLETION engine

    def order_prefill(self, req: Request) -> None:
        """COMPLETION engine: have `req`'s prompt prefilled by the peer (from `enqueue`)."""
        self._pd.awaiting.add(req.request_id)
        try:
            self.kv_transfer.request_prefill(PrefillOrder(req.request_id, tuple(req.prompt_token_ids), req.params))
        except BaseException:
            self._pd.drop(req.request_id)
            raise

    def cancel_prefill(self, request_id: str) -> None:
        """COMPLETION engine: an aborted request's prefill is not wanted any more."""
        if self._pd.drop(request_id):
            self.kv_transfer.cancel(request_id)

    def take_transfers(self, changed: Changed) -> None:
        """COMPLETION engine: take what the transfer delivered, then admit what has room (docstring
        above); waits a little for a transfer when there is nothing else to run."""
        pd = self._pd
        if not len(pd):
            return
        idle = not pd.arrived and not self.scheduler.has_unfinished()
        for item in self.kv_transfer.poll(IDLE_TRANSFER_WAIT_S if idle else 0.0):
            req = self._requests.get(item.request_id)
            if item.request_id not in pd.awaiting or not isinstance(req, Request) or req.finished:
                continue                          # aborted meanwhile: nothing of it is kept
            pd.awaiting.discard(item.request_id)
            if isinstance(item, TransferFailed):
                req.fail(f"prefill failed: {item.reason}")
                changed[req.request_id] = req
            elif self._take_first_token(req, item, changed):
                pd.arrived.append(item)
        arrived, pd.arrived = pd.arrived, []
        for handoff in arrived:
            if pd.arrived or not self._admit_prefilled(handoff, changed):
                pd.arrived.append(handoff)        # no room now: it and those after it wait

    def _take_first_token(self, req: Request, handoff: PrefilledRequest, changed: Changed) -> bool:
        """Check a handoff against its request and add its first token; True when the request goes on
        to decode (its KV is to be admitted)."""
        problem = None
        if handoff.fingerprint_key != self.fingerprint.key:
            problem = "it was prefilled by an engine of another model or cache layout"
        elif handoff.prompt_token_ids != tuple(req.prompt_token_ids):
            problem = "the prefilled prompt is not this request's"
        if problem is None:
            req.add_token(handoff.first_token_id, handoff.first_logprobs, handoff.first_rank)
            if not req.finished and handoff.kv is None:
                problem = ("the prefill side ended it at its first token and this engine would go on (do the two "
                           "engines agree on max_model_len and stop conditions?)")
        if problem is not None:
            req.fail(f"prefill handoff refused: {problem}")
        changed[req.request_id] = req
        return not req.finished

    def _admit_prefilled(self, handoff: PrefilledRequest, changed: Changed) -> bool:
        """Admit an arrived request into the scheduler and write its KV; False when there is no room yet."""
        req = self._requests.get(handoff.request_id)
        if not isinstance(req, Request) or req.finished:
            return True
        prefilled = self.scheduler.add_prefilled_seq(req.seq_id, req.token_ids, handoff.first_token_id,
                                                     req.max_tokens, share_list=True)
        if prefilled is None:
            return False
        assert handoff.kv is not None
        try:
            import_kv(self.runner.cache, prefilled.block_table, prefilled.state_slot, handoff.kv)
        except ValueError as err:
            self._forget_seq(req.seq_id)
            req.fail(f"prefill handoff refused: {err}")
            changed[req.request_id] = req
        return True




__all__ = ["IDLE_TRANSFER_WAIT_S", "PrefillDecodeHooks"]
