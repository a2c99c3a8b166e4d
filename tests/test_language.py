"""The device API (`tridist.language`) on every world size, each test checked against a reference."""
import contextlib
import os
import re

import pytest
import torch
import triton.language as tl

import tridist
import tridist.language as dl

from .harness import group_layouts, join_groups, load_script

# ---- identity -------------------------------------------------------------------------------------


@tridist.jit
def identity_kernel(out_ptr):
    tl.store(out_ptr, dl.rank())
    tl.store(out_ptr + 1, dl.num_ranks())
    tl.store(out_ptr + 2, dl.shmem.my_pe())
    tl.store(out_ptr + 3, dl.shmem.n_pes())


def _identity(w):
    out = torch.full((4,), -1, dtype=torch.int32, device=w.device)
    identity_kernel[(1,)](out)
    assert out.tolist() == [w.rank, w.world_size, w.rank, w.world_size]


def test_identity(world):
    world.run(_identity)


# ---- push all-gather through symm_at --------------------------------------------------------------


def load_example(name):
    """The examples are what users copy first, so the tests run them too (the all-gather at every
    world of one node: it stores through symm_at, which reaches no other node)."""
    return load_script("examples", name)


push_allgather_kernel = load_example("allgather").allgather_push


def _push_allgather(w, n):
    out = tridist.symm_empty((w.world_size, n), torch.float32)
    flags = tridist.signals(w.world_size)
    for epoch in range(1, 4):
        torch.manual_seed(epoch)
        everyone = torch.randn(w.world_size, n)
        out.fill_(float("nan"))
        tridist.barrier_all()
        push_allgather_kernel[(w.world_size,)](everyone[w.rank].to(w.device), out, flags, n, epoch, BLOCK=128)
        tridist.barrier_all()
        assert torch.equal(out.cpu(), everyone)
    tridist.symm_free(flags)
    tridist.symm_free(out)


def test_push_allgather_symm_at(world):
    if world.nnodes:
        pytest.skip("symm_at reaches only this node; the shmem tests cover other nodes")
    world.run(_push_allgather, n=300)


# ---- wait / consume_token ordering ------------------------------------------------------------------


@tridist.jit
def produce_kernel(data_ptr, flag_ptr, peer, value, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(dl.symm_at(data_ptr + offsets, peer), tl.full([BLOCK], 0, tl.int32) + value, mask=offsets < n)
    dl.notify(flag_ptr, peer, signal=value, sig_op="set")


@tridist.jit
def consume_kernel(data_ptr, flag_ptr, out_ptr, value, n, BLOCK: tl.constexpr):
    token = dl.wait(flag_ptr, 1, scope="sys", semantic="acquire", waitValue=value)
    offsets = tl.arange(0, BLOCK)
    data = tl.load(dl.consume_token(data_ptr + offsets, token), mask=offsets < n)
    tl.store(out_ptr + offsets, data, mask=offsets < n)


def _wait_consume_token(w, rounds):
    """Rank r produces for the next rank of its node; the consumer must never see data older than
    the flag it waited for."""
    n = 64
    data = tridist.symm_zeros((n,), torch.int32)
    flag = tridist.signals(1)
    out = torch.empty(n, dtype=torch.int32, device=w.device)
    first = w.node * w.local_world_size
    peer = first + (w.local_rank + 1) % w.local_world_size
    for value in range(1, rounds + 1):
        produce_kernel[(1,)](data, flag, peer, value, n, BLOCK=64)
        out.fill_(-1)
        consume_kernel[(1,)](data, flag, out, value, n, BLOCK=64)
        assert (out == value).all(), (value, out.tolist())
        tridist.barrier_all()  # the producer of the next round must not overwrite unread data
    tridist.symm_free(flag)
    tridist.symm_free(data)


def test_wait_consume_token(world):
    world.run(_wait_consume_token, rounds=5)


# ---- atomics from every rank to one counter ---------------------------------------------------------


@tridist.jit
def count_kernel(counter_ptr, adds, INTRA_NODE: tl.constexpr):
    for _ in range(adds):
        if INTRA_NODE:
            dl.atomic_add(dl.symm_at(counter_ptr, 0), 1, scope="sys", semantic="relaxed")
        else:
            dl.shmem.atomic_inc(counter_ptr, 0)


def _atomic_counter(w, adds, programs):
    counter = tridist.symm_zeros((1,), torch.int64)
    count_kernel[(programs,)](counter, adds, INTRA_NODE=w.nnodes == 1)
    tridist.barrier_all()
    if w.rank == 0:
        assert int(counter.item()) == adds * programs * w.world_size, int(counter.item())
    tridist.symm_free(counter)


def test_atomic_counter_exact(world):
    world.run(_atomic_counter, adds=20, programs=3)


@tridist.jit
def cas_xchg_kernel(word_ptr, out_ptr):
    previous = dl.atomic_cas(word_ptr, 0, 7, scope="gpu", semantic="acq_rel")
    swapped = dl.atomic_xchg(word_ptr, 9, scope="gpu", semantic="acq_rel")
    tl.store(out_ptr, previous)
    tl.store(out_ptr + 1, swapped)
    tl.store(out_ptr + 2, dl.ld(word_ptr, scope="gpu", semantic="acquire"))
    dl.st(word_ptr, 11, scope="sys", semantic="release")
    dl.fence()
    tl.store(out_ptr + 3, dl.ld(word_ptr, scope="sys", semantic="relaxed"))


def _cas_xchg(w):
    word = tridist.symm_zeros((1,), torch.int64)
    out = torch.full((4,), -1, dtype=torch.int64, device=w.device)
    cas_xchg_kernel[(1,)](word, out)
    assert out.tolist() == [0, 7, 9, 11]
    tridist.symm_free(word)


def test_local_memory_order_ops(world):
    world.run(_cas_xchg)


# ---- notify, and the timeout diagnostics -------------------------------------------------------------


@tridist.jit
def notify_add_kernel(signal_ptr, rounds, total):
    for _ in range(rounds):
        dl.notify(signal_ptr, 0, signal=1, sig_op="add", comm_scope="inter_node")
    if dl.rank() == 0:
        dl.shmem.signal_wait_until(signal_ptr, dl.shmem.CMP_GE, total)


def _notify_add(w, rounds):
    signal = tridist.signals(1)
    notify_add_kernel[(1,)](signal, rounds, rounds * w.world_size)
    tridist.barrier_all()
    if w.rank == 0:
        assert int(signal.item()) == rounds * w.world_size
    tridist.symm_free(signal)


def test_notify_add(world):
    world.run(_notify_add, rounds=4)


@tridist.jit
def signal_forms_kernel(signal_ptr, peer):
    """Every other form of signal to `peer` (on this node): a notify that adds, NVSHMEM's signal_op
    with set and add, fenced apart; then waits on this rank's words with the comparisons not used
    elsewhere (LT and LE hold at once, on a word nobody writes), and a sync_all."""
    dl.notify(signal_ptr, peer, signal=2, sig_op="add")
    dl.shmem.signal_op(signal_ptr + 1, 5, dl.shmem.SIGNAL_SET, peer)
    dl.shmem.fence()
    dl.shmem.signal_op(signal_ptr + 2, 3, dl.shmem.SIGNAL_ADD, peer)
    dl.shmem.signal_wait_until(signal_ptr, dl.shmem.CMP_GT, 1)
    dl.shmem.signal_wait_until(signal_ptr + 1, dl.shmem.CMP_NE, 0)
    dl.shmem.signal_wait_until(signal_ptr + 2, dl.shmem.CMP_EQ, 3)
    dl.shmem.signal_wait_until(signal_ptr + 3, dl.shmem.CMP_LT, 1)
    dl.shmem.signal_wait_until(signal_ptr + 3, dl.shmem.CMP_LE, 0)
    dl.shmem.sync_all()


def _signal_forms(w):
    signals = tridist.signals(4)
    peer = w.node * w.local_world_size + (w.local_rank + 1) % w.local_world_size  # the next rank of this node
    signal_forms_kernel[(1,)](signals, peer)
    tridist.barrier_all()
    assert signals.cpu().tolist() == [2, 5, 3, 0]
    tridist.symm_free(signals)


def test_signal_forms(world):
    world.run(_signal_forms)


@tridist.jit
def notify_kernel(flag_ptr, peer, COMM_SCOPE: tl.constexpr):
    dl.notify(flag_ptr, peer, comm_scope=COMM_SCOPE)


def _notify_checks(w):
    flag = tridist.signals(1)
    with pytest.raises(ValueError, match="comm_scope='node'"):
        notify_kernel[(1,)](flag, w.rank, COMM_SCOPE="node")
    for peer in range(w.world_size):
        if not w.same_node(peer):  # on GPUs symm_at would give a null pointer
            with pytest.raises(ValueError, match="not load/store reachable"):
                notify_kernel[(1,)](flag, peer, COMM_SCOPE="intra_node")
    tridist.barrier_all()
    tridist.symm_free(flag)


def test_notify_checks(world):
    if world.backend != "emulator":
        pytest.skip("on GPUs an unknown comm_scope fails to compile, and a store to a null pointer faults")
    world.run(_notify_checks)


# Each call with an argument the GPU lowering refuses to compile (a static_assert there), and the
# emulator's error for it.
BAD_ARGUMENTS = {
    "notify_sig_op": "dl.notify with sig_op=10; use one of 'set', 'add'",
    "signal_op_sig_op": "shmem.signal_op with sig_op='add'; use one of dl.shmem.SIGNAL_SET, dl.shmem.SIGNAL_ADD",
    "signal_wait_until_cmp": "shmem.signal_wait_until with cmp=7; use one of dl.shmem.CMP_EQ",
    "ld_release": "dl.ld with semantic='release'; use one of 'relaxed', 'acquire'",
    "st_acquire": "dl.st with semantic='acquire'; use one of 'relaxed', 'release'",
    "wait_scope": "dl.wait with scope='system'; use one of 'gpu', 'sys'",
    "atomic_add_semantic": "dl.atomic_add with semantic='acqrel'; use one of 'relaxed', 'acquire', 'release', "
                           "'acq_rel'",
}


@tridist.jit
def bad_argument_kernel(flag_ptr, CASE: tl.constexpr):
    if CASE == "notify_sig_op":
        dl.notify(flag_ptr, dl.rank(), sig_op=dl.shmem.SIGNAL_ADD)
    elif CASE == "signal_op_sig_op":
        dl.shmem.signal_op(flag_ptr, 1, "add", dl.rank())
    elif CASE == "signal_wait_until_cmp":
        dl.shmem.signal_wait_until(flag_ptr, 7, 0)
    elif CASE == "ld_release":
        dl.ld(flag_ptr, semantic="release")
    elif CASE == "st_acquire":
        dl.st(flag_ptr, 1, semantic="acquire")
    elif CASE == "wait_scope":
        dl.wait(flag_ptr, 1, scope="system", waitValue=0)
    else:
        dl.atomic_add(flag_ptr, 1, semantic="acqrel")


def _bad_arguments(w):
    flag = tridist.signals(1)
    for case, message in BAD_ARGUMENTS.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            bad_argument_kernel[(1,)](flag, CASE=case)
    assert int(flag.item()) == 0, "nothing was signalled"
    tridist.symm_free(flag)


def test_bad_arguments(world):
    if world.backend != "emulator":
        pytest.skip("on GPUs these fail to compile (tests/gpu_compile.py compiles only valid calls)")
    world.run(_bad_arguments)


@contextlib.contextmanager
def _short_waits():
    """Bounded waits give up after 0.3 s: the emulator reads TRIDIST_WAIT_TIMEOUT at every wait."""
    previous = os.environ.get("TRIDIST_WAIT_TIMEOUT")
    os.environ["TRIDIST_WAIT_TIMEOUT"] = "0.3"
    try:
        yield
    finally:
        os.environ["TRIDIST_WAIT_TIMEOUT"] = previous


@tridist.jit
def never_signalled_kernel(flag_ptr):
    dl.wait(flag_ptr, 2, waitValue=1)


def _timeout_diagnostic(w):
    flags = tridist.signals(2)
    with _short_waits(), pytest.raises(tridist.WaitTimeoutError) as error:
        never_signalled_kernel[(1,)](flags)
    for part in (f"tridist: rank {w.rank} kernel never_signalled_kernel program 0: wait on allocation #",
                 "[0] (int64[2] at heap offset ", "expected == 1, observed 0 after "):
        assert part in str(error.value), (part, str(error.value))
    tridist.barrier_all()
    tridist.symm_free(flags)


def test_timeout_diagnostic(world):
    if world.backend != "emulator":
        pytest.skip("on GPUs the bounded wait traps the context; test_launcher.py runs one alone")
    world.run(_timeout_diagnostic)


@tridist.jit
def never_sent_kernel(packets_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    dl.ll.recv(packets_ptr + offsets, 1, offsets < n)


def _ll_timeout_diagnostic(w):
    packets = tridist.symm_zeros((8,), torch.int64)
    packets[:3] = 1 << 32  # packets 0 to 2 carry flag 1; the first stale one is packet 3
    with _short_waits(), pytest.raises(tridist.WaitTimeoutError) as error:
        never_sent_kernel[(1,)](packets, 8, BLOCK=8)
    first = tridist.runtime.world.heap().offset_of(packets) + 3 * 8
    for part in (f"tridist: rank {w.rank} kernel never_sent_kernel program 0: wait on allocation #",
                 f"[3] (int64[8] at heap offset {first - 3 * 8:#x}) expected == 1, observed 0 after ",
                 "(the flag of an LL packet; 5 packets stale)"):
        assert part in str(error.value), (part, str(error.value))
    tridist.barrier_all()
    tridist.symm_free(packets)


def test_ll_timeout_diagnostic(world):
    if world.backend != "emulator":
        pytest.skip("on GPUs the bounded wait traps the context; test_launcher.py runs one alone")
    world.run(_ll_timeout_diagnostic)


# ---- barriers -------------------------------------------------------------------------------------


@tridist.jit
def stamp_kernel(slots_ptr, value):
    me = dl.rank()
    for peer in range(dl.num_ranks()):
        dl.shmem.p(slots_ptr + me, value, peer)
    dl.shmem.quiet()


def _barriers(w, rounds):
    slots = tridist.symm_zeros((w.world_size,), torch.int64)
    for i in range(1, rounds + 1):
        stamp_kernel[(1,)](slots, i)
        tridist.barrier_all_on_stream()
        assert (slots == i).all(), (i, slots.tolist())
        tridist.barrier_all_on_stream()  # nobody stamps round i+1 before everyone checked round i
    for _ in range(rounds):
        tridist.barrier_all()
    tridist.symm_free(slots)


def test_back_to_back_barriers(world):
    world.run(_barriers, rounds=100)


@tridist.jit
def group_stamp_kernel(slots_ptr, value, group):
    me = dl.rank(group)
    for peer in range(dl.num_ranks(group)):
        dl.shmem.p(slots_ptr + me, value, peer, group)
    dl.shmem.quiet()


def _group_barriers(w, layout, rounds):
    """`barrier_all_on_stream(group=...)` in each group of `layout` at once, a different number of
    times in each (a barrier that waited for another group's ranks would hang): every member's
    stamp has landed everywhere when the barrier is passed."""
    index, members, made = join_groups(layout)
    g = tridist.group(made[index])
    slots = tridist.symm_zeros((g.size,), torch.int64, group=g)
    for i in range(1, rounds + 2 * index + 1):
        group_stamp_kernel[(1,)](slots, 100 * index + i, g)
        tridist.barrier_all_on_stream(group=made[index])
        assert (slots == 100 * index + i).all(), (members, i, slots.tolist())
        tridist.barrier_all_on_stream(group=g)  # nobody stamps round i+1 before every member checked round i
    with pytest.raises(ValueError, match=f"rank {w.rank} is not a member"):
        tridist.barrier_all_on_stream(group=made[(index + 1) % len(made)])
    tridist.symm_free(slots)
    tridist.barrier_all()


@pytest.mark.parametrize("layout", group_layouts())
def test_barriers_within_groups(world, layout):
    world.run(_group_barriers, layout=layout, rounds=3)


def _bounded_barrier(w, rounds):
    """The barrier `barrier_all_on_stream` queues on GPUs with TRIDIST_DEBUG=1, run directly: it
    holds every rank until all have come, back to back, and a rank that never comes is reported."""
    from tridist.ops.sync import _bounded_barrier_kernel

    slots = tridist.symm_zeros((w.world_size,), torch.int64)
    barrier = (tridist.signals(w.world_size), torch.zeros(1, dtype=torch.int64, device=w.device))
    for i in range(1, rounds + 1):
        stamp_kernel[(1,)](slots, i)
        _bounded_barrier_kernel[(1,)](*barrier)
        assert (slots == i).all(), (i, slots.tolist())
        _bounded_barrier_kernel[(1,)](*barrier)
    if w.world_size > 1 and w.backend == "emulator":  # on GPUs a timed-out wait traps the context
        if w.rank:
            with _short_waits(), pytest.raises(tridist.WaitTimeoutError) as error:
                _bounded_barrier_kernel[(1,)](*barrier)  # rank 0 does not come
            for part in (f"rank {w.rank}", "_bounded_barrier_kernel", f">= {2 * rounds + 1}"):
                assert part in str(error.value), (part, str(error.value))
        tridist.barrier_all()
    tridist.symm_free(barrier[0])
    tridist.symm_free(slots)


def test_bounded_barrier(world):
    world.run(_bounded_barrier, rounds=5)


# ---- co-resident launches and dl.grid_barrier ---------------------------------------------------------


@tridist.jit
def rotate_kernel(slots_ptr, out_ptr, counter_ptr, rounds, base, SKIP_FIRST: tl.constexpr):
    """Round i: program p stores base + i into slot p; after the barrier it reads slot p + 1, which
    another program stored, into out[i, p]; a second barrier keeps the slots until all have read.
    With SKIP_FIRST program 0 never comes to the barrier."""
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    if not (SKIP_FIRST and p == 0):
        for i in range(rounds):
            tl.store(slots_ptr + p, base + i)
            token = dl.grid_barrier(counter_ptr)
            seen = tl.load(dl.consume_token(slots_ptr, token) + (p + 1) % programs)
            tl.store(out_ptr + i * programs + p, seen)
            dl.grid_barrier(counter_ptr)


def _grid_barrier(w, rounds):
    """Programs of one launch see each other's stores across the barrier, round after round and
    launch after launch on one counter with no reset, at the largest co-resident grid on GPUs; a grid
    past that is refused before it runs, as is a barrier outside a co-resident launch (emulator)."""
    counter = torch.zeros(1, dtype=torch.int64, device=w.device)
    probe = torch.empty(1, dtype=torch.int64, device=w.device)
    limit = tridist.coresident_programs(rotate_kernel, probe, probe, counter, rounds, 0, SKIP_FIRST=False)
    programs = limit if w.backend == "nvshmem" else 4
    slots = torch.full((programs,), -1, dtype=torch.int64, device=w.device)
    out = torch.full((rounds, programs), -1, dtype=torch.int64, device=w.device)
    for base in (100, 200):
        out.fill_(-1)
        rotate_kernel[(programs,)](slots, out, counter, rounds, base, SKIP_FIRST=False, coresident=True)
        expected = torch.arange(base, base + rounds, device=w.device)[:, None].expand(rounds, programs)
        assert torch.equal(out, expected), out.tolist()
    assert int(counter.item()) == 2 * 2 * rounds * programs
    with pytest.raises(ValueError, match=f"co-resident launch of {limit + 1} programs .* at most {limit}"):
        rotate_kernel[(limit + 1,)](slots, out, counter, rounds, 0, SKIP_FIRST=False, coresident=True)
    if w.backend == "emulator":
        with pytest.raises(ValueError, match=r"dl.grid_barrier .* coresident=True"):
            rotate_kernel[(2,)](slots, out, counter, rounds, 0, SKIP_FIRST=False)
        with _short_waits(), pytest.raises(tridist.WaitTimeoutError) as error:
            rotate_kernel[(3,)](slots, out, counter, rounds, 0, SKIP_FIRST=True, coresident=True)
        for part in (f"tridist: rank {w.rank} kernel rotate_kernel program ", "(not in the symmetric heap)",
                     "expected >="):
            assert part in str(error.value), (part, str(error.value))


@pytest.mark.worlds("1", "2")
def test_grid_barrier(world):
    world.run(_grid_barrier, rounds=3)


@tridist.jit
def first_kernel(x_ptr, value, BLOCK: tl.constexpr):
    dl.launch_dependents()
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, offsets + value)


@tridist.jit
def dependent_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    dl.wait_prior_kernel()
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets) + 1)


def _dependent_launch(w):
    """A kernel launched as its predecessor's programmatic dependent reads what that one wrote,
    call after call with no host synchronisation (on GPUs the dependent's programs start while the
    first kernel's still run)."""
    block, programs = 1024, 64
    xs = [torch.full((programs * block,), -1, dtype=torch.int32, device=w.device) for _ in range(3)]
    ys = [torch.full_like(x, -1) for x in xs]
    for value, (x, y) in enumerate(zip(xs, ys)):
        first_kernel[(programs,)](x, value, BLOCK=block)
        dependent_kernel[(programs,)](x, y, BLOCK=block, launch_pdl=True)
    for value, y in enumerate(ys):
        assert torch.equal(y.cpu(), torch.arange(programs * block, dtype=torch.int32) + value + 1)


@pytest.mark.worlds("1")
def test_programmatic_dependent_launch(world):
    world.run(_dependent_launch)


@tridist.jit
def all_ranks_arrive_kernel(counter_ptr, total):
    """Every program of every rank adds 1 to every rank's counter, then waits until its own holds
    `total`: no program of any rank ends unless all the ranks' programs run at once."""
    for peer in range(dl.num_ranks()):
        dl.notify(counter_ptr, peer, signal=1, sig_op="add")
    dl.wait(counter_ptr, 1, scope="sys", waitValue=total)


def _all_ranks_resident(w):
    """The largest co-resident grid of every rank runs at once with the others'. Where ranks share a
    GPU (CUDA MPS) this is the assumption `occupancy` sizes grids for: gemm_rs and the fused Jacobi
    solver hung on 2026-11-26 when a rank's grid did not get SMs beside the others' (one H100, 2
    and 4 ranks); with GPUs of their own it holds by construction."""
    counter = tridist.signals(1)
    programs = tridist.coresident_programs(all_ranks_arrive_kernel, counter, 2) if w.backend == "nvshmem" else 4
    total = int(tridist.ops.all_reduce(torch.tensor([float(programs)], device=w.device)).item())
    for call in (1, 2):
        all_ranks_arrive_kernel[(programs,)](counter, call * total, coresident=True)
        tridist.barrier_all()  # no rank adds for call 2 before every rank has seen call 1's total
    assert counter.item() == 2 * total, (counter.item(), total)
    tridist.symm_free(counter)


@pytest.mark.worlds("2", "4")
def test_every_rank_s_largest_coresident_grid_runs_at_once(world):
    world.run(_all_ranks_resident)
