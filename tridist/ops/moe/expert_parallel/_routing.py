"""Where this rank's tokens go, computed on the device by the family's counting sort (`_sort`):
tokens to ranks for the normal mode (and `EPBuffer.get_dispatch_layout`), (token, expert) pairs to
experts for the low-latency mode. Expert ids are -1 (none) or 0 ... num_experts - 1; rank r holds
experts r * E_local ... (r + 1) * E_local - 1."""
import torch

import tridist

from .. import _sort


def tokens_to_ranks(topk_idx: torch.Tensor, num_experts: int, order: torch.Tensor | None = None):
    """(positions int32 [T, world]: each token's row among those sent to each rank, -1 where not
    sent; routed int32 [world + num_experts]: tokens per rank, then pairs per expert). `order`
    ([world, T] int32), if given, gets each rank's tokens in place order."""
    w = tridist.world()
    tokens = topk_idx.shape[0]
    positions = torch.empty((tokens, w.world_size), dtype=torch.int32, device=w.device)
    routed = torch.zeros(w.world_size + num_experts, dtype=torch.int32, device=w.device)  # `count` adds
    if tokens:
        _sort.sort(topk_idx, positions, routed, w.world_size, num_experts // w.world_size, one_group=False,
                   order=order)
        _sort.count(topk_idx.view(-1), routed[w.world_size:], num_experts, 1)
    return positions, routed


def pairs_to_experts(topk_idx: torch.Tensor, num_experts: int):
    """(positions int32 [T * topk]: each pair's row among this rank's pairs of its expert; routed
    int32 [num_experts]: pairs per expert)."""
    w = tridist.world()
    tokens = topk_idx.shape[0]
    positions = torch.empty(topk_idx.numel(), dtype=torch.int32, device=w.device)
    routed = (torch.empty if tokens else torch.zeros)(num_experts, dtype=torch.int32, device=w.device)
    if tokens:
        _sort.sort(topk_idx.view(-1), positions, routed, num_experts, 1, one_group=True)
    return positions, routed
