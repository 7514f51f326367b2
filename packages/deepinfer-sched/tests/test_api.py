"""Public surface: exports, config validation, argument errors, engine types."""

from __future__ import annotations

import importlib.metadata

import pytest

import deepinfer.sched as sched_pkg
from deepinfer.cache import BlockManager
from deepinfer.sched import (
    ConfigError,
    EngineType,
    FinishReason,
    Scheduler,
    SchedulerConfig,
    SeqStatus,
    StepKind,
)


def test_all_exports_exist_and_version_is_set() -> None:
    for name in sched_pkg.__all__:
        assert hasattr(sched_pkg, name), name
    assert sched_pkg.__version__ == importlib.metadata.version("deepinfer-sched")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(block_size=0), r"block_size=0 out of range: must be in \[1, "),
        (dict(max_model_len=-3), r"max_model_len=-3 out of range"),
        (dict(max_num_seqs=True), r"max_num_seqs must be an int"),
        (dict(max_num_batched_tokens=0), r"max_num_batched_tokens=0 out of range"),
        (dict(max_num_prompts=0), r"max_num_prompts=0 out of range"),
        (dict(prefill_max_sum_seqlen_k=63), r"prefill_max_sum_seqlen_k=63 out of range: must be in \[64, "),
        (dict(nextn=65), r"nextn=65 out of range: must be in \[0, 64\]"),
        (dict(chunk_checkpoints=(8, 8)), r"chunk_checkpoints\[1\]=8 out of range: must be in \[9, "),
        (dict(chunk_checkpoints=[8]), r"chunk_checkpoints must be a tuple"),
        (dict(prefill_attempt_interval=0), r"prefill_attempt_interval=0 out of range"),
        (dict(prefill_any_attempt_interval=0), r"prefill_any_attempt_interval=0 out of range"),
        (dict(max_cache_usage_for_prefill=1.5), r"max_cache_usage_for_prefill=1.5 out of range: must be in \[0, 1\]"),
        (dict(engine_type="normal"), r"engine_type='normal' must be an EngineType"),
        (dict(engine_type=EngineType.COMPLETION, stop_preempted_request=False),
         r"stop_preempted_request=False \(recompute\) is not allowed with engine_type=COMPLETION"),
    ],
)
def test_config_errors_name_the_field_and_range(fields, message) -> None:
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(**{"block_size": 4, "max_model_len": 64, **fields})


def test_config_derived_values() -> None:
    config = SchedulerConfig(block_size=4, max_model_len=64, nextn=2, max_num_seqs=5)
    assert config.max_query_len == 3
    assert config.max_blocks_per_seq == 18          # ceil((64 + 2 * 3) / 4)
    assert config.prompt_limit == 5
    with pytest.raises(AttributeError):
        config.nextn = 1                            # frozen


def test_argument_errors(make_sched) -> None:
    sched = make_sched()
    with pytest.raises(ValueError, match="must not start with '_'"):
        sched.add_seq("_x", [1], 4)
    with pytest.raises(ValueError, match="non-empty str"):
        sched.add_seq("", [1], 4)
    with pytest.raises(ValueError, match="max_tokens=0 must be an int >= 1"):
        sched.add_seq("x", [1], 0)
    with pytest.raises(ValueError, match=r"token id -1, outside \[0, 2147483648\)"):
        sched.add_seq("x", [1, -1], 4)
    with pytest.raises(ValueError, match="1-D sequence of ints"):
        sched.add_seq("x", [1.5], 4)
    sched.add_seq("x", (t for t in [1, 2]), 4)          # any iterable of ints
    with pytest.raises(ValueError, match="already a live sequence"):
        sched.add_seq("x", [1], 4)
    with pytest.raises(KeyError, match="'y' is not a live sequence"):
        sched.abort_seq("y")
    with pytest.raises(ValueError, match="preemption is the scheduler's decision"):
        sched.finish_seq("x", FinishReason.PREEMPTED)
    with pytest.raises(ValueError, match="no step in flight"):
        sched.append_tokens("x", [1])
    sched.schedule()
    with pytest.raises(ValueError, match="takes exactly 1 token"):
        sched.append_tokens("x", [1, 2])
    with pytest.raises(ValueError, match="BlockManager"):
        Scheduler(sched.config, object(), BlockManager(3))


def test_get_seq_views_and_counts(make_sched) -> None:
    sched = make_sched(max_num_batched_tokens=4)
    sched.add_seq("a", [1, 2, 3, 4, 5, 6], 9)
    sched.add_seq("b", [7], 9)
    assert (sched.num_waiting, sched.num_running) == (2, 0)
    sched.schedule()                                    # a: 4 of 6 tokens
    view = sched.get_seq("a")
    assert view.status is SeqStatus.PREFILLING and view.num_computed_tokens == 4
    assert view.prompt_token_ids == (1, 2, 3, 4, 5, 6) and view.max_tokens == 9
    assert sched.get_seq("b").block_ids == () and sched.get_seq("b").state_slot == 0
    assert (sched.num_waiting, sched.num_running) == (2, 0)
    sched.schedule()                                    # a's last 2 tokens, then b
    assert (sched.num_waiting, sched.num_running) == (0, 2)


def test_prompt_engine_only_prefills(make_sched) -> None:
    sched = make_sched(engine_type=EngineType.PROMPT)
    sched.add_seq("a", [1, 2], 4)
    out = sched.schedule()
    assert out.kind is StepKind.PREFILL
    sched.append_tokens("a", [3])
    assert sched.schedule().kind is StepKind.IDLE       # never decodes; the engine hands a off
    sched.add_seq("b", [1], 4)
    assert sched.schedule().kind is StepKind.PREFILL


def test_completion_engine_decodes_prefilled_sequences(make_sched) -> None:
    sched = make_sched(engine_type=EngineType.COMPLETION, max_num_seqs=2)
    with pytest.raises(ValueError, match="cannot prefill"):
        sched.add_seq("a", [1], 4)
    admitted = sched.add_prefilled_seq("a", [1, 2, 3, 4, 5], 40, 8)
    assert admitted.block_table.tolist() == [1, 2] and admitted.state_slot == 1
    assert sched.add_prefilled_seq("b", [1] * 4, 41, 8).block_table.tolist() == [3]
    assert sched.add_prefilled_seq("c", [1], 42, 8) is None      # max_num_seqs reached
    out = sched.schedule()
    assert out.kind is StepKind.DECODE and out.zero_states.tolist() == []   # state was transferred
    assert out.decode.seq_ids == ("a", "b") and out.decode.last_token_ids.tolist() == [40, 41]
    assert out.decode.seq_lens.tolist() == [6, 5]
    assert out.decode.block_tables.tolist() == [[1, 2], [3, 4]]
    sched.append_tokens("a", [50])
    assert sched.get_seq("a").output_token_ids == (40, 50)


def test_single_rank_waits_for_the_next_attempt_point_while_decoding(make_sched) -> None:
    sched = make_sched(prefill_attempt_interval=4, prefill_any_attempt_interval=10, max_model_len=256)
    sched.add_seq("a", [1], 100)
    kinds = []
    for index in range(7):
        if index == 2:
            sched.add_seq("b", [2], 100)               # arrives after decode step 1
        out = sched.schedule()
        kinds.append((out.kind, out.num_decode_steps))
        for chunk in out.prefill:
            sched.append_tokens(chunk.seq_id, [5])
        if out.decode is not None:
            for seq_id in out.decode.seq_ids:
                sched.append_tokens(seq_id, [5])
    # b waits through decode steps 1..3; step 4 is an ALL point, and this one rank is "all".
    assert kinds == [
        (StepKind.PREFILL, 0), (StepKind.DECODE, 1), (StepKind.DECODE, 2), (StepKind.DECODE, 3),
        (StepKind.DECODE, 4), (StepKind.PREFILL, 4), (StepKind.DECODE, 5),
    ]
