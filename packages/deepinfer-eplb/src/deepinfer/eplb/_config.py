"""Balancer configuration (frozen, with per-role presets) and the redundant-expert count."""

from __future__ import annotations

from dataclasses import dataclass

from ._inputs import non_negative_int, positive_int
from ._rebalance import _POLICIES, Policy


@dataclass(frozen=True, slots=True)
class EplbConfig:
    """How one role (prefill or decode) balances its experts.

    Fields:
        min_redundant_experts: floor on extra physical experts per layer; the actual count is the
            smallest number >= this floor that makes the slot count divisible by the EP size
            (`num_redundant_experts`).
        window_steps: loads are summed over the last `window_steps` recorded steps.
        rebalance_interval_steps: a new placement is computed every this many recorded steps.
        policy: "auto" (hierarchical when expert groups divide evenly over nodes), "hierarchical"
            or "global".
        min_improvement: a new placement is adopted only when it lowers the overall max / mean GPU
            load on the window's loads by more than this (absolute); 0.0 = any strict improvement.
            Moving expert weights costs time, so a placement that does not help is not applied.
    """

    min_redundant_experts: int = 0
    window_steps: int = 1000
    rebalance_interval_steps: int = 10000
    policy: Policy = "auto"
    min_improvement: float = 0.0

    def __post_init__(self) -> None:
        non_negative_int(self.min_redundant_experts, "min_redundant_experts")
        positive_int(self.window_steps, "window_steps")
        positive_int(self.rebalance_interval_steps, "rebalance_interval_steps")
        if self.policy not in _POLICIES:
            raise ValueError(f"policy={self.policy!r} must be one of {_POLICIES}")
        improvement = self.min_improvement
        if (
            isinstance(improvement, bool)
            or not isinstance(improvement, (int, float))
            or not (0.0 <= improvement < float("inf"))
        ):
            raise ValueError(f"min_improvement={improvement!r} must be a finite number >= 0")


# Prefill: smaller EP groups and bursty batches, so more spare slots and a short, frequent window;
# hierarchical keeps each expert group on one node. Decode: large EP, steadier traffic.
PREFILL_EPLB_CONFIG = EplbConfig(
    min_redundant_experts=4, window_steps=100, rebalance_interval_steps=1000, policy="auto"
)
DECODE_EPLB_CONFIG = EplbConfig(
    min_redundant_experts=1, window_steps=1000, rebalance_interval_steps=10000, policy="global"
)


def num_redundant_experts(num_logical_experts: int, ep_size: int, min_redundant_experts: int = 0) -> int:
    """Smallest r >= min_redundant_experts with (num_logical_experts + r) % ep_size == 0.

    Example: 256 experts on 64 GPUs with a floor of 4 -> 64 (320 slots, 5 per GPU).

    Args:
        num_logical_experts: experts per MoE layer, >= 1.
        ep_size: GPUs in the expert-parallel group, >= 1.
        min_redundant_experts: the configured floor, >= 0.
    Returns:
        The redundant (extra) physical experts per layer.
    Raises:
        ValueError: naming a field that is not an integer in range.
    """
    num_logical = positive_int(num_logical_experts, "num_logical_experts")
    ep_size = positive_int(ep_size, "ep_size")
    floor = non_negative_int(min_redundant_experts, "min_redundant_experts")
    return floor + (-(num_logical + floor)) % ep_size
