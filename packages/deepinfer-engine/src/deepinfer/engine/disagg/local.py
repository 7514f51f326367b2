"""`LocalKVTransfer`: a prefill/decode pair inside one process (tests, `benchmarks/pd_pair.py` with one
device holding both engines). The COMPLETION engine's orders go straight to a PROMPT engine this
transfer owns, which its `poll` steps; what the PROMPT engine sends stays in host memory until polled."""

from __future__ import annotations

from ..config.engine_args import EngineArgs
from ..core.kv_handoff import ModelFingerprint, PrefilledRequest, PrefillOrder, TransferFailed
from ..core.outputs import FINISH_LENGTH, FINISH_PREFILLED, FINISH_STOP, OutputKind
from ..core.stats import TransferStats
from ..llm_engine import LLMEngine

_HANDED_ON = (FINISH_PREFILLED, FINISH_STOP, FINISH_LENGTH)


class LocalKVTransfer:
    """The `kv_handoff.KVTransfer` of both engines of an in-process pair.

    Args:
        prompt_args: the PROMPT engine's arguments (engine_type PROMPT); it is built here, with this
            transfer, and is `prompt_engine`. Build the COMPLETION engine with
            `LLMEngine(args, kv_transfer=<this>)`: its `connect` compares the two fingerprints.

    Raises:
        ValueError: prompt_args is not a PROMPT engine's.
    """

    prefills = True

    def __init__(self, prompt_args: EngineArgs) -> None:
        from deepinfer.sched import EngineType

        if prompt_args.engine_type is not EngineType.PROMPT:
            raise ValueError(f"prompt_args.engine_type={prompt_args.engine_type.name} must be PROMPT")
        self._fingerprint: ModelFingerprint | None = None
        self._sent: dict[str, PrefilledRequest] = {}
        self._failed: list[TransferFailed] = []
        self._stats = TransferStats()
        self.prompt_engine = LLMEngine(prompt_args, kv_transfer=self)

    def connect(self, fingerprint: ModelFingerprint) -> None:
        """The PROMPT engine connects first; the COMPLETION engine must have its fingerprint."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint
        elif fingerprint.key != self._fingerprint.key:
            raise ValueError(f"the prefill engine serves {self._fingerprint.model} (key {self._fingerprint.key[:12]}), "
                             f"this decode engine {fingerprint.model} (key {fingerprint.key[:12]}): they cannot hand "
                             "KV over (same model, dtypes, max_model_len and cache layout needed)")

    def send(self, handoff: PrefilledRequest) -> None:
        self._sent[handoff.request_id] = handoff
        num_bytes = 0 if handoff.kv is None else handoff.kv.num_bytes
        self._stats = TransferStats(self._stats.num_transfers + 1, self._stats.num_bytes + num_bytes,
                                    self._stats.seconds)

    def request_prefill(self, order: PrefillOrder) -> None:
        try:
            self.prompt_engine.add_request(order.request_id, {"prompt_token_ids": list(order.prompt_token_ids)},
                                           order.params, output_kind=OutputKind.FINAL_ONLY)
        except ValueError as err:
            self._failed.append(TransferFailed(order.request_id, f"the prefill engine refused it: {err}"))

    def cancel(self, request_id: str) -> None:
        self.prompt_engine.abort_request(request_id)
        self._step()           # reports the abort, so the PROMPT engine forgets the request
        self._sent.pop(request_id, None)
        self._failed = [f for f in self._failed if f.request_id != request_id]

    def poll(self, timeout_s: float) -> list[PrefilledRequest | TransferFailed]:
        """Step the PROMPT engine once (when it has work) and return what it handed on or failed."""
        self._step()
        items: list[PrefilledRequest | TransferFailed] = [*self._sent.values(), *self._failed]
        self._sent.clear()
        self._failed.clear()
        return items

    def _step(self) -> None:
        if self.prompt_engine.has_unfinished_requests():
            for out in self.prompt_engine.step():
                if out.finished and out.outputs[0].finish_reason not in _HANDED_ON:
                    sample = out.outputs[0]
                    why = sample.error_reason or sample.ignored_reason or sample.finish_reason
                    self._failed.append(TransferFailed(out.request_id, f"the prefill engine ended it: {why}"))

    def stats(self) -> TransferStats:
        return self._stats


__all__ = ["LocalKVTransfer"]
