"""# 03. An all-gather across nodes: puts with signals

Tutorial 02 moved data with loads and stores through `dl.symm_at`, which only reaches the GPUs of
one node. Between nodes there is a network, and data crosses it as one-sided *puts*:
`dl.shmem.putmem_signal` copies bytes into a peer's symmetric memory and then raises a signal
word there, in that order, so the receiver waits for the signal and reads. This is NVSHMEM's
put-with-signal (over InfiniBand or RoCE between nodes, NVLink within one).

No cluster is needed to write such code: *virtual nodes* split the ranks of one machine into
groups that tridist treats as separate nodes. `tridist run -n 4 --nnodes 2` makes two nodes of
two ranks: ranks 0 and 1 form node 0, ranks 2 and 3 node 1. In the emulator a `dl.symm_at` or a
`dl.notify` from node 0 to node 1 is then an error, as it would be on a real cluster, so the
inter-node code paths get tested on a laptop.

You will learn:

- `dl.shmem.putmem_signal_block`: a put whose signal is raised once the data has landed, issued
  by the whole program;
- `dl.shmem.signal_wait_until`, the OpenSHMEM-style wait;
- the hierarchical all-gather: each shard crosses to every other node once, and is forwarded
  within the node by the rank that received it.

Run: `tridist run -n 4 --nnodes 2 tutorials/03-all-gather-across-nodes.py`

Any number of ranks and nodes works (with `--nnodes` dividing `-n`).
"""
import sys

import torch
import triton
import triton.language as tl

import tridist
import tridist.language as dl

N = 512  # elements per shard
BLOCK = 256
CALLS = 2


def shard(rank: int, call: int) -> torch.Tensor:
    return call * 1e6 + rank * 1e3 + torch.arange(N, dtype=torch.float32)


# %%
# ## A put to every rank
#
# The simplest all-gather across nodes: program `p` puts this rank's shard into row `rank` of
# rank `p`'s `out` with the signal attached: `flags[rank]` on rank `p` becomes the call's epoch
# once the data is there. The `_block` form is issued by every thread of the program together,
# the fast form for a large transfer; NVSHMEM picks the path (NVLink within a node, the network
# across).
#
# What a put reads must itself be symmetric memory when it crosses nodes (the network card reads
# only memory NVSHMEM registered), so the host first copies the shard into its own row of `out`
# and the puts send from there. A rank's own row is then in place: it raises its own flag, and
# waits for all of them.
@tridist.jit(do_not_specialize=["epoch"])
def all_gather_puts(out_ptr, flags_ptr, n, epoch):
    me = dl.rank()
    peer = tl.program_id(0)
    row = out_ptr + me * n
    if peer == me:
        dl.notify(flags_ptr + me, me, signal=epoch)
        for source in range(dl.num_ranks()):
            dl.shmem.signal_wait_until(flags_ptr + source, dl.shmem.CMP_EQ, epoch)
    else:
        dl.shmem.putmem_signal_block(row, row, n * 4, flags_ptr + me, epoch, dl.shmem.SIGNAL_SET, peer)


# %%
# That sends every shard over the network once per rank of every other node. With `L` ranks per
# node, the same bytes cross between two nodes `L` times.
#
# ## One put per node
#
# The hierarchical version sends each shard to one rank of every other node, the one with the
# same local index (its *counterpart*), which forwards it to the other ranks of its node with
# stores through `dl.symm_at`. With `L` ranks per node and `K` nodes, the grid has one program per
# task:
#
# - `L` local tasks: store the shard into row `rank` of each rank of this node, raise its flag;
# - `K - 1` put tasks: put the shard to the counterpart on each other node, with the signal;
# - `K - 1` forward tasks: wait until the counterpart of each other node has put its shard here,
#   then store it into the other ranks of this node and raise their flags for it.
#
# Every flag is raised once per call, by whoever wrote the row. The first task then waits for all
# of them. Only the forward tasks wait before they write, and only for puts, which never wait,
# so there is no cycle; all programs of the grid must still be running at once (a handful here).
#
# `copy_row` is a device function: plain `triton.jit`, called from the kernel.
@triton.jit
def copy_row(source, dest, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        mask = start + offsets < n
        tl.store(dest + start + offsets, tl.load(source + start + offsets, mask=mask), mask=mask)


@tridist.jit(do_not_specialize=["epoch"])
def all_gather_2d(out_ptr, flags_ptr, n, epoch, local_world_size, BLOCK: tl.constexpr):
    me = dl.rank()
    world = dl.num_ranks()
    nodes = world // local_world_size
    node = me // local_world_size
    local = me % local_world_size
    task = tl.program_id(0)
    if task < local_world_size:  # store the shard into a rank of this node
        peer = node * local_world_size + task
        copy_row(out_ptr + me * n, dl.symm_at(out_ptr, peer) + me * n, n, BLOCK)
        dl.notify(flags_ptr + me, peer, signal=epoch)
    elif task < local_world_size + nodes - 1:  # one put per other node
        other = (node + 1 + task - local_world_size) % nodes
        row = out_ptr + me * n
        dl.shmem.putmem_signal_block(row, row, n * 4, flags_ptr + me, epoch, dl.shmem.SIGNAL_SET,
                                     other * local_world_size + local)
    else:  # forward a shard that came from another node
        other = (node + 1 + task - local_world_size - (nodes - 1)) % nodes
        source = other * local_world_size + local
        token = dl.wait(flags_ptr + source, 1, scope="sys", waitValue=epoch)
        row = dl.consume_token(out_ptr + source * n, token)
        for step in range(1, local_world_size):
            peer = node * local_world_size + (local + step) % local_world_size
            copy_row(row, dl.symm_at(out_ptr, peer) + source * n, n, BLOCK)
            dl.notify(flags_ptr + source, peer, signal=epoch)
    if task == 0:
        dl.wait(flags_ptr, world, scope="sys", waitValue=epoch)


# %%
# ## Running both
#
# As in tutorial 02's push, peers write into `out`, so a host barrier keeps one call from
# overwriting rows a peer is still checking (double buffering would remove it). Try replacing
# the put task with `copy_row` through `dl.symm_at`: the emulator stops it, naming the rank on
# the other node. (To raise a flag on another node without data, `dl.notify` takes
# `comm_scope="inter_node"`.)
def run(w, kernel, grid, *extra, **constexprs) -> None:
    out = tridist.symm_empty((w.world_size, N), torch.float32)
    flags = tridist.signals(w.world_size)
    for call in range(1, CALLS + 1):
        out.fill_(float("nan"))
        out[w.rank].copy_(shard(w.rank, call))
        tridist.barrier_all()
        kernel[grid](out, flags, N, call, *extra, **constexprs)
        expected = torch.stack([shard(r, call) for r in range(w.world_size)])
        if not torch.equal(out.cpu(), expected):
            sys.exit(f"rank {w.rank}: {kernel.__name__}, call {call}: wrong rows")
    tridist.barrier_all()
    tridist.symm_free(flags)
    tridist.symm_free(out)


def main():
    w = tridist.init()
    run(w, all_gather_puts, (w.world_size,))
    run(w, all_gather_2d, (w.local_world_size + 2 * (w.nnodes - 1),), w.local_world_size, BLOCK=BLOCK)
    print(f"rank {w.rank} (node {w.node} of {w.nnodes}): both all-gathers correct")
    tridist.finalize()


if __name__ == "__main__":
    main()
