"""`CausalLM`: what the engine needs of a model, satisfied by `DeepseekV4ForCausalLM` and
`DeepseekV41ForCausalLM` (neither a subclass of the other); `DraftHead`: what a model needs of the
draft head attached to it (`DSparkDraft`). Both are structural (`typing.Protocol`): the models and
the draft head import neither this module's users nor each other."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet

from .batch import ForwardBatch
from .cache import CacheSpec, ModelCache, StateSpec
from .config import DeepseekV4Config
from .config_v41 import DeepseekV41Config


@runtime_checkable
class DraftHead(Protocol):
    """A draft head riding on a target model's forward (`DSparkDraft`)."""

    def state_specs(self, max_backtracking: int, dtype: torch.dtype) -> tuple[StateSpec, ...]:
        """The per-sequence state the head keeps in the target's cache (declared by `cache_spec`)."""
        ...

    def write_context(self, features: Tensor, batch: ForwardBatch, cache: ModelCache, ops: KernelSet) -> None:
        """Take the target's captured features [num_tokens, hidden · num_targets] of `batch`."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    """A DeepSeek-V4 or V4.1 model as the engine drives it.

    Attributes:
        cfg: the model's config.
        embed: the token embedding [vocab, hidden] (its weight tells the model's device and dtype).
        draft_weights: the checkpoint's draft-head (`mtp.*`) tensors, for `DSparkDraft`.
    """

    cfg: DeepseekV4Config | DeepseekV41Config
    embed: nn.Embedding
    draft_weights: dict[str, Tensor]

    def __call__(self, batch: ForwardBatch, cache: ModelCache, ops: KernelSet | None = None) -> Tensor:
        """One step over `batch`: logits [len(batch.logits_indices), vocab] float32."""
        ...

    def cache_spec(self, block_size: int, max_backtracking: int = 0, dtype: torch.dtype | None = None) -> CacheSpec:
        """The paged streams and per-sequence state one forward reads and writes."""
        ...

    def attach_draft(self, draft: DraftHead | None) -> None:
        """Attach a draft head (None detaches it)."""
        ...

    def state_dict(self) -> Mapping[str, Tensor]:
        """Every parameter and persistent buffer by name (`torch.nn.Module.state_dict`)."""
        ...
