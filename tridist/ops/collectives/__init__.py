"""Collectives: all-gather, reduce-scatter and all-reduce, each with methods for small and large
messages, one node and several."""
from .allgather import AllGather, all_gather
from .allreduce import AllReduce, ReduceScatter, all_reduce, reduce_scatter

__all__ = ["AllGather", "all_gather", "AllReduce", "all_reduce", "ReduceScatter", "reduce_scatter"]
