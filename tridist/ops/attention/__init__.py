"""Attention: decode attention over a KV cache split by position across the ranks (`flash_decode`):
a split-KV kernel over each rank's slice (`split_kv`), and the merge of its partial results and of
the ranks' (`combine`), both over the records of `_records`; the choices in `policy`. The ranks are
the world's, or with `group=` a process group's members (e.g. `flash_decode(q, k_cache, v_cache,
seqlens, group=sp)`: the cache split across the members of `sp`), each group merging its own. `decode_attention` is the same over this rank's cache alone, with no
peer: a tensor-parallel layer's attention over the heads a rank holds, or one GPU's.
`rotary_qkv` prepares a fused q, k, v projection for it (per-head norms, rotary, the cache write)."""
from .decode import FlashDecode, decode_attention, flash_decode
from .policy import configs
from .rotary import rotary_qkv

__all__ = ["FlashDecode", "decode_attention", "flash_decode", "configs", "rotary_qkv"]
