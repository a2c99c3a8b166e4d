"""Where this rank's tokens go, computed on the device by the family's counting sort (`_sort`):
tokens to ranks for the normal mode (and `EPBuffer.get_dispatch_layout`), (token, expert) pairs to
experts for the low-latency mode. Expert ids are -1 (none) or 0 ... num_experts - 1; rank r holds
experts r * E_local ... (r + 1) * E_local - 1, ranks counted in `ranks` (an `ops.ranks.Ranks`: the
world or a group)."""
import torch

from .. import _sort


def tokens_to_ranks(topk_idx: torch.Tensor, num_experts: int, ranks, order: torch.Tensor | None = None):
    """(positions int32 [T, world]: each token's row among those sent to each rank, -1 where not
    sent; routed int32 [world + num_experts]: tokens per rank, then pairs per expert). `order`
    ([world, T] int32), if given, gets each rank's tokens in place order."""
    world_size = ranks.world_size
    tokens = topk_idx.shape[0]
    positions = torch.empty((tokens, world_size), dtype=torch.int32, device=ranks.device)
    routed = torch.zeros(world_size + num_experts, dtype=torch.int32, device=ranks.device)  # `count` adds
    if tokens:
        _sort.sort(topk_idx, positions, routed, world_size, num_experts // world_size, one_group=False, order=order)
        _sort.count(topk_idx.view(-1), routed[world_size:], num_experts, 1)
    return positions, routed


def pairs_to_experts(topk_idx: torch.Tensor, num_experts: int, device: torch.device):
    """(positions int32 [T * topk]: each pair's row among this rank's pairs of its expert; routed
    int32 [num_experts]: pairs per expert)."""
    tokens = topk_idx.shape[0]
    positions = torch.empty(topk_idx.numel(), dtype=torch.int32, device=device)
    routed = (torch.empty if tokens else torch.zeros)(num_experts, dtype=torch.int32, device=device)
    if tokens:
        _sort.sort(topk_idx.view(-1), positions, routed, num_experts, 1, one_group=True)
    return positions, routed
