"""Periodic rebalancing of one stack of homogeneous MoE layers: record loads every step, re-place
experts every M steps, adopt the new placement only when it helps.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._config import EplbConfig, num_redundant_experts
from ._inputs import check_layout, load_array, positive_int
from ._metrics import balance_ratio, overall_balance
from ._moves import MovePlan, plan_moves
from ._placement import ExpertPlacement, place_experts, round_robin_placement
from ._rebalance import resolve_policy
from ._recorder import LoadRecorder


@dataclass(frozen=True, slots=True)
class Rebalance:
    """A placement change decided at `step`; install `moves.placement` after running `moves`."""

    step: int  # steps recorded when it was decided (a multiple of the interval unless manual)
    layer_ids: tuple[int, ...]  # model layer of each placement row
    moves: MovePlan
    balance_before: float  # overall max / mean GPU load on the window's loads, old placement
    balance_after: float  # the same for the new placement; < balance_before - min_improvement
    layer_balance_before: tuple[float, ...]  # per placement row: max / mean GPU load, old placement
    layer_balance_after: tuple[float, ...]   # the same for the new placement

    @property
    def placement(self) -> ExpertPlacement:
        return self.moves.placement


def layer_id_of(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"layer id {value!r} must be an integer >= 0")
    return int(value)


class ExpertBalancer:
    """Balances one stack of homogeneous MoE layers.

    Call `record(loads)` once per forward step; every `config.rebalance_interval_steps` steps it
    computes a placement from the last `config.window_steps` steps and returns a `Rebalance` when
    that placement beats the current one by more than `config.min_improvement`.
    """

    def __init__(
        self,
        config: EplbConfig,
        *,
        layer_ids: Sequence[int],
        num_logical_experts: int,
        num_gpus: int,
        num_nodes: int = 1,
        num_expert_groups: int = 1,
        initial_placement: ExpertPlacement | None = None,
        reduce_loads: Callable[[np.ndarray], Any] | None = None,
    ) -> None:
        """Args:
            config: the role's settings (e.g. PREFILL_EPLB_CONFIG).
            layer_ids: model layer ids of the stack, distinct, >= 0; row i = layer_ids[i].
            num_logical_experts: experts per layer.
            num_gpus: EP size; the slot count is num_logical_experts + num_redundant_experts(...).
            num_nodes: nodes; divides num_gpus.
            num_expert_groups: expert groups; for the hierarchical policy a multiple of num_nodes
                that divides num_logical_experts (the global policy ignores groups).
            initial_placement: what the GPUs hold at start; round-robin when None.
            reduce_loads: turns the window's loads [num_layers, num_logical_experts] float64 into
                the loads to place for, same shape (e.g. a sum over the ranks of an EP group whose
                ranks each record their own tokens, so every rank places for the same loads);
                None = the window's loads as they are.
        Raises:
            ValueError: naming the bad field; divisibility is checked here, at startup.
        """
        if not isinstance(config, EplbConfig):
            raise ValueError(f"config must be an EplbConfig, got {type(config).__name__}")
        self._config = config
        self._layer_ids = tuple(layer_id_of(layer) for layer in layer_ids)
        if not self._layer_ids or len(set(self._layer_ids)) != len(self._layer_ids):
            raise ValueError(f"layer_ids={list(self._layer_ids)} must be non-empty and distinct")
        self._num_logical = positive_int(num_logical_experts, "num_logical_experts")
        self._num_gpus = positive_int(num_gpus, "num_gpus")
        self._num_nodes = positive_int(num_nodes, "num_nodes")
        self._num_groups = positive_int(num_expert_groups, "num_expert_groups")
        hierarchical = resolve_policy(config.policy, self._num_groups, self._num_nodes) == "hierarchical"
        if hierarchical and self._num_logical % self._num_groups != 0:
            raise ValueError(
                f"num_expert_groups={self._num_groups} must divide num_logical_experts={self._num_logical}"
            )
        self._num_physical = self._num_logical + num_redundant_experts(
            self._num_logical, self._num_gpus, config.min_redundant_experts
        )
        check_layout(
            self._num_logical, self._num_physical, self._num_gpus, self._num_nodes, "num_physical_experts"
        )
        if initial_placement is None:
            initial_placement = round_robin_placement(
                len(self._layer_ids), self._num_logical, self._num_physical, self._num_gpus, self._num_nodes
            )
        self._check_initial(initial_placement)
        self._placement = initial_placement
        self._recorder = LoadRecorder(len(self._layer_ids), self._num_logical, config.window_steps)
        self._reduce_loads = reduce_loads

    def _check_initial(self, placement: ExpertPlacement) -> None:
        if not isinstance(placement, ExpertPlacement):
            raise ValueError(f"initial_placement must be an ExpertPlacement, got {type(placement).__name__}")
        expected = {
            "num_layers": len(self._layer_ids),
            "num_logical_experts": self._num_logical,
            "num_physical_experts": self._num_physical,
            "num_gpus": self._num_gpus,
            "num_nodes": self._num_nodes,
        }
        for name, value in expected.items():
            if getattr(placement, name) != value:
                raise ValueError(f"initial_placement.{name}={getattr(placement, name)} must be {value}")

    @property
    def config(self) -> EplbConfig:
        return self._config

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self._layer_ids

    @property
    def num_physical_experts(self) -> int:
        return self._num_physical

    @property
    def placement(self) -> ExpertPlacement:
        """The placement in force (the last adopted one)."""
        return self._placement

    @property
    def num_steps(self) -> int:
        return self._recorder.num_steps

    def window_loads(self) -> np.ndarray:
        """[num_layers, num_logical_experts] float64: loads summed over the current window."""
        return self._recorder.window_loads()

    def record(self, loads: Any) -> Rebalance | None:
        """Record one step's loads; on every rebalance_interval_steps-th step, try to rebalance.

        Args:
            loads: [len(layer_ids), num_logical_experts] finite loads >= 0 (numpy, torch, sequence).
        Returns:
            The adopted change, or None (not a rebalance step, or no worthwhile improvement).
        Raises:
            ValueError: `loads` of the wrong shape or with NaN / infinite / negative entries.
        """
        self._recorder.record(loads)
        if self._recorder.num_steps % self._config.rebalance_interval_steps != 0:
            return None
        return self.rebalance()

    def rebalance(self) -> Rebalance | None:
        """Place experts for the current window's loads (through `reduce_loads`) now; adopt and
        return the change if it helps.

        Returns None before the first recorded step or when the gain is not above min_improvement.
        """
        if self._recorder.num_steps == 0:
            return None
        loads = self._recorder.window_loads()
        if self._reduce_loads is not None:
            loads = load_array(self._reduce_loads(loads), "reduce_loads(window loads)", ndim=2)
            if loads.shape != (len(self._layer_ids), self._num_logical):
                raise ValueError(f"reduce_loads returned shape {list(loads.shape)}, expected "
                                 f"[{len(self._layer_ids)}, {self._num_logical}]")
        candidate = place_experts(
            loads,
            self._num_physical,
            num_gpus=self._num_gpus,
            num_nodes=self._num_nodes,
            num_expert_groups=self._num_groups,
            policy=self._config.policy,
        )
        before = overall_balance(self._placement, loads)
        after = overall_balance(candidate, loads)
        if not after < before - self._config.min_improvement:
            return None
        moves = plan_moves(self._placement, candidate)
        layer_before = tuple(balance_ratio(self._placement, loads).tolist())
        layer_after = tuple(balance_ratio(moves.placement, loads).tolist())
        self._placement = moves.placement
        return Rebalance(self._recorder.num_steps, self._layer_ids, moves, before, after, layer_before, layer_after)
