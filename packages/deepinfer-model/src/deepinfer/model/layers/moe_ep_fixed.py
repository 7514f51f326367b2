"""The fixed-capacity EP exchange of decode steps: static shapes, no host read, so a decode step's
MoE layers can be captured in a CUDA graph and launched under ZOS's sync guard.

`ExpertParallel.run` takes it for a decode step (`ForwardBatch.decode_step`) once the layer knows
its capacity (`ExpertParallel.max_decode_tokens`); prefill keeps the variable-split exchange of
`moe_ep`, which sends only the rows that exist. Every rank sends every peer (itself included) one
buffer of `capacity = max_decode_tokens × top_k` rows — the most (token, expert) pairs one rank can
route to one peer, duplicated experts in a hash layer's row included — whatever its batch holds:

  1. pick a physical slot per pair exactly as the variable path does (the same replica), so both
     paths give the same output;
  2. place each pair in its peer's buffer after the earlier pairs for that peer (a cumulative sum
     over a [pairs, ep_size] one-hot on the device: no sort, no split sizes on the host);
  3. scatter the rows and local slot ids into [ep_size × capacity] buffers (unused rows: zeros and
     slot 0) and exchange each with one `all_to_all_single` of equal splits;
  4. run the local experts over every received row: an unused row is zeros, and its result is never read;
  5. send the results back the same way and gather each pair's row from where it was placed.

The price of static shapes: each layer moves ep_size × capacity rows each way and the expert kernels
run over all of them, whatever the batch size (decode batches are small; prefill would pay far more,
so it keeps variable splits). Capacity is a bound the engine sets from its largest decode batch
(`max_num_seqs`, the largest decode CUDA graph); a decode step with more tokens is refused.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from deepinfer.kernels import KernelSet


class LocalExperts(Protocol):
    """This rank's expert slots (`moe.Experts`): rows [n, hidden], slot ids [n, k] int64 and weights
    [n, k] float32 -> [n, hidden]."""

    def __call__(self, x: Tensor, expert_ids: Tensor, weights: Tensor, limit: float, ops: KernelSet) -> Tensor: ...


def fixed_capacity_exchange(x: Tensor, slot: Tensor, weights: Tensor, experts: LocalExperts, limit: float,
                            ops: KernelSet, *, group: dist.ProcessGroup, max_decode_tokens: int | None, ep_size: int,
                            slots_per_rank: int) -> Tensor:
    """The routed experts' output for this rank's tokens, through the fixed-capacity exchange.

    Args:
        x: [num_tokens, hidden], num_tokens <= max_decode_tokens (0 for an idle rank).
        slot: [num_tokens × top_k] int64, the physical slot of each (token, k) pair, token-major.
        weights: [num_tokens, top_k] float32 routing weights.
        experts, limit, ops: this rank's expert slots, the SwiGLU clamp, the kernels.
        group, ep_size, slots_per_rank: the EP process group, its size and each rank's expert slots.
        max_decode_tokens: the layer's capacity (`ExpertParallel.max_decode_tokens`; the same on every
            rank); None refuses the step.
    Returns:
        [num_tokens, hidden] in x's dtype: each token's top-k expert rows summed with its weights.
    Raises:
        ValueError: more tokens than the capacity was sized for.
    """
    num_tokens, top_k = weights.shape
    hidden = x.shape[1]
    if max_decode_tokens is None or num_tokens > max_decode_tokens:
        raise ValueError(f"a decode step of {num_tokens} tokens; the fixed-capacity exchange holds "
                         f"{max_decode_tokens} per rank")
    capacity = max_decode_tokens * top_k
    size, per_rank = ep_size, slots_per_rank
    peer = slot // per_rank
    onehot = (peer[:, None] == torch.arange(size, device=x.device)).to(torch.int64)    # [pairs, size]
    earlier = (onehot.cumsum(0) - onehot).gather(1, peer[:, None]).squeeze(1)
    row = peer * capacity + earlier                      # the pair's row in the send buffer
    send_x = x.new_zeros(size * capacity, hidden)
    send_x.index_copy_(0, row, x[:, None, :].expand(num_tokens, top_k, hidden).reshape(-1, hidden))
    send_slot = torch.zeros(size * capacity, dtype=torch.int64, device=x.device)
    send_slot.index_copy_(0, row, slot % per_rank)
    recv_x, recv_slot = torch.empty_like(send_x), torch.empty_like(send_slot)
    dist.all_to_all_single(recv_slot, send_slot, group=group)
    dist.all_to_all_single(recv_x, send_x, group=group)
    unit = torch.ones(recv_x.shape[0], 1, dtype=torch.float32, device=x.device)
    y = experts(recv_x, recv_slot[:, None], unit, limit, ops)
    back = torch.empty_like(y)
    dist.all_to_all_single(back, y, group=group)
    per_pair = back.index_select(0, row).view(num_tokens, top_k, hidden) * weights.to(x.dtype)[..., None]
    return per_pair.sum(dim=1)
