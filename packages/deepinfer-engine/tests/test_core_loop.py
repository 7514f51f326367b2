"""core_loop.run_loop: the one step loop of every front, over a scripted transport (the fronts
themselves are tested end to end by the offline, async, serve and DP tests)."""

from __future__ import annotations

from deepinfer.engine.frontends.core_loop import run_loop


class ScriptedTransport:
    """Work for `work[i]` rounds after the i-th idle, then ends after len(work) idles."""

    def __init__(self, work: list[int]) -> None:
        self.work, self.left = list(work), 0
        self.events: list[str] = []

    def poll(self) -> None:
        self.events.append("poll")

    def has_work(self) -> bool:
        return self.left > 0

    def deliver(self, outputs: list) -> None:
        self.events.append(f"deliver {outputs}")
        self.left -= 1

    def idle(self) -> bool:
        self.events.append("idle")
        if not self.work:
            return False
        self.left = self.work.pop(0)
        return True


def test_the_loop_polls_before_each_round_steps_while_there_is_work_and_ends_when_idle_says_so() -> None:
    steps = iter(range(100))
    transport = ScriptedTransport([2, 0, 1])
    run_loop(lambda: [next(steps)], transport)
    assert transport.events == [
        "poll", "idle",
        "poll", "deliver [0]", "poll", "deliver [1]", "poll", "idle",
        "poll", "idle",
        "poll", "deliver [2]", "poll", "idle",
    ]
