"""# 02. An all-gather within a node: push, then pull

Every rank holds a shard of `N` elements; after an all-gather every rank holds all of them, rank
`r`'s shard in row `r` of its output (`torch.distributed.all_gather_into_tensor`). Within a node
every rank can load and store its peers' symmetric memory, which leaves two ways to move the
data:

- **push**: each rank writes its shard into every peer's output, then tells the peer;
- **pull**: each rank publishes its shard in its own memory, and every peer reads it from there.

You will learn:

- the push pattern: stores through `dl.symm_at`, one flag per source, one wait for all of them;
- why calling a kernel again is the hard part: a fast rank's next call can overwrite what a slow
  peer is still reading, and the two fixes, a host barrier (push) and double buffering (pull);
- why an epoch that grows each call is all the "reset" signals need.

Run: `tridist run -n 3 tutorials/02-all-gather-push-pull.py`

Any number of ranks works, all on one node (tutorial 03 crosses nodes).
"""
import sys

import torch
import triton.language as tl

import tridist
import tridist.language as dl

N = 1000  # elements per shard (not a multiple of BLOCK: the masks matter)
BLOCK = 256  # elements a program moves per step
CALLS = 3


def shard(rank: int, call: int) -> torch.Tensor:
    """Rank `rank`'s shard in call `call`: the values say whose, which element and which call, so
    that data from the wrong rank, place or call cannot pass the check."""
    return call * 1e6 + rank * 1e3 + torch.arange(N, dtype=torch.float32)


def expected(world_size: int, call: int) -> torch.Tensor:
    return torch.stack([shard(r, call) for r in range(world_size)])


# %%
# ## Push
#
# One program per destination: program `p` stores this rank's shard into row `rank` of rank `p`'s
# `out` (its own row included, when `p` is this rank), then raises rank `p`'s flag `rank` to the
# call's epoch. Each rank's flags thus say which rows have arrived. The program for this rank's
# own row then waits until all `world_size` flags show the epoch: when the kernel ends, every row
# is in place.
#
# The epoch is a kernel argument that changes every call. Triton compiles a new kernel for
# integer arguments equal to 1 or divisible by 16 (it specialises them), which `do_not_specialize`
# turns off: one compiled kernel serves every call.
@tridist.jit(do_not_specialize=["epoch"])
def all_gather_push(shard_ptr, out_ptr, flags_ptr, n, epoch, BLOCK: tl.constexpr):
    me = dl.rank()
    peer = tl.program_id(0)
    row = dl.symm_at(out_ptr, peer) + me * n  # row `me` of the peer's out
    offsets = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        mask = start + offsets < n
        tl.store(row + start + offsets, tl.load(shard_ptr + start + offsets, mask=mask), mask=mask)
    dl.notify(flags_ptr + me, peer, signal=epoch)
    if peer == me:
        dl.wait(flags_ptr, dl.num_ranks(), scope="sys", waitValue=epoch)


# %%
# The peers write into `out`, so `out` must be symmetric. That is also the catch: in call `e + 1`
# a fast rank pushes into its peers' `out` while a slow peer may still be reading call `e`'s
# result there. Here a host barrier (`tridist.barrier_all`) before each call keeps the calls
# apart. The flags need no reset: each call waits for its own epoch, which no earlier call wrote.
def run_push(w) -> None:
    out = tridist.symm_empty((w.world_size, N), torch.float32)
    flags = tridist.signals(w.world_size)
    for call in range(1, CALLS + 1):
        out.fill_(float("nan"))  # poison: a row that never arrives cannot pass
        tridist.barrier_all()  # every rank has poisoned its out and checked the last call's
        all_gather_push[(w.world_size,)](shard(w.rank, call).to(w.device), out, flags, N, call, BLOCK=BLOCK)
        check(w, "push", call, out)
    tridist.barrier_all()


# %%
# ## Pull
#
# Each rank copies its shard into its own symmetric `staging` buffer and raises flag `rank` on
# every peer; program `p` waits for rank `p`'s flag and reads rank `p`'s staging through
# `dl.symm_at`. The output is a regular tensor: nobody writes into it but its owner.
#
# Now the hazard is the staging: in call `e + 1` a rank overwrites its staging while a slow peer
# may still be reading call `e`'s shard from it. Instead of a barrier, two staging slots and two
# sets of flags, used alternately (slot `epoch % 2`). When a rank starts call `e + 2`, which
# overwrites the slot of call `e`, it has finished call `e + 1`, which waited for every peer's
# flag of call `e + 1`: every peer had started call `e + 1`, so it had finished call `e` and all
# its reads. Two slots are enough, and no call waits for anything but data.
@tridist.jit(do_not_specialize=["epoch"])
def all_gather_pull(shard_ptr, out_ptr, staging_ptr, flags_ptr, n, epoch, BLOCK: tl.constexpr):
    me = dl.rank()
    world = dl.num_ranks()
    peer = tl.program_id(0)
    stage = staging_ptr + (epoch % 2) * n
    flags = flags_ptr + (epoch % 2) * world
    offsets = tl.arange(0, BLOCK)
    if peer == me:
        for start in range(0, n, BLOCK):
            mask = start + offsets < n
            data = tl.load(shard_ptr + start + offsets, mask=mask)
            tl.store(stage + start + offsets, data, mask=mask)
            tl.store(out_ptr + me * n + start + offsets, data, mask=mask)
        for step in range(1, world):
            dl.notify(flags + me, (me + step) % world, signal=epoch)
    else:
        token = dl.wait(flags + peer, 1, scope="sys", waitValue=epoch)
        source = dl.consume_token(dl.symm_at(stage, peer), token)
        for start in range(0, n, BLOCK):
            mask = start + offsets < n
            tl.store(out_ptr + peer * n + start + offsets, tl.load(source + start + offsets, mask=mask), mask=mask)


# %%
# The calls now run back to back with no host synchronisation at all; the results are checked
# once they are all done.
def run_pull(w) -> None:
    staging = tridist.symm_empty((2, N), torch.float32)
    flags = tridist.signals(2 * w.world_size)
    outs = [torch.full((w.world_size, N), float("nan"), device=w.device) for _ in range(CALLS)]
    for call in range(1, CALLS + 1):
        all_gather_pull[(w.world_size,)](shard(w.rank, call).to(w.device), outs[call - 1], staging, flags, N, call,
                                         BLOCK=BLOCK)
    for call in range(1, CALLS + 1):
        check(w, "pull", call, outs[call - 1])


def check(w, method: str, call: int, out: torch.Tensor) -> None:
    if not torch.equal(out.cpu(), expected(w.world_size, call)):
        wrong = [r for r in range(w.world_size) if not torch.equal(out[r].cpu(), shard(r, call))]
        sys.exit(f"rank {w.rank}: {method} call {call}: wrong rows from ranks {wrong}")


# %%
# The library's `tridist.ops.all_gather` works the same way, with the shard cut in slices that
# each get a flag (so that copying out overlaps sending), and more programs per peer.
def main():
    w = tridist.init()
    if w.nnodes > 1:
        sys.exit("this tutorial reaches its peers through dl.symm_at, on one node (tutorial 03 crosses nodes)")
    run_push(w)
    run_pull(w)
    print(f"rank {w.rank}: push and pull all-gathers of {w.world_size} ranks correct, {CALLS} calls each")
    tridist.finalize()


if __name__ == "__main__":
    main()
