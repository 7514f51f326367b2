"""EngineArgs: every field's range is checked, with an error naming the field."""

from __future__ import annotations

import dataclasses
import math

import pytest

from deepinfer.engine.config.engine_args import (
    MAX_INT32,
    MAX_KV_CACHE_MEMORY_MB,
    EngineArgs,
    InvalidEngineArgs,
    allowed_values,
)
from deepinfer.sched import EngineType


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        (dict(kv_cache_memory_mb=0), "kv_cache_memory_mb", r"kv_cache_memory_mb=0 must be > 0 and <= 16777216"),
        (dict(kv_cache_memory_mb=-1.5), "kv_cache_memory_mb", r"kv_cache_memory_mb=-1.5 must be > 0"),
        (dict(kv_cache_memory_mb=math.inf), "kv_cache_memory_mb", r"kv_cache_memory_mb=inf must be > 0"),
        (dict(kv_cache_memory_mb=math.nan), "kv_cache_memory_mb", r"kv_cache_memory_mb=nan must be > 0"),
        (dict(kv_cache_memory_mb=MAX_KV_CACHE_MEMORY_MB + 1), "kv_cache_memory_mb", r"<= 16777216 \(MiB, 16 TiB\)"),
        (dict(kv_cache_memory_mb=True), "kv_cache_memory_mb", r"kv_cache_memory_mb=True must be"),
        (dict(chunk_checkpoints=(0,)), "chunk_checkpoints", r"chunk_checkpoints\[0\]=0 must be an integer in \[1, "),
        (dict(chunk_checkpoints=(8, 8)), "chunk_checkpoints",
         r"chunk_checkpoints\[1\]=8 must be > chunk_checkpoints\[0\]=8: positions are strictly increasing"),
        (dict(chunk_checkpoints=(16, 8)), "chunk_checkpoints", r"chunk_checkpoints\[1\]=8 must be >"),
        (dict(chunk_checkpoints=("8",)), "chunk_checkpoints", r"chunk_checkpoints\[0\]='8' must be an integer"),
        (dict(chunk_checkpoints=(True,)), "chunk_checkpoints", r"chunk_checkpoints\[0\]=True must be an integer"),
        (dict(chunk_checkpoints=(MAX_INT32 + 1,)), "chunk_checkpoints", r"in \[1, 2147483647\]"),
        (dict(chunk_checkpoints=[8]), "chunk_checkpoints", r"chunk_checkpoints=\[8\] must be a tuple"),
        (dict(device=0), "device", r"device=0 must be 'auto', 'cpu' or 'cuda\[:N\]' \(a str\)"),
        (dict(device="tpu"), "device", r"device='tpu' must be 'auto', 'cpu' or 'cuda\[:N\]'"),
        (dict(dtype=["float32"]), "dtype", r"dtype=\['float32'\] must be 'auto' or one of"),
        (dict(seed=-1), "seed", r"seed=-1 must be an integer in \[0, 9223372036854775807\]"),
        (dict(max_num_prompts=0), "max_num_prompts", r"max_num_prompts=0 must be an integer in \[1, 1048576\]"),
        (dict(max_num_prompts=2**20 + 1), "max_num_prompts", r"max_num_prompts=1048577 must be"),
        (dict(max_num_seqs=2.0), "max_num_seqs", r"max_num_seqs=2.0 must be an integer"),
        (dict(block_size=0), "block_size", r"block_size=0 must be an integer in \[1, "),
        (dict(num_kv_blocks=1), "num_kv_blocks", r"num_kv_blocks=1 must be an integer in \[2, "),
        (dict(max_model_len=MAX_INT32 + 1), "max_model_len", r"max_model_len=2147483648 must be"),
        (dict(gpu_memory_utilization=1.0), "gpu_memory_utilization", r"gpu_memory_utilization=1.0 must be in \(0, 1\)"),
        (dict(gpu_memory_utilization=True), "gpu_memory_utilization", r"gpu_memory_utilization=True must be"),
        (dict(kv_quant=1), "kv_quant", r"kv_quant=1 must be a bool"),
        (dict(engine_type="NORMAL"), "engine_type", r"engine_type='NORMAL' must be an EngineType"),
        (dict(expert_dtype="int4"), "expert_dtype", r"expert_dtype='int4' must be None, 'fp8' or 'fp4'"),
        (dict(max_cache_usage_for_prefill=1.5), "max_cache_usage_for_prefill",
         r"max_cache_usage_for_prefill=1.5 must be in \[0, 1\]"),
        (dict(max_cache_usage_for_prefill=math.nan), "max_cache_usage_for_prefill", r"=nan must be in \[0, 1\]"),
        (dict(max_cache_usage_for_prefill=True), "max_cache_usage_for_prefill", r"=True must be in \[0, 1\]"),
        (dict(yoco_prefill_truncation_mode="Compact"), "yoco_prefill_truncation_mode",
         r"yoco_prefill_truncation_mode='Compact' must be one of 'off', 'compact', 'mask'"),
        (dict(yoco_prefill_keep_tokens=0), "yoco_prefill_keep_tokens",
         r"yoco_prefill_keep_tokens=0 must be an integer in \[1, "),
        (dict(batch_invariant="1"), "batch_invariant", r"batch_invariant='1' must be a bool"),
    ],
)
def test_out_of_range_fields_are_named(kwargs: dict, field: str, message: str) -> None:
    with pytest.raises(InvalidEngineArgs, match=message) as caught:
        EngineArgs(**kwargs)
    assert caught.value.field == field


def test_the_edges_of_each_range_are_accepted() -> None:
    args = EngineArgs(kv_cache_memory_mb=MAX_KV_CACHE_MEMORY_MB, chunk_checkpoints=(1, 2, MAX_INT32), seed=2**63 - 1,
                      max_num_seqs=2**20, max_num_prompts=1, num_kv_blocks=2, gpu_memory_utilization=0.99,
                      engine_type=EngineType.PROMPT, expert_dtype="fp4", device="cuda:1")
    assert args.chunk_checkpoints == (1, 2, MAX_INT32)
    assert EngineArgs(kv_cache_memory_mb=64).kv_cache_memory_mb == 64


def test_every_field_has_allowed_values() -> None:
    for field in dataclasses.fields(EngineArgs):
        assert allowed_values(field.name)
    assert allowed_values("max_num_seqs") == "int in [1, 1048576]"
    assert allowed_values("max_model_len") == "int in [1, 2147483647], or None"
    assert allowed_values("engine_type") == "NORMAL, PROMPT, COMPLETION"
    with pytest.raises(KeyError):
        allowed_values("no_such_field")


def test_llm_engine_refuses_more_than_one_rank():
    """An LLMEngine is one rank: data_parallel_size > 1 goes through LLM(...), never silently one rank."""
    from deepinfer.engine import LLMEngine

    with pytest.raises(InvalidEngineArgs, match="data_parallel_size"):
        LLMEngine(EngineArgs(model=None, device="cpu", data_parallel_size=2, expert_parallel=True))


def test_the_prefill_admission_threshold_reaches_the_scheduler() -> None:
    from deepinfer.engine import LLMEngine

    engine = LLMEngine(EngineArgs(device="cpu", max_cache_usage_for_prefill=0.25, kv_cache_memory_mb=16))
    assert engine.scheduler.config.max_cache_usage_for_prefill == 0.25
    assert EngineArgs().max_cache_usage_for_prefill == 0.9 and EngineArgs(max_cache_usage_for_prefill=0)


def test_batch_invariance_refuses_varlen_verify() -> None:
    """Varlen verify picks each request's verify length from its batch: batch-invariant kernels refuse
    the pair at construction, naming both and the way out; all k drafts verified is fine."""
    message = r"varlen_verify=True with num_speculative_tokens=2 .* batch_invariant=True .* varlen_verify=False \(--no"
    with pytest.raises(InvalidEngineArgs, match=message) as caught:
        EngineArgs(num_speculative_tokens=2, batch_invariant=True)
    assert caught.value.field == "varlen_verify"
    assert EngineArgs(num_speculative_tokens=2, batch_invariant=True, varlen_verify=False).batch_invariant
    assert EngineArgs(batch_invariant=True).varlen_verify                  # no drafts: nothing to verify
