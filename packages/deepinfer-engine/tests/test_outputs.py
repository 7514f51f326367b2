from __future__ import annotations

import json

import pytest

from deepinfer.cache import BlockManager
from deepinfer.engine.core.outputs import (
    FINISH_IGNORED,
    FINISH_REASONS,
    FINISH_STOP,
    CompletionOutput,
    InvalidOutput,
    RequestOutput,
)
from deepinfer.sched import FinishReason, Scheduler, SchedulerConfig


def test_finish_reason_vocabulary() -> None:
    assert FINISH_REASONS == {"stop", "length", "abort", "preempted", "ignored", "error", "prefilled"}


def test_finish_reasons_are_the_schedulers_type_and_read_as_strings() -> None:
    """One finish-reason type for sched and engine: the engine's constants are `FinishReason` members,
    which compare, hash, print and serialise as their plain values."""
    assert all(isinstance(reason, FinishReason) for reason in FINISH_REASONS)
    assert FINISH_STOP is FinishReason.STOP and FINISH_STOP == "stop" and "stop" in FINISH_REASONS
    assert str(FINISH_IGNORED) == f"{FINISH_IGNORED}" == "ignored"
    assert json.dumps({"finish_reason": FINISH_STOP}) == '{"finish_reason": "stop"}'
    assert CompletionOutput(0, "", [1], finish_reason="length").finish_reason == FinishReason.LENGTH


def test_the_scheduler_takes_the_engines_reasons_and_keeps_its_own() -> None:
    """finish_seq takes every reason the engine decides and refuses PREEMPTED / IGNORED (the scheduler's)."""
    for reason in FinishReason:
        sched = Scheduler(SchedulerConfig(max_num_seqs=2, block_size=16, max_model_len=64,
                                          max_num_batched_tokens=64), BlockManager(8),
                          BlockManager.for_state_slots(2, 1))
        sched.add_seq("a", [1, 2, 3], max_tokens=4)
        if reason in (FinishReason.PREEMPTED, FinishReason.IGNORED):
            with pytest.raises(ValueError, match="reason must be one of"):
                sched.finish_seq("a", reason)
        else:
            sched.finish_seq("a", reason)
            assert not sched.has_unfinished()


def test_running_and_finished_outputs() -> None:
    running = CompletionOutput(0, "he", [5, 6], logprobs=[{5: -0.1}, {6: -0.2, 7: -1.5}])
    done = CompletionOutput(1, "hi", [5, 9], finish_reason=FINISH_STOP, stop_reason="\n")
    assert not running.finished and done.finished
    assert not RequestOutput("r", "p", [1], [running, done], finished=False).finished
    ignored = CompletionOutput(0, "", [], finish_reason=FINISH_IGNORED, ignored_reason="prompt too long")
    assert RequestOutput("r", None, [1], [ignored], finished=True).outputs[0].ignored_reason


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"finish_reason": "done"}, r"finish_reason='done' must be None or one of abort, error, ignored"),
        ({"finish_reason": "error"}, r"error_reason=None must be set exactly when finish_reason is 'error'"),
        ({"finish_reason": "stop", "error_reason": "x"}, r"error_reason='x' must be set exactly"),
        ({"finish_reason": "ignored"}, r"ignored_reason=None must be set exactly when finish_reason"),
        ({"finish_reason": "length", "ignored_reason": "x"}, r"ignored_reason='x' must be set exactly"),
        ({"finish_reason": "length", "stop_reason": 3}, r"stop_reason=3 must be None unless"),
        ({"logprobs": [{1: 0.0}]}, r"len\(logprobs\)=1 must equal len\(token_ids\)=2"),
        ({"index": -1}, r"index=-1 must be >= 0"),
    ],
)
def test_completion_output_rejects_inconsistent_fields(kwargs: dict, message: str) -> None:
    fields = {"index": 0, "text": "ab", "token_ids": [1, 2], **kwargs}
    with pytest.raises(InvalidOutput, match=message):
        CompletionOutput(**fields)


def test_request_output_checks_indices_and_finished_flag() -> None:
    running = CompletionOutput(0, "", [])
    with pytest.raises(InvalidOutput, match=r"finished=True must equal whether every output"):
        RequestOutput("r", "p", [1], [running], finished=True)
    with pytest.raises(InvalidOutput, match=r"outputs\[0\].index=1 must be 0"):
        RequestOutput("r", "p", [1], [CompletionOutput(1, "", [])], finished=False)
    with pytest.raises(InvalidOutput, match="must hold at least one sample"):
        RequestOutput("r", "p", [1], [], finished=True)
