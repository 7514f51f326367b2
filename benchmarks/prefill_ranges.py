"""Time of one forward per op class, from marks recorded around module forwards and kernel-set ops.

    timer = OpClassTimer(model, kernels_for("cuda"), CudaClock())
    times = timer.time(lambda ops: model(batch, cache, ops))      # ClassTimes
    timer.remove()

Forward hooks on the model, its blocks, attention, MoE and routed experts, an instance attribute
wrapping each compressor's `compress`, and a wrapped copy of the kernel set open a range around each
call: a start mark before it, a stop mark after it, nothing synchronised inside the forward. On
CUDA a mark is an event recorded on the current stream (`CudaClock`), so a range's time is the
stream's time between its marks: its kernels and any idle gap of the stream inside it (launch gaps,
host syncs). Without CUDA a mark is `time.perf_counter()` (`HostClock`). After the forward one
synchronisation; each range's exclusive time (its time less that of the ranges directly inside it)
goes to its class, so the classes add up to the forward's time by construction. The marks add a
little host work per call (two event records), so the forward runs slightly slower than unmarked:
time it separately.

Labels and classes:
- "op:<class>": a kernel-set op (`OP_CLASS`), or the `linear` of a known weight (the router's gate,
  attention's wo_b); other `linear`s take their context's class. An op's range claims every kernel
  launched inside it (ops called inside an op open no range of their own).
- "split:<key>": the stacked input projections of an attention layer (one GEMM, one input), split
  between classes in proportion to their output columns.
- "ctx:<context>": kernels of a module forward outside any op (`CONTEXT_CLASS`); a compressor's
  context claims its ops too (the FLOP model counts its norm and RoPE as compressor work).
- the whole forward's own exclusive time goes to "other".
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deepinfer.kernels import KernelSet
from deepinfer.model.layers.attention import Attention
from deepinfer.model.layers.compressor import Compressor
from deepinfer.model.layers.moe import Experts, MoE
from deepinfer.model.model import Block

OP_CLASS = {
    "sparse_attention": "attn_core", "prefill_attention": "attn_core", "indexer_scores": "indexer",
    "topk_lowest_index": "indexer",
    "compress_pool": "compressor", "hc_pre": "mhc", "hc_post": "mhc", "hc_head": "embed_head",
    "rms_norm": "norm_rope", "norm_rope": "norm_rope", "apply_rope": "norm_rope", "grouped_linear": "attn_proj",
    "route": "router", "router_scores": "router", "routing_weights": "router", "moe_experts": "moe_routed",
    "moe_experts_fp8": "moe_routed", "moe_experts_mxfp4": "moe_routed", "clamped_swiglu": "moe_shared",
    "fake_quant_fp8": "norm_rope", "fake_quant_fp4": "norm_rope",
}
# Module forward → class of its time outside any op: the attention's row gathers, cache writes and
# casts are data movement; the model's own is the embedding and the LM head.
CONTEXT_CLASS = {"model": "embed_head", "block": "other", "attention": "data_movement", "compressor": "compressor",
                 "moe": "other", "experts": "moe_routed"}
ROOT = "forward"


class Clock(Protocol):
    def mark(self) -> Any: ...
    def wait(self) -> None: ...
    def seconds(self, start: Any, stop: Any) -> float: ...


class CudaClock:
    """Marks are CUDA events on the current stream; `wait` synchronises the device once."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self) -> None:
        torch.cuda.synchronize()

    def seconds(self, start: torch.cuda.Event, stop: torch.cuda.Event) -> float:
        return start.elapsed_time(stop) / 1e3


class HostClock:
    """Marks are `time.perf_counter()` readings: the CPU fallback (the kernels run synchronously)."""

    def mark(self) -> float:
        return time.perf_counter()

    def wait(self) -> None:
        pass

    def seconds(self, start: float, stop: float) -> float:
        return stop - start


@dataclass(frozen=True, slots=True)
class ClassTimes:
    """One forward's time and its split by class; sum(class_s.values()) == total_s up to rounding."""

    total_s: float
    class_s: Mapping[str, float]
    num_ranges: int


def exclusive_seconds(parents: Sequence[int], inclusive: Sequence[float]) -> list[float]:
    """Each range's time less the time of the ranges directly inside it (parents[i] = -1: outermost)."""
    out = list(inclusive)
    for parent, seconds in zip(parents, inclusive):
        if parent >= 0:
            out[parent] -= seconds
    return out


def class_seconds(labels: Sequence[str], exclusive: Sequence[float],
                  splits: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Exclusive seconds per class of ranges labelled ROOT, "op:<class>", "ctx:<context>" or "split:<key>"."""
    out: dict[str, float] = defaultdict(float)
    for label, seconds in zip(labels, exclusive):
        kind, _, key = label.partition(":")
        shares = {"other": 1.0} if label == ROOT else splits[key] if kind == "split" \
            else {CONTEXT_CLASS[key] if kind == "ctx" else key: 1.0}
        for name, fraction in shares.items():
            out[name] += seconds * fraction
    return dict(out)


class OpClassTimer:
    """Ranges for the op classes, installed on a model and a kernel set until `remove`.

    Install after one forward: the attention layers build their stacked projection weights in their
    first forward, and the split keys are taken from them here.
    """

    def __init__(self, model: torch.nn.Module, base: KernelSet, clock: Clock) -> None:
        self.clock = clock
        self.ops = KernelSet(base.device_type)
        self.splits: dict[str, dict[str, float]] = {}
        self.linear_label: dict[int, str] = {}
        self._labels: list[str] = []
        self._parents: list[int] = []
        self._marks: list[list[Any]] = []
        self._open: list[int] = []
        self._hooks: list = []
        self._wrapped: list[Compressor] = []
        for name in (*OP_CLASS, "linear"):
            setattr(self.ops, name, self._wrap_op(name, getattr(base, name)))
        for module in model.modules():
            if isinstance(module, Attention):
                self._register_splits(module)
            if isinstance(module, MoE):
                self.linear_label[module.gate.weight.data_ptr()] = "op:router"
            context = ("model" if module is model else "block" if isinstance(module, Block)
                       else "attention" if isinstance(module, Attention) else "moe" if isinstance(module, MoE)
                       else "experts" if isinstance(module, Experts) else None)
            if context is not None:
                self._hooks.append(module.register_forward_pre_hook(lambda *_, c=context: self._push(f"ctx:{c}")))
                self._hooks.append(module.register_forward_hook(lambda *_: self._pop()))
            if isinstance(module, Compressor):
                module.compress = self._wrap_context("ctx:compressor", module.compress)
                self._wrapped.append(module)

    def time(self, forward: Callable[[KernelSet], Any]) -> ClassTimes:
        """Run `forward(self.ops)` once inside a ROOT range; its time per class."""
        for state in (self._labels, self._parents, self._marks, self._open):
            state.clear()
        self._push(ROOT)
        forward(self.ops)
        self._pop()
        assert not self._open, f"unclosed ranges: {[self._labels[i] for i in self._open]}"
        self.clock.wait()
        inclusive = [self.clock.seconds(start, stop) for start, stop in self._marks]
        exclusive = exclusive_seconds(self._parents, inclusive)
        return ClassTimes(inclusive[0], class_seconds(self._labels, exclusive, self.splits), len(self._labels))

    def remove(self) -> None:
        """Take the hooks and the compressor wrappers off the model."""
        for hook in self._hooks:
            hook.remove()
        for module in self._wrapped:
            del module.compress

    def _register_splits(self, attn: Attention) -> None:
        def share(parts: list[tuple[str, torch.nn.Linear]]) -> dict[str, float]:
            columns: dict[str, float] = defaultdict(float)
            for name, linear in parts:
                columns[name] += linear.out_features
            total = sum(columns.values())
            return {name: num / total for name, num in columns.items()}

        x_parts = [("attn_proj", attn.wq_a), ("attn_proj", attn.wkv)]
        q_parts = [("attn_proj", attn.wq_b)]
        if attn.compressor is not None:
            x_parts += [("compressor", attn.compressor.wkv), ("compressor", attn.compressor.wgate)]
        if attn.indexer is not None:
            x_parts += [("indexer", attn.indexer.weights_proj), ("compressor", attn.indexer.compressor.wkv),
                        ("compressor", attn.indexer.compressor.wgate)]
            q_parts += [("indexer", attn.indexer.wq_b)]
        for attr, parts in (("_x_weight", x_parts), ("_q_weight", q_parts)):
            stacked = attn.__dict__.get(attr)
            if stacked is None:
                raise ValueError(f"layer {attn.layer} has no {attr}: run one forward before installing the timer")
            key = f"{attr[1]}{attn.layer}"
            self.splits[key] = share(parts)
            self.linear_label[stacked.data_ptr()] = f"split:{key}"
        self.linear_label[attn.wo_b.weight.data_ptr()] = "op:attn_proj"

    def _push(self, label: str) -> None:
        self._labels.append(label)
        self._parents.append(self._open[-1] if self._open else -1)
        self._open.append(len(self._marks))
        self._marks.append([self.clock.mark(), None])

    def _pop(self) -> None:
        self._marks[self._open.pop()][1] = self.clock.mark()

    def _claimed(self) -> bool:
        """The innermost open range claims whatever runs inside it (an op, a split, a compressor)."""
        return bool(self._open) and self._labels[self._open[-1]].startswith(("op:", "split:", "ctx:compressor"))

    def _wrap_context(self, label: str, fn: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            self._push(label)
            try:
                return fn(*args, **kwargs)
            finally:
                self._pop()
        return wrapped

    def _wrap_op(self, name: str, fn: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            if self._claimed():
                return fn(*args, **kwargs)
            if name == "linear":
                self._push(self.linear_label.get(args[1].data_ptr(), self._context_label()))
            else:
                self._push(f"op:{OP_CLASS[name]}")
            try:
                return fn(*args, **kwargs)
            finally:
                self._pop()
        return wrapped

    def _context_label(self) -> str:
        """An unknown `linear` belongs to the class of the module it runs in."""
        label = self._labels[self._open[-1]] if self._open else ROOT
        return "op:other" if label == ROOT else f"op:{CONTEXT_CLASS[label[4:]]}"
