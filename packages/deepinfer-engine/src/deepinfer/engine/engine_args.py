"""EngineArgs: every knob of an engine instance, frozen and validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.sched import EngineType

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class InvalidEngineArgs(ValueError):
    """An engine argument is out of range; the message names the field and the allowed range."""


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Engine configuration.

    Attributes:
        model: model folder (config.json, model.safetensors, tokenizer.json); None = the embedded
            default model shipped with deepinfer-model.
        device: "cpu" or a CUDA device ("cuda", "cuda:1").
        dtype: compute / weight dtype: "float32", "bfloat16" or "float16".
        seed: seeds the sampler's shared generator (requests without their own seed).
        max_model_len: longest sequence (prompt + output); None = min(model limit, 4096).
        block_size: tokens per paged KV block; None = the smallest multiple of every compress ratio ≥ 64.
        num_kv_blocks: paged KV blocks (block 0 included); None = as many as the memory budget holds.
        kv_cache_memory_mb: budget of the cache (paged KV blocks + state slots) when num_kv_blocks is None
            (CPU, or CUDA without gpu_memory_utilization).
        gpu_memory_utilization: on CUDA, size the cache so that weights + cache take this fraction of the
            GPU's memory (activations come out of the rest; None = use kv_cache_memory_mb).
        max_num_seqs: sequences holding cache at once (one state slot each, × the slot ratio).
        max_num_batched_tokens: prefill tokens per step; longer prompts are chunked.
        max_num_prompts: sequences per prefill step; None = max_num_seqs.
        prefill_max_sum_seqlen_k: bound on the summed K lengths of one prefill step; None = none.
        chunk_checkpoints: token positions where a chunk may be cut (empty = anywhere).
        stop_preempted_request: finish a preempted request as "preempted" (True) or recompute it.
        engine_type: NORMAL / PROMPT / COMPLETION.
        kv_quant: official FP8/FP4 fake-quantisation of cached KV (off = transformers' numerics).
        expert_dtype: keep the routed experts quantised in memory: "fp8" (e4m3 with float32 block
            scales: half of bf16's bytes) or "fp4" (MXFP4: about a quarter); as stored when the
            checkpoint has them so, else quantised on load; None = the model dtype. Needs the hidden
            and expert sizes divisible by the FP8 block (the checkpoint's, else 128) / by 32.
        enforce_eager: never capture CUDA graphs (decode on CUDA replays graphs keyed by batch size otherwise).
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_mb: float = 256.0
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_num_prompts: int | None = None
    prefill_max_sum_seqlen_k: int | None = None
    chunk_checkpoints: tuple[int, ...] = ()
    stop_preempted_request: bool = True
    engine_type: EngineType = EngineType.NORMAL
    kv_quant: bool = False
    expert_dtype: str | None = None
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            _fail(f"model={self.model!r} must be a folder path (str) or None")
        if self.dtype not in DTYPES:
            _fail(f"dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            _fail(f"device={self.device!r} must be 'cpu' or 'cuda[:N]'")
        if device.type not in ("cpu", "cuda"):
            _fail(f"device={self.device!r} must be 'cpu' or 'cuda[:N]'")
        _int("seed", self.seed, 0, 2**63 - 1)
        for name in ("max_model_len", "block_size", "num_kv_blocks", "max_num_prompts", "prefill_max_sum_seqlen_k"):
            value = getattr(self, name)
            if value is not None:
                _int(name, value, 2 if name == "num_kv_blocks" else 1, 2**31 - 1)
        _int("max_num_seqs", self.max_num_seqs, 1, 2**20)
        _int("max_num_batched_tokens", self.max_num_batched_tokens, 1, 2**31 - 1)
        if not (isinstance(self.kv_cache_memory_mb, int | float) and self.kv_cache_memory_mb > 0):
            _fail(f"kv_cache_memory_mb={self.kv_cache_memory_mb!r} must be > 0")
        util = self.gpu_memory_utilization
        if util is not None and not (isinstance(util, int | float) and 0 < util < 1):
            _fail(f"gpu_memory_utilization={util!r} must be in (0, 1)")
        if not isinstance(self.chunk_checkpoints, tuple):
            _fail(f"chunk_checkpoints={self.chunk_checkpoints!r} must be a tuple of positions")
        if self.expert_dtype not in (None, "fp8", "fp4"):
            _fail(f"expert_dtype={self.expert_dtype!r} must be None, 'fp8' or 'fp4'")
        for name in ("stop_preempted_request", "kv_quant", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name}={getattr(self, name)!r} must be a bool")
        if not isinstance(self.engine_type, EngineType):
            _fail(f"engine_type={self.engine_type!r} must be an EngineType (NORMAL, PROMPT or COMPLETION)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _fail(message: str) -> None:
    raise InvalidEngineArgs(message)


def _int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        _fail(f"{name}={value!r} must be an integer in [{low}, {high}]")
