"""deepinfer.eplb — expert-parallel load balancing for MoE models, usable on its own (numpy only).

`rebalance_experts` is a drop-in for DeepSeek's EPLB (same tuple signature and semantics). Around it:
`ExpertPlacement` (frozen, checked result), `place_experts` (the same placement, never worse than
round-robin), the redundant-expert count, a sliding-window load recorder, the balance metric
(max / mean GPU load), a fewest-moves plan from one placement to the next, and balancers that
rebalance homogeneous MoE layers every M steps. Torch tensors are accepted as input (converted via
numpy); torch is never imported.
"""

from importlib.metadata import version as _version

from ._balancer import ExpertBalancer, Rebalance
from ._config import DECODE_EPLB_CONFIG, PREFILL_EPLB_CONFIG, EplbConfig, num_redundant_experts
from ._metrics import balance_ratio, gpu_loads, overall_balance
from ._model_balancer import LayerGroup, ModelBalancer, group_moe_layers
from ._moves import MovePlan, plan_moves
from ._placement import ExpertPlacement, place_experts, round_robin_placement
from ._rebalance import rebalance_experts
from ._recorder import LoadRecorder

__version__ = _version("deepinfer-eplb")
__all__ = [
    "DECODE_EPLB_CONFIG",
    "PREFILL_EPLB_CONFIG",
    "EplbConfig",
    "ExpertBalancer",
    "ExpertPlacement",
    "LayerGroup",
    "LoadRecorder",
    "ModelBalancer",
    "MovePlan",
    "Rebalance",
    "balance_ratio",
    "gpu_loads",
    "group_moe_layers",
    "num_redundant_experts",
    "overall_balance",
    "place_experts",
    "plan_moves",
    "rebalance_experts",
    "round_robin_placement",
]
