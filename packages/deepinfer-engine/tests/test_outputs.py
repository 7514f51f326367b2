from __future__ import annotations

import pytest

from deepinfer.engine.outputs import (
    FINISH_IGNORED,
    FINISH_REASONS,
    FINISH_STOP,
    CompletionOutput,
    InvalidOutput,
    RequestOutput,
)


def test_finish_reason_vocabulary() -> None:
    assert FINISH_REASONS == {"stop", "length", "abort", "preempted", "ignored", "error", "prefilled"}


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
