"""Training-time helpers attached to transformers' DeepseekV4ForCausalLM with forward hooks.

* `IndexerDistillation`: the lightning indexer picks CSA entries with a top-k, so the language-model
  loss gives it no gradient. As in DeepSeek-V3.2's sparse-attention training, each CSA layer's indexer
  is fitted instead to its own attention: the target is the attention probability mass the layer's
  heads put on each compressed entry (summed over heads, renormalised over the entries the query may
  see), the prediction is the softmax of the indexer's scores over the same entries, and the loss is
  KL(target || prediction). The indexer's inputs are detached, so this loss trains the indexer alone.
  While `dense` is on, every causal entry is selected (the warm-up); afterwards the KL runs over the
  top-k selection only.
* `RouterBalance`: DeepSeek's auxiliary-loss-free balancing: after each optimiser step, every learned
  router's `e_score_correction_bias` moves by `rate` towards under-used experts (sign of mean − load).
* `init_hash_table`: a seeded random `tid2eid` (each token → `num_experts_per_tok` distinct experts);
  transformers leaves it all zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _csa_indexers(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    pairs = []
    for layer in model.model.layers:
        compressor = layer.self_attn.compressor
        if compressor is not None and hasattr(compressor, "indexer"):
            pairs.append((layer.self_attn, compressor.indexer))
    return pairs


class IndexerDistillation:
    """Collects, per CSA layer, the indexer scores [B, S, T], its picks [B, S, k] and the attention
    probabilities [B, H, S, S + T], and turns them into one KL loss per forward."""

    def __init__(self, model: nn.Module, top_k: int) -> None:
        self.top_k = top_k
        self.layers = _csa_indexers(model)
        if not self.layers:
            raise ValueError("the model has no compressed_sparse_attention layer")
        self._records: list[dict[str, Tensor]] = [{} for _ in self.layers]
        for slot, (attn, indexer) in enumerate(self.layers):
            indexer.register_forward_pre_hook(self._detach_inputs)
            indexer.scorer.register_forward_hook(self._keep("scores", slot))
            indexer.register_forward_hook(self._keep("picks", slot))
            attn.register_forward_hook(self._keep_attention(slot))
        self.dense = True

    @property
    def dense(self) -> bool:
        return self._dense

    @dense.setter
    def dense(self, value: bool) -> None:
        self._dense = value
        for _, indexer in self.layers:
            indexer.index_topk = 1 << 30 if value else self.top_k   # min(index_topk, entries) inside

    @staticmethod
    def _detach_inputs(module: nn.Module, args: tuple) -> tuple:
        return tuple(a.detach() if isinstance(a, Tensor) else a for a in args)

    def _keep(self, key: str, slot: int):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            if torch.is_grad_enabled():
                self._records[slot][key] = output
        return hook

    def _keep_attention(self, slot: int):
        def hook(module: nn.Module, args: tuple, output: tuple[Tensor, Tensor]) -> None:
            if torch.is_grad_enabled():
                self._records[slot]["probs"] = output[1].detach()
        return hook

    def loss(self) -> Tensor:
        """Mean over CSA layers of the per-query KL (queries that see no entry are skipped)."""
        total = None
        for record in self._records:
            scores, picks, probs = record["scores"].float(), record["picks"], record["probs"]
            num_entries = scores.shape[-1]
            chosen = torch.zeros(scores.shape[:2] + (num_entries + 1,), dtype=torch.bool, device=scores.device)
            chosen.scatter_(-1, torch.where(picks >= 0, picks, num_entries), True)
            chosen = chosen[..., :num_entries]                                      # [B, S, T]
            target = probs[..., -num_entries:].float().sum(dim=1) * chosen          # [B, S, T]
            mass = target.sum(dim=-1, keepdim=True)
            rows = (mass.squeeze(-1) > 0) & chosen.any(dim=-1)
            target = target / mass.clamp_min(1e-30)
            log_pred = F.log_softmax(scores.masked_fill(~chosen, float("-inf")), dim=-1).masked_fill(~chosen, 0.0)
            kl = (torch.xlogy(target, target) - target * log_pred).sum(dim=-1)     # [B, S]
            layer_loss = kl[rows].mean()
            total = layer_loss if total is None else total + layer_loss
        for record in self._records:
            record.clear()
        return total / len(self._records)


class RouterBalance:
    """Counts each learned router's expert picks during forward; `update()` nudges the biases."""

    def __init__(self, model: nn.Module, rate: float) -> None:
        self.rate = rate
        self.routers = [layer.mlp.gate for layer in model.model.layers if not layer.mlp.is_hash]
        self.loads = [torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers]
        for slot, router in enumerate(self.routers):
            router.register_forward_hook(self._count(slot))

    def _count(self, slot: int):
        def hook(module: nn.Module, args: tuple, output: tuple[Tensor, Tensor, Tensor]) -> None:
            if torch.is_grad_enabled():
                self.loads[slot] += torch.bincount(output[2].flatten(), minlength=module.num_experts).float()
        return hook

    @torch.no_grad()
    def update(self) -> list[float]:
        """Apply one bias step; returns each router's max/mean load ratio since the last update."""
        ratios = []
        for router, load in zip(self.routers, self.loads):
            router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            ratios.append(float(load.max() / load.mean().clamp_min(1.0)))
            load.zero_()
        return ratios


@torch.no_grad()
def init_hash_table(model: nn.Module, seed: int) -> None:
    """Fill every hash router's `tid2eid` [vocab, top_k] with distinct random experts per token."""
    gen = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        if layer.mlp.is_hash:
            table = layer.mlp.gate.tid2eid
            vocab, top_k = table.shape
            experts = torch.rand(vocab, layer.mlp.gate.num_experts, generator=gen).argsort(dim=-1)[:, :top_k]
            table.copy_(experts.to(table.device))
