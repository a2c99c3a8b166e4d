"""# 11. Process groups: a kernel within some of the ranks

So far every rank took part in everything: each allocation, each kernel's signals. A model
parallelised two ways at once splits the ranks into groups (tensor parallelism within pairs of
GPUs, data parallelism across the pairs), and each group runs its own collectives on its own data,
while the other groups do the same, at the same time, waiting for nothing outside.

tridist takes its groups from torch.distributed: `dist.new_group(ranks)`, or a DeviceMesh's
`mesh.get_group("tp")`. `tridist.init()` starts torch.distributed if the program has not (or joins
it if it has), so groups work the same under `tridist run` and torchrun, on GPUs and in the
emulator. Three things then take a group:

- **memory**: `tridist.symm_empty(shape, dtype, group=pg)` (and `symm_zeros`, `signals`) is
  allocated by the group's members only, at an offset they agree on among themselves; the other
  ranks take no part, and hold no copy;
- **the host**: `tridist.barrier_all(pg)` waits for the members only;
- **the kernel**: `tridist.group(pg)` is a `tridist.Group` that a kernel takes as an argument, and
  gives to the device functions: `dl.rank(g)` and `dl.num_ranks(g)` are this rank's index in the
  group and its size, and a peer is a rank of the group in `dl.symm_at(ptr, peer, g)`,
  `dl.notify(..., group=g)` and `dl.shmem`'s functions (their last argument).

You will learn:

- tutorial 02's push all-gather, written for a group: the same kernel with a group argument;
- running it in two groups at once, on different data, with no world-wide step in between;
- that the world is a group too: `tridist.group()` runs the same kernel on every rank;
- that a DeviceMesh's groups are groups like any other.

Run: `tridist run -n 4 tutorials/11-groups.py`

Any even number of ranks works, all on one node: the groups are the pairs (0, 1), (2, 3), ...
"""
import sys

import torch
import torch.distributed as dist
import triton.language as tl
from torch.distributed.device_mesh import init_device_mesh

import tridist
import tridist.language as dl

BLOCK = 256  # elements a program moves per step
CALLS = 3


def shard(group_id: int, rank: int, call: int, n: int) -> torch.Tensor:
    """World rank `rank`'s shard in call `call` of group `group_id`: the values say which group,
    whose, which element and which call."""
    return group_id * 1e6 + call * 1e5 + rank * 1e3 + torch.arange(n, dtype=torch.float32)


# %%
# ## The kernel
#
# Tutorial 02's push, with ranks counted in the group: program `p` stores this rank's shard into
# row `dl.rank(group)` of group rank `p`'s `out` and raises that rank's flag; the program of this
# rank then waits for as many flags as the group has members. `group` is a kernel argument like
# any other; the device functions translate group ranks into the world's (on GPUs NVSHMEM's PE
# numbers) with one load from the group's small table. A kernel that never passes a group is
# unchanged by all this: it compiles exactly as before.
@tridist.jit(do_not_specialize=["epoch"])
def all_gather_push(shard_ptr, out_ptr, flags_ptr, n, epoch, group, BLOCK: tl.constexpr):
    me = dl.rank(group)
    peer = tl.program_id(0)  # one program per member
    row = dl.symm_at(out_ptr, peer, group) + me * n  # row `me` of the member's out
    offsets = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        mask = start + offsets < n
        tl.store(row + start + offsets, tl.load(shard_ptr + start + offsets, mask=mask), mask=mask)
    dl.notify(flags_ptr + me, peer, signal=epoch, group=group)
    if peer == me:
        dl.wait(flags_ptr, dl.num_ranks(group), scope="sys", waitValue=epoch)


# %%
# ## Memory and calls within the group
#
# `out` and `flags` are allocated with `group=pg`: only the members allocate them, and they agree
# on their offset among themselves (a host exchange within the group: not while a CUDA graph is
# captured). As in tutorial 02 a barrier before each call keeps the calls apart, here the group's
# own. The result is checked against torch.distributed's all-gather within the same group.
def run(w, pg, group_id: int, n: int) -> int:
    g = tridist.group(pg)  # None: the world, as a group
    out = tridist.symm_empty((g.size, n), torch.float32, group=pg)
    flags = tridist.signals(g.size, group=pg)
    for call in range(1, CALLS + 1):
        x = shard(group_id, w.rank, call, n).to(w.device)
        out.fill_(float("nan"))  # poison: a row that never arrives cannot pass
        tridist.barrier_all(pg)  # every member has poisoned its out and checked the last call's
        all_gather_push[(g.size,)](x, out, flags, n, call, g, BLOCK=BLOCK)
        reference = [torch.empty_like(x) for _ in range(g.size)]
        dist.all_gather(reference, x, group=pg)
        if not torch.equal(out.cpu(), torch.stack(reference).cpu()):
            wrong = [g.ranks[i] for i in range(g.size) if not torch.equal(out[i].cpu(), reference[i].cpu())]
            sys.exit(f"rank {w.rank}: group {list(g.ranks)}, call {call}: wrong rows from ranks {wrong}")
    tridist.barrier_all(pg)
    tridist.symm_free(flags)
    tridist.symm_free(out)
    return g.size


# %%
# ## Two groups at once
#
# Every rank creates every group (torch.distributed's rule: `new_group` is called by all ranks, in
# the same order), then uses its own. The pairs run at the same time on different data and even
# different sizes; nothing waits across pairs until the world's barrier at the end. Then the same
# kernel runs on the world, `tridist.group()`.
#
# A DeviceMesh gives groups the same way, on the world's device type (`w.device.type`: "cuda" on
# GPUs, "cpu" in the emulator): a mesh of pairs, `init_device_mesh(w.device.type, (n // 2, 2),
# mesh_dim_names=("dp", "tp"))`, has the pairs above as `mesh.get_group("tp")` and, across them,
# `mesh.get_group("dp")` (ranks 0 and 2, 1 and 3 of 4 ranks), which runs the kernel last. A group
# whose members are on different nodes (`g.is_one_node` false) moves data with
# `dl.shmem.putmem_signal_block(..., pe, group)`, as tutorial 03 does for the world.
def main():
    w = tridist.init()
    if w.nnodes > 1 or w.world_size % 2:
        sys.exit("this tutorial pairs the ranks of one node: run an even number of ranks without --nnodes")
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(w.world_size // 2)]
    mine = w.rank // 2
    size = run(w, pairs[mine], group_id=mine, n=1000 + 100 * mine)
    tridist.barrier_all()
    everyone = run(w, None, group_id=99, n=500)
    mesh = init_device_mesh(w.device.type, (w.world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    across = run(w, mesh.get_group("dp"), group_id=100 + w.rank % 2, n=700)
    print(f"rank {w.rank}: all-gathers within group {list(tridist.group(pairs[mine]).ranks)} ({size} ranks), "
          f"the world ({everyone} ranks) and the mesh's dp group {list(tridist.group(mesh.get_group('dp')).ranks)} "
          f"({across} ranks) correct, {CALLS} calls each")
    tridist.finalize()


if __name__ == "__main__":
    main()
