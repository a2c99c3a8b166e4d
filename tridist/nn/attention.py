"""Decode attention over a KV cache split by position across the ranks (`ops.flash_decode`), for
long contexts: each rank holds some of every sequence's cached positions (vLLM's paged layout or a
contiguous one) and the same queries, and every rank gets the attention over all of them. The ranks
are the world's, or with `group=` a process group's members."""
import torch
from torch import nn

from tridist import ops
from tridist.ops.ranks import ranks_of


class DecodeAttention(nn.Module):
    """softmax(q k^T * scale) v for one new token per sequence, over the positions every rank's
    cache holds (GQA: `num_heads / num_kv_heads` query heads share a KV head).

    Args:
        num_heads: query heads (Hq).
        head_dim: 64 or 128.
        num_kv_heads: KV heads (Hkv), dividing num_heads; num_heads by default.
        scale: of the scores; 1 / sqrt(head_dim) by default.
        group: a `torch.distributed.ProcessGroup` or `tridist.Group` whose members split the
            cache (they call the layer together; the other ranks take no part), None for the world.

    Raises:
        ValueError: num_heads not a multiple of num_kv_heads; a `group` this rank is not a member of.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int | None = None, scale: float | None = None, *,
                 group=None):
        super().__init__()
        self.group = ranks_of(group).group
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self.scale = head_dim ** -0.5 if scale is None else scale

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
                block_table: torch.Tensor | None = None) -> torch.Tensor:
        """q `[B, num_heads, head_dim]`, the same on every rank (of the group); this rank's cache, contiguous
        `[B, L, num_kv_heads, head_dim]` or paged `[num_blocks, block_size, num_kv_heads, head_dim]`
        with `block_table` int32 `[B, max_blocks]`; seqlens int32 `[B]`, the positions of each
        sequence this rank holds. Returns `[B, num_heads, head_dim]`, the same bits on every rank
        (limits and errors: `tridist.ops.FlashDecode.__call__`)."""
        if q.shape[1:] != (self.num_heads, self.head_dim) or k_cache.shape[2:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"q must be [B, {self.num_heads}, {self.head_dim}] and the caches [..., "
                             f"{self.num_kv_heads}, {self.head_dim}]; got q {tuple(q.shape)}, k_cache "
                             f"{tuple(k_cache.shape)}")
        return ops.flash_decode(q, k_cache, v_cache, seqlens, block_table, sm_scale=self.scale, group=self.group)

    def extra_repr(self) -> str:
        """The sizes, in the module's printout."""
        return f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
