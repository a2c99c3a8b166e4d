"""Attention: decode attention over a KV cache split by position across the ranks (`flash_decode`):
a split-KV kernel over each rank's slice (`split_kv`), and the merge of its partial results and of
the ranks' (`combine`)."""
from .decode import FlashDecode, configs, flash_decode

__all__ = ["FlashDecode", "flash_decode", "configs"]
