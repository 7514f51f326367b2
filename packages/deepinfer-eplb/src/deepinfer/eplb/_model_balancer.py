"""Whole-model balancing: homogeneous MoE layers (same expert count) share one `ExpertBalancer`,
so one recorder and one placement call serve the whole stack; `ModelBalancer` steps them together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._balancer import ExpertBalancer, Rebalance, layer_id_of
from ._config import EplbConfig
from ._inputs import load_array, positive_int
from ._placement import ExpertPlacement


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """MoE layers that share one balancer: same number of logical experts."""

    num_logical_experts: int
    layer_ids: tuple[int, ...]  # model layer ids, ascending; row i of the group's arrays is layer_ids[i]


def group_moe_layers(num_experts_by_layer: Mapping[int, int]) -> tuple[LayerGroup, ...]:
    """Group MoE layers by expert count; groups are ordered by their first layer id.

    Args:
        num_experts_by_layer: model layer id (>= 0) -> logical experts of that layer (>= 1).
    Raises:
        ValueError: an empty mapping, a bad layer id or a bad expert count.
    """
    if not num_experts_by_layer:
        raise ValueError("num_experts_by_layer must name at least one MoE layer")
    by_count: dict[int, list[int]] = {}
    for layer, count in num_experts_by_layer.items():
        count = positive_int(count, f"num_experts_by_layer[{layer!r}]")
        by_count.setdefault(count, []).append(layer_id_of(layer))
    groups = [LayerGroup(count, tuple(sorted(layers))) for count, layers in by_count.items()]
    return tuple(sorted(groups, key=lambda group: group.layer_ids[0]))


class ModelBalancer:
    """One `ExpertBalancer` per group of homogeneous MoE layers of a model, stepped together."""

    def __init__(
        self,
        config: EplbConfig,
        num_experts_by_layer: Mapping[int, int],
        *,
        num_gpus: int,
        num_nodes: int = 1,
        num_expert_groups: int | Mapping[int, int] = 1,
        reduce_loads: Callable[[np.ndarray], Any] | None = None,
    ) -> None:
        """Args:
            config: the role's settings.
            num_experts_by_layer: MoE layer id -> logical experts of that layer.
            num_gpus, num_nodes: EP topology, as for ExpertBalancer.
            num_expert_groups: expert groups for every layer, or a mapping expert count -> groups.
            reduce_loads: passed to every group's ExpertBalancer (called once per group and
                rebalance, groups in order).
        Raises:
            ValueError: naming the bad field (also a group count missing from the mapping).
        """
        self._groups = group_moe_layers(num_experts_by_layer)
        self._balancers: list[ExpertBalancer] = []
        for group in self._groups:
            if isinstance(num_expert_groups, Mapping):
                if group.num_logical_experts not in num_expert_groups:
                    raise ValueError(
                        f"num_expert_groups has no entry for layers with {group.num_logical_experts} experts"
                    )
                groups = num_expert_groups[group.num_logical_experts]
            else:
                groups = num_expert_groups
            self._balancers.append(
                ExpertBalancer(
                    config,
                    layer_ids=group.layer_ids,
                    num_logical_experts=group.num_logical_experts,
                    num_gpus=num_gpus,
                    num_nodes=num_nodes,
                    num_expert_groups=groups,
                    reduce_loads=reduce_loads,
                )
            )
        self._row_of = {
            layer: (index, row)
            for index, group in enumerate(self._groups)
            for row, layer in enumerate(group.layer_ids)
        }

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        return self._groups

    @property
    def balancers(self) -> tuple[ExpertBalancer, ...]:
        """One per group, in the order of `groups`."""
        return tuple(self._balancers)

    def placement_of(self, layer_id: int) -> tuple[ExpertPlacement, int]:
        """(placement of the layer's group, the layer's row in it).

        Raises:
            ValueError: `layer_id` is not a registered MoE layer.
        """
        if layer_id not in self._row_of:
            raise ValueError(f"layer_id={layer_id!r} is not one of the MoE layers {sorted(self._row_of)}")
        index, row = self._row_of[layer_id]
        return self._balancers[index].placement, row

    def record(self, loads_by_layer: Mapping[int, Any]) -> tuple[Rebalance, ...]:
        """Record one step for every MoE layer; returns the changes adopted this step (often none).

        Args:
            loads_by_layer: every registered layer id -> its loads, [num_logical_experts] >= 0.
        Raises:
            ValueError: missing or unknown layers, or loads of the wrong shape or value.
        """
        if set(loads_by_layer) != set(self._row_of):
            missing = sorted(set(self._row_of) - set(loads_by_layer))
            unknown = sorted(set(loads_by_layer) - set(self._row_of), key=repr)
            raise ValueError(
                f"loads_by_layer must cover the MoE layers exactly: missing {missing}, unknown {unknown}"
            )
        stacks = []  # validate every layer before recording any, so the groups stay in step
        for group in self._groups:
            rows = []
            for layer in group.layer_ids:
                row = load_array(loads_by_layer[layer], f"loads_by_layer[{layer}]", ndim=1)
                if row.shape != (group.num_logical_experts,):
                    raise ValueError(
                        f"loads_by_layer[{layer}] must have shape [{group.num_logical_experts}], "
                        f"got {list(row.shape)}"
                    )
                rows.append(row)
            stacks.append(np.stack(rows))
        changes = (balancer.record(stack) for balancer, stack in zip(self._balancers, stacks))
        return tuple(change for change in changes if change is not None)
