"""Process groups: allocations and kernels within a group (`tridist.group`, `group=`, `dl.*(..., g)`),
several groups at once, disjoint, strided, overlapping and across nodes, with the ranks outside a
group doing other work meanwhile. Payloads encode the group, the rank, the call and the index, and
are compared exactly."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import triton.language as tl

import tridist
import tridist.language as dl
from tridist.runtime import heap as heap_module
from tridist.runtime.world import heap

from .harness import backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def payload(group_id: int, rank: int, call: int, n: int) -> torch.Tensor:
    """What world rank `rank` sends in `call` within group `group_id`: every element says whose, where
    and when, so that a row from the wrong rank, group, place or call cannot pass."""
    return ((call * 16 + group_id) * 16 + rank) * 4096 + torch.arange(n, dtype=torch.int64)


@tridist.jit(do_not_specialize=["epoch"])
def group_allgather_kernel(shard_ptr, out_ptr, flags_ptr, n, epoch, group, ACROSS: tl.constexpr,
                           BLOCK: tl.constexpr):
    """Program p sends this rank's shard to row `rank(group)` of group rank p's out, then raises
    that rank's flag; the program of this rank then waits for every member's flag. Within a node
    through `symm_at` and `notify`, across nodes with a put with signal."""
    me = dl.rank(group)
    peer = tl.program_id(0)
    if ACROSS:
        dl.shmem.putmem_signal_block(out_ptr + me * n, shard_ptr, n * 8, flags_ptr + me, epoch, dl.shmem.SIGNAL_SET,
                                     peer, group)
    else:
        offsets = tl.arange(0, BLOCK)
        for start in range(0, n, BLOCK):
            mask = start + offsets < n
            data = tl.load(shard_ptr + start + offsets, mask=mask)
            tl.store(dl.symm_at(out_ptr + me * n + start + offsets, peer, group), data, mask=mask)
        dl.notify(flags_ptr + me, peer, signal=epoch, group=group)
    if peer == me:
        for source in range(dl.num_ranks(group)):
            dl.shmem.signal_wait_until(flags_ptr + source, dl.shmem.CMP_EQ, epoch)


@tridist.jit
def group_forms_kernel(words_ptr, counter_ptr, out_ptr, group):
    """The other `dl.shmem` forms with a group: identity, a typed put and get, a remote atomic and
    `ptr`. words[i] on each member is written by group rank i - 1 (a ring)."""
    me = dl.shmem.my_pe(group)
    size = dl.shmem.n_pes(group)
    tl.store(out_ptr, me)
    tl.store(out_ptr + 1, size)
    tl.store(out_ptr + 2, dl.rank())  # the world's rank, beside the group's
    dl.shmem.p(words_ptr + me, 1000 + me, (me + 1) % size, group)
    dl.shmem.atomic_inc(counter_ptr, 0, group)  # group rank 0's counter
    dl.shmem.quiet()
    tl.store(out_ptr + 3, (dl.shmem.ptr(words_ptr, me, group).to(tl.int64) == words_ptr.to(tl.int64)).to(tl.int64))


@tridist.jit
def group_get_kernel(words_ptr, out_ptr, group):
    """Group rank (me + 1)'s word `me`, read back with a get, and its whole row with getmem."""
    me = dl.rank(group)
    size = dl.num_ranks(group)
    tl.store(out_ptr, dl.shmem.g(words_ptr + me, (me + 1) % size, group))
    dl.shmem.getmem(out_ptr + 1, words_ptr, size * 8, (me + 1) % size, group)


def _allgather_in(g, group_id: int, n: int, calls: int, tag: str) -> None:
    """`calls` all-gathers within `g` (a Group), each checked exactly, with a barrier of the group only
    between calls: the ranks outside it are never waited for."""
    w = tridist.world()
    out = tridist.symm_empty((g.size, n), torch.int64, group=g, name=f"{tag} out")
    shard = tridist.symm_empty((n,), torch.int64, group=g.process_group, name=f"{tag} shard")
    flags = tridist.signals(g.size, group=g.process_group, name=f"{tag} flags")
    for call in range(1, calls + 1):
        out.fill_(-1)
        shard.copy_(payload(group_id, w.rank, call, n))
        tridist.barrier_all(g.process_group)  # every member has poisoned its out and checked the last call
        group_allgather_kernel[(g.size,)](shard, out, flags, n, call, g, ACROSS=not g.is_one_node, BLOCK=64)
        expected = torch.stack([payload(group_id, r, call, n) for r in g.ranks])
        assert torch.equal(out.cpu(), expected), (tag, call, out)
    tridist.barrier_all(g.process_group)
    for t in (flags, shard, out):
        tridist.symm_free(t)


# ---- disjoint groups, concurrently ------------------------------------------------------------------


def _disjoint_groups(w):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group (torch's rule)
    mine = w.rank // 2
    g = tridist.group(pairs[mine])
    assert (g.ranks, g.rank, g.size, g.key) == ((2 * mine, 2 * mine + 1), w.rank % 2, 2, (2 * mine, 2 * mine + 1))
    assert tridist.group(pairs[mine]) is g and g.is_one_node == (w.nnodes == 1)
    # Different data and a different number of calls in each group, and no world call in between:
    # a group that waited on the other's ranks would stop here.
    _allgather_in(g, group_id=mine, n=100 + 37 * mine, calls=2 + 3 * mine, tag=f"pair {mine}")
    tridist.barrier_all()


@pytest.mark.worlds("4")
def test_disjoint_groups_run_concurrently(world):
    world.run(_disjoint_groups)


# ---- a DeviceMesh: groups within nodes and strided ones across them ------------------------------------


def _mesh_groups(w):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(w.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = tridist.group(mesh.get_group("tp")), tridist.group(mesh.get_group("dp"))
    assert tp.ranks == (w.rank // 2 * 2, w.rank // 2 * 2 + 1) and dp.ranks == (w.rank % 2, w.rank % 2 + 2)
    assert dp.nodes == ((0, 1) if w.nnodes == 2 else (0, 0)) and dp.nnodes == w.nnodes
    assert (dp.local_rank, dp.local_size) == ((0, 1) if w.nnodes == 2 else (w.rank // 2, 2))
    assert (tp.local_rank, tp.local_size, tp.is_one_node) == (w.rank % 2, 2, True)
    # A rank in two groups: each group's allocations are agreed among its members, and this rank's
    # blocks never overlap.
    _allgather_in(tp, group_id=1 + w.rank // 2, n=70, calls=2, tag="tp")
    _allgather_in(dp, group_id=3 + w.rank % 2, n=50, calls=2, tag="dp")
    tridist.barrier_all()


@pytest.mark.worlds("4", "2x2")
def test_device_mesh_groups_strided_and_across_nodes(world):
    world.run(_mesh_groups)


# ---- a group beside a rank that does something else ---------------------------------------------------


def _group_beside_other_work(w):
    pair, alone = dist.new_group([0, 2]), dist.new_group([1])
    if w.rank == 1:
        # Not a member: its own world-of-one work meanwhile, allocations included, waiting for no one.
        g = tridist.group(alone)
        assert (g.ranks, g.rank, g.size) == ((1,), 0, 1)
        _allgather_in(g, group_id=7, n=33, calls=3, tag="alone")
        with pytest.raises(ValueError, match="rank 1 is not a member of this process group"):
            tridist.symm_empty((4,), torch.float32, group=pair)
    else:
        g = tridist.group(pair)
        assert (g.ranks, g.rank, g.size) == ((0, 2), w.rank // 2, 2)
        _allgather_in(g, group_id=5, n=90, calls=2, tag="pair")
    tridist.barrier_all()


@pytest.mark.worlds("3")
def test_group_beside_a_rank_doing_other_work(world):
    world.run(_group_beside_other_work)


# ---- overlapping groups: allocations agreed within each, frees, reuse -----------------------------


def _overlapping_allocations(w):
    # Each pair of ranks shares one group.
    made = {key: dist.new_group(list(key)) for key in ((0, 1), (1, 2), (0, 2))}
    world_before = tridist.symm_zeros((5,), torch.int32, name="world before")
    mine = {key: tridist.group(pg) for key, pg in made.items() if w.rank in key}
    held = {}
    for round_ in range(3):
        for key, g in mine.items():
            sizes = [(3 + round_ + i) * (1 + sum(key)) for i in range(2)]
            held[key, round_] = [tridist.symm_zeros((size,), torch.int64, group=g) for size in sizes]
            if round_ == 1:  # free one of round 0's: the next allocation may land in its place
                tridist.symm_free(held[key, 0].pop(0))
        world_between = tridist.symm_empty((7,), torch.float64, name=f"world {round_}")
        assert heap().offset_of(world_between) < heap().nbytes // 2, "world allocations grow from the bottom"
        tridist.symm_free(world_between)
    # This rank's blocks never overlap, and every member of a group found its tensors at the same offsets.
    spans = sorted((heap().offset_of(t), heap().offset_of(t) + t.numel() * 8) for ts in held.values() for t in ts)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans
    for key, g in mine.items():
        offsets = [heap().offset_of(t) for round_ in range(3) for t in held[key, round_]]
        everyone = g.allgather_objects(offsets)
        assert all(o == offsets for o in everyone), (key, everyone)
        # And the memory is the same allocation: each member writes its copy, the others read it.
        for index, t in enumerate(t for round_ in range(3) for t in held[key, round_]):
            t.copy_(payload(index, w.rank, 1, t.numel()))
        g.barrier()
        for index, t in enumerate(t for round_ in range(3) for t in held[key, round_]):
            for peer in range(g.size):
                assert torch.equal(tridist.peer_tensor(t, peer, g).cpu(), payload(index, g.ranks[peer], 1, t.numel()))
        g.barrier()
    for ts in held.values():
        for t in ts:
            tridist.symm_free(t)
    tridist.symm_free(world_before)


@pytest.mark.worlds("3")
def test_overlapping_groups_agree_on_offsets(world):
    world.run(_overlapping_allocations)


# ---- dl.shmem's forms with a group; the world as a group ------------------------------------------


def _shmem_forms(w, world_as_group: bool):
    # Not the world: ranks 1..n-1, whose group ranks are not their world ranks; rank 0 stays out.
    # (torch.distributed sorts a group's ranks: group order is world order.)
    pg = None if world_as_group else dist.new_group(list(range(1, w.world_size)))
    if not world_as_group and w.rank == 0:
        tridist.barrier_all()
        return
    g = tridist.group(pg)
    assert g.is_world == world_as_group
    words = tridist.symm_zeros((g.size,), torch.int64, group=pg)
    counter = tridist.symm_zeros((1,), torch.int64, group=pg)
    out = torch.full((4,), -1, dtype=torch.int64, device=w.device)
    group_forms_kernel[(1,)](words, counter, out, g)
    g.barrier()
    assert out.tolist() == [g.rank, g.size, w.rank, 1]
    previous = (g.rank - 1) % g.size
    assert words.tolist() == [1000 + previous if i == previous else 0 for i in range(g.size)]
    assert counter.item() == (g.size if g.rank == 0 else 0)
    got = tridist.symm_empty((1 + g.size,), torch.int64, group=pg)  # a get's local side: registered memory
    got.fill_(-1)
    group_get_kernel[(1,)](words, got, g)
    assert got.tolist() == [1000 + g.rank, *[1000 + g.rank if i == g.rank else 0 for i in range(g.size)]]
    g.barrier()
    for t in (got, counter, words):
        tridist.symm_free(t)
    tridist.barrier_all()


@pytest.mark.parametrize("world_as_group", [False, True])
@pytest.mark.worlds("3", "2x2")
def test_shmem_forms_in_a_group(world, world_as_group):
    world.run(_shmem_forms, world_as_group=world_as_group)


# ---- what a rank must not do ----------------------------------------------------------------------


@tridist.jit
def symm_at_kernel(x_ptr, peer, group):
    tl.store(dl.symm_at(x_ptr, peer, group), 1)


@tridist.jit
def symm_at_world_kernel(x_ptr, peer):
    tl.store(dl.symm_at(x_ptr, peer), 1)


def _bad_use(w):
    pair = dist.new_group([0, 1])
    if w.rank >= 2:  # not a member: told so, before anything is allocated or launched
        for call in (lambda: tridist.group(pair), lambda: tridist.signals(2, group=pair),
                     lambda: tridist.barrier_all(pair), lambda: tridist.symm_zeros((2,), group=pair)):
            with pytest.raises(ValueError, match=r"rank \d is not a member of this process group.*get_rank"):
                call()
    with pytest.raises(TypeError, match="torch.distributed.ProcessGroup"):
        tridist.symm_empty((2,), torch.float32, group=[0, 1])
    if w.rank < 2:
        g = tridist.group(pair)
        x = tridist.symm_zeros((4,), torch.int32, group=pair)
        mismatched = (4,) if w.rank == 0 else (5,)
        differ = r"group \[0, 1\].*\n  rank 0: allocation #(\d+): int32\[4\].*\n  rank 1: allocation #\1: int32\[5\]"
        with pytest.raises(tridist.SymmetricAllocationError, match=differ):
            tridist.symm_empty(mismatched, torch.int32, group=pair)
        with pytest.raises(IndexError, match="group rank 2, outside the group of 2 ranks"):
            symm_at_kernel[(1,)](x, 2, g)
        with pytest.raises(ValueError, match="not a group: pass the kernel a tridist.Group"):
            symm_at_kernel[(1,)](x, 1, x)
        no_copy = r"rank 2 of an address in allocation #\d+ of group \[0, 1\].*holds no copy"
        with pytest.raises(ValueError, match=no_copy):
            symm_at_world_kernel[(1,)](x, 2)
        with pytest.raises(ValueError, match=r"rank 3 holds no copy of this tensor: group \[0, 1\] allocated it"):
            tridist.peer_tensor(x, 3)
        tridist.symm_free(x)
    tridist.barrier_all()


@pytest.mark.worlds("4")
def test_bad_use_of_a_group(world):
    if world.backend != "emulator":
        pytest.skip("the device-side checks are the emulator's")
    world.run(_bad_use)


# ---- placement, on one rank: what the members propose ---------------------------------------------


class _Transport:
    def __init__(self, nbytes):
        self.heap = torch.zeros(nbytes, dtype=torch.uint8)

    def allgather_ints(self, values, group=None):
        return [tuple(values)]


def test_group_blocks_come_from_the_top_and_world_blocks_from_the_bottom():
    from tridist.runtime.groups import Group

    size = 64 << 10
    h = heap_module.SymmetricHeap(_Transport(size), 0, checked=True)
    top = size - size // 16  # a guard above the group blocks (heap._TOP_GUARD, at most a sixteenth)
    w = type("W", (), {"rank": 0, "world_size": 2, "device": torch.device("cpu"), "node_of": lambda self, r: 0})()
    g = Group((0,), None, w)
    first = h.allocate((1000,), torch.uint8, group=g)
    assert h.offset_of(first) == top - 1024
    bottom = h.allocate((300,), torch.uint8)
    assert h.offset_of(bottom) == 0
    # What this rank proposes for the next group block, below a bound: the highest free place under
    # it, above the world's blocks (a member whose other groups hold more of the top proposes lower,
    # and the lowest proposal becomes every member's next bound).
    assert h._top_fit(512, top - 512) == top - 1024 - 512
    assert h._top_fit(512, 40000) == 40000 // 256 * 256
    assert h._top_fit(top - 1024 - 256, top) == heap_module._NO_ROOM  # the world's block is in the way
    # The world's next block lands above its last, and fails where it would reach a group's.
    with pytest.raises(tridist.SymmetricAllocationError, match=r"no room on rank\(s\) \[0\]"):
        h.allocate((top - 1024,), torch.uint8)
    h.free(first)
    assert h.offset_of(h.allocate((top - 1024,), torch.uint8)) == 512


# ---- torch.distributed started by the job, under torchrun ------------------------------------------


def test_groups_when_the_job_started_torch_distributed():
    """A script that calls `dist.init_process_group` itself before `tridist.init()`, under torchrun:
    tridist joins it, and its groups work as under `tridist run`."""
    if backend() != "emulator":
        pytest.skip("the emulator's case; on GPUs NvshmemTransport has always joined a started job")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "tests/scripts/groups_under_torchrun.py"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TRIDIST_BACKEND": "emulator"})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert result.stdout.count("groups correct") == 2, result.stdout
