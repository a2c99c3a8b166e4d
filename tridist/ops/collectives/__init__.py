"""Collectives: all-gather, reduce-scatter and all-reduce, each with methods for small and large
messages, one node and several.

| op | computes | methods |
| --- | --- | --- |
| `all_gather(x)`, `AllGather` | `torch.distributed.all_gather_into_tensor`; floats, integers, raw bytes | `ll`, `push`, `pull`, `ce`, `2d`, `ring`, `auto` |
| `reduce_scatter(x)`, `ReduceScatter` | `reduce_scatter_tensor`, sum, fp32 accumulation | `ll`, `one_shot`, `ce`, `2d`, `ring`, `auto` |
| `all_reduce(x)`, `all_reduce_(x)`, `AllReduce` | `all_reduce`, sum, fp32 accumulation; `all_reduce` returns a new tensor, `all_reduce_` sums in place | `ll`, `one_shot`, `two_shot`, `ce`, `auto` |

Each class's docstring says what its methods do and where they work; each op is a package
(`allgather`, `reducescatter`, `allreduce`) whose modules are its methods, each with its protocol,
and `policy` holds what `method="auto"` chooses. Common to all three:

- `group=` (classes and functions) runs the op within a process group (`dist.new_group(ranks)`,
  a DeviceMesh's `mesh.get_group("tp")`, or a `tridist.Group`): only its members call, ranks,
  sizes and nodes are the group's, and its buffers and call epochs are its own, so several groups
  run their calls at once without waiting on each other. None (the default) is the world.
- `programs=` (classes) caps the programs (blocks, so SMs) a call's kernels run; default one
  per SM.
- Reductions sum in fp32 whatever the input dtype and round once; they take bf16, fp16 and
  fp32.
- The copy-engine methods (`ce`, one node) move large messages without SMs driving NVLink: each
  rank's copy engines write its data into the peers' staging chunk by chunk, and a kernel
  consumes each chunk as its flag rises. They cost a barrier per call (one of the instance's
  own). On their own they are slower than the SM methods, so `auto` leaves them for callers
  that keep the SMs busy with other work, except into a symmetric `out` (all-gather).
"""
from .allgather import AllGather, all_gather
from .allreduce import AllReduce, all_reduce, all_reduce_
from .reducescatter import ReduceScatter, reduce_scatter

__all__ = ["AllGather", "all_gather", "AllReduce", "all_reduce", "all_reduce_", "ReduceScatter", "reduce_scatter"]
