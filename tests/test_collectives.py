"""all_gather, reduce_scatter and all_reduce: every method, several dtypes and shapes, random data,
poisoned outputs, back-to-back calls with no host synchronisation in between; within process groups
(`group=`), several at once."""
import functools

import pytest
import torch
import torch.distributed as dist

import tridist
from tridist import ops
from tridist.ops import sizing
from tridist.ops.collectives import allgather, allreduce, policy, reducescatter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}  # relative, vs an fp64 sum


def _inputs(w, shape, dtype, call):
    """Every rank's input for one call, the same on every rank (so each can build the reference)."""
    g = torch.Generator().manual_seed(1000 * call + 7)
    if not dtype.is_floating_point:
        return [torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g, dtype=dtype)
                for _ in range(w.world_size)]
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(w.world_size)]


def _small_integers(n, dtype, rank, call):
    """Rank `rank`'s input of call `call`: random integers from -8 to 8, drawn per (call, rank,
    element), so that an element moved within a shard shows, and sums of up to 8 ranks of them are
    exact in every dtype: results compare bit for bit."""
    g = torch.Generator().manual_seed(call * 64 + rank)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype)


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device)


def _small_pieces():
    """Ops built inside cut their copy-engine transfers in chunks of 64 elements and their sliced
    kernels' work in slices of 256 bytes, so that the small test shapes travel in several chunks and
    the programs take several slices each."""
    return sizing.piece_sizes(slice_bytes=256, chunk_bytes=64)


def _all_gather(w, method, dtype, shape, calls):
    if method in ("pull", "ll", "ce") and w.nnodes > 1:
        with pytest.raises(ValueError, match="within one node"):
            ops.AllGather(int(torch.Size(shape).numel()), dtype, method)
        return
    with _small_pieces():
        op = ops.AllGather(int(torch.Size(shape).numel()), dtype, method)
    everyone = [_inputs(w, shape, dtype, call) for call in range(calls)]
    outs = [_poisoned((w.world_size * shape[0], *shape[1:]), dtype, w.device) for _ in range(calls)]
    sources = [e[w.rank].to(w.device) for e in everyone]
    for call in range(calls):  # back to back: no barrier, no host synchronisation
        op(sources[call], outs[call])
    for call in range(calls):
        assert torch.equal(outs[call].cpu(), torch.cat(everyone[call])), f"call {call}"
    tridist.barrier_all()
    op.free()


@pytest.mark.parametrize("method", ["push", "pull", "ll", "ce", "2d", "ring"])
def test_all_gather(world, method):
    for dtype, shape in [(torch.float32, (37, 3)), (torch.bfloat16, (64,)), (torch.float16, (2, 130)),
                         (torch.uint8, (4, 12)), (torch.int64, (5,))]:  # raw bytes and integers too
        world.run(_all_gather, method=method, dtype=dtype, shape=shape, calls=4)


def _all_gather_auto(w):
    x = torch.arange(10, dtype=torch.float32, device=w.device) + 100 * w.rank
    out = ops.all_gather(x)
    expected = torch.cat([torch.arange(10, dtype=torch.float32) + 100 * r for r in range(w.world_size)])
    assert torch.equal(out.cpu(), expected)
    assert ops.all_gather(x) is not out, "a new output each call unless out= is given"


def test_all_gather_auto(world):
    world.run(_all_gather_auto)


def _reduce_scatter(w, method, dtype, rows, calls):
    shape = (w.world_size * rows, 3)
    if method in ("ll", "ce") and w.nnodes > 1:
        with pytest.raises(ValueError, match="within one node"):
            ops.ReduceScatter(shape[0] * shape[1], dtype, method)
        return
    with _small_pieces():
        op = ops.ReduceScatter(shape[0] * shape[1], dtype, method)
    everyone = [_inputs(w, shape, dtype, call) for call in range(calls)]
    outs = [_poisoned((rows, 3), dtype, w.device) for _ in range(calls)]
    for call in range(calls):
        op(everyone[call][w.rank].to(w.device), outs[call])
    for call in range(calls):
        reference = sum(x.double() for x in everyone[call])[w.rank * rows:(w.rank + 1) * rows]
        torch.testing.assert_close(outs[call].cpu().double(), reference, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    tridist.barrier_all()
    op.free()


@pytest.mark.parametrize("method", ["ll", "one_shot", "ce", "2d", "ring"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter(world, method, dtype):
    # LL moves 4-byte words: an even count of 16-bit elements per rank
    world.run(_reduce_scatter, method=method, dtype=dtype, rows=46 if method == "ll" else 45, calls=3)


def _reduce_scatter_read_back(w, method, chunk, calls):
    """Small-integer inputs, whose sums are exact: every element must be right."""
    op = ops.ReduceScatter(w.world_size * chunk, torch.bfloat16, method)
    for call in range(calls):
        g = torch.Generator().manual_seed(100 * call + 1)
        everyone = [torch.randint(-8, 8, (w.world_size * chunk,), generator=g).to(torch.bfloat16)
                    for _ in range(w.world_size)]
        out = _poisoned((chunk,), torch.bfloat16, w.device)
        op(everyone[w.rank].to(w.device), out)
        reference = sum(x.float() for x in everyone)[w.rank * chunk:(w.rank + 1) * chunk]
        wrong = int((out.float().cpu() != reference).sum())
        assert wrong == 0, f"call {call}: {wrong} of {chunk} sums wrong"
    tridist.barrier_all()
    op.free()


@pytest.mark.worlds("4")
@pytest.mark.parametrize("method", ["2d", "ring"])
def test_reduce_scatter_reads_back_its_own_sums(world, method):
    """These kernels store fp32 sums and read them back in the same program, in another layout:
    without `protocol.sync_program` between, 4 ranks sharing one H100 got 17,000-27,000 stale sums
    per rank at 262144 elements per rank, in every call (benchmarks/results/
    reduce-scatter-read-back-race-*.log). The emulator runs a program's threads in lockstep and
    cannot show it (and takes half a minute for it): GPUs only, e.g. TRIDIST_RANKS_PER_GPU=4 on one."""
    if world.backend == "emulator":
        pytest.skip("a race between the warps of a program: the emulator runs them in lockstep")
    world.run(_reduce_scatter_read_back, method=method, chunk=262144, calls=8)


def _all_reduce(w, method, dtype, numel, calls, in_place):
    if method in ("ll", "ce") and w.nnodes > 1:
        with pytest.raises(ValueError, match="within one node"):
            ops.AllReduce(numel, dtype, method)
        return
    with _small_pieces():
        op = ops.AllReduce(numel, dtype, method)
    everyone = [_inputs(w, (numel,), dtype, call) for call in range(calls)]
    outs = []
    for call in range(calls):
        x = everyone[call][w.rank].to(w.device).clone()
        out = x if in_place else _poisoned((numel,), dtype, w.device)
        outs.append(op(x, out))
    for call in range(calls):
        reference = sum(x.double() for x in everyone[call])
        torch.testing.assert_close(outs[call].cpu().double(), reference, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    tridist.barrier_all()
    op.free()


@pytest.mark.parametrize("method", ["one_shot", "two_shot", "ll", "ce", "rs_ag"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce(world, method, dtype):
    # LL moves 4-byte words: an even count of 16-bit elements
    world.run(_all_reduce, method=method, dtype=dtype, numel=302 if method == "ll" else 301, calls=3, in_place=False)


@pytest.mark.parametrize("method", ["auto", "one_shot", "two_shot", "ce", "rs_ag"])
def test_all_reduce_in_place(world, method):
    # 840 elements split evenly over 1-4 and 8 ranks: two-shot works on x itself, not a padded copy
    world.run(_all_reduce, method=method, dtype=torch.float32, numel=840, calls=2, in_place=True)


def _all_gather_symmetric(w, method, dtype, shape, calls, own_row):
    """A symmetric `out`, reused by every call: "ce" writes the shards straight into the peers'
    out, so a fast rank must not write into a peer's out before the peer has read the last call's
    result (copied right after each call here, with no host synchronisation). With `own_row`, x is
    out's own row. The last call goes through `ops.all_gather`, which sees that out is symmetric."""
    with _small_pieces():
        op = ops.AllGather(int(torch.Size(shape).numel()), dtype, method, symmetric_out=True)
    out = tridist.symm_empty((w.world_size * shape[0], *shape[1:]), dtype)
    out.copy_(_poisoned(out.shape, dtype, w.device))
    own = out[w.rank * shape[0]:(w.rank + 1) * shape[0]]
    everyone = [_inputs(w, shape, dtype, call) for call in range(calls)]
    results = []
    for call in range(calls):
        x = everyone[call][w.rank].to(w.device)
        if own_row:
            own.copy_(x)
        gather = op if call < calls - 1 else functools.partial(ops.all_gather, method=method)
        assert gather(own if own_row else x, out) is out
        results.append(out.clone())
    for call in range(calls):
        assert torch.equal(results[call].cpu(), torch.cat(everyone[call])), f"call {call}"
    tridist.barrier_all()
    op.free()
    tridist.symm_free(out)


@pytest.mark.parametrize("method", ["push", "ce"])  # "ce" straight into out; the SM methods stage
def test_all_gather_symmetric_out(world, method):
    if method == "ce" and (world.nnodes or 1) > 1:
        pytest.skip("the copy engines reach peers on one node only")
    for dtype, shape in [(torch.float32, (37, 3)), (torch.uint8, (4, 12))]:
        for own_row in (False, True):
            world.run(_all_gather_symmetric, method=method, dtype=dtype, shape=shape, calls=4, own_row=own_row)


def _all_reduce_symmetric(w, method, dtype, numel, calls, two_per_sm=False):
    """In place on one symmetric x; each result is copied right after its call, with no host
    synchronisation. The last call goes through `ops.all_reduce`, which sees that x is symmetric.
    `two_per_sm`: as large messages run, with more programs than SMs (numel None: a step per SM
    and two more for every rank's chunk)."""
    if numel is None:
        numel = (sizing.programs_for(w.device) + 2) * sizing.SMALLEST_STEP * w.world_size
    saved = policy.SYMMETRIC_TWO_PER_SM_BYTES
    policy.SYMMETRIC_TWO_PER_SM_BYTES = 0 if two_per_sm else saved
    try:
        with _small_pieces():
            op = ops.AllReduce(numel, dtype, method, symmetric_in_place=True)
    finally:
        policy.SYMMETRIC_TWO_PER_SM_BYTES = saved
    assert op.direct == (w.nnodes == 1), "in place on a symmetric x, on one node: no staging"
    if two_per_sm and op.direct:
        assert op.splits > sizing.programs_for(w.device)
    x = tridist.symm_empty((numel,), dtype)
    everyone = [_inputs(w, (numel,), dtype, call) for call in range(calls)]
    results = []
    for call in range(calls):
        x.copy_(everyone[call][w.rank])
        if call < calls - 1:
            assert op(x, out=x) is x
        else:
            assert ops.all_reduce(x, out=x, method=method) is x
        results.append(x.clone())
    for call in range(calls):
        reference = sum(e.double() for e in everyone[call])
        torch.testing.assert_close(results[call].cpu().double(), reference, rtol=TOLERANCE[dtype],
                                   atol=TOLERANCE[dtype])
    with pytest.raises(ValueError, match="symmetric_in_place=True: call it with out=x"):
        op(x)
    tridist.barrier_all()
    op.free()
    tridist.symm_free(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_symmetric_in_place(world, dtype):
    # 1303: chunks of unequal length at every world size (the last ranks' shorter)
    world.run(_all_reduce_symmetric, method="two_shot", dtype=dtype, numel=1303, calls=4)


def test_all_reduce_symmetric_two_programs_per_sm(world):
    if world.nnodes:
        pytest.skip("across nodes the symmetric all-reduce stages its data like a regular one")
    world.run(_all_reduce_symmetric, method="two_shot", dtype=torch.bfloat16, numel=None, calls=3, two_per_sm=True)


def _symmetric_mismatch(w):
    """One rank passes a regular out where the others pass a symmetric one: every rank raises
    (at the first call of a shape, and every call in the emulator and with TRIDIST_DEBUG=1) instead
    of writing into the wrong memory."""
    op = ops.AllGather(16, torch.float32, "push", symmetric_out=True)
    symmetric = tridist.symm_empty((16 * w.world_size,), torch.float32)
    out = torch.empty(16 * w.world_size, device=w.device) if w.rank == 0 else symmetric
    with pytest.raises(ValueError, match="all_gather: rank 0: .*out must be a symmetric tensor"):
        op(torch.zeros(16, device=w.device), out)
    with pytest.raises(ValueError, match="symmetric_out=True: pass out"):
        op(torch.zeros(16, device=w.device))
    # The functions choose the protocol by what they are given: rank 0 would stage while the others
    # took the symmetric paths, and each would wait for the other's flags.
    with pytest.raises(ValueError, match="ranks passed different out .rank 0: not symmetric, rank 1: symmetric"):
        ops.all_gather(torch.zeros(16, device=w.device), out)
    x = tridist.symm_zeros((64,), torch.float32)
    with pytest.raises(ValueError, match="ranks passed different x in place .rank 0: not in place, rank 1: symm"):
        ops.all_reduce(x, out=None if w.rank == 0 else x)
    tridist.barrier_all()
    op.free()
    tridist.symm_free(x)
    tridist.symm_free(symmetric)


def test_symmetric_mismatch_fails_everywhere(world):
    if world.size == 1:
        pytest.skip("needs a peer to disagree with")
    world.run(_symmetric_mismatch)


def _largest_steps(w, op_name, method):
    """bf16 on one program per destination (programs=1): the kernels step through the data in their
    largest blocks (`sizing.steps_for`), with a ragged end."""
    n = w.world_size
    part = sizing.STEP_BYTES + 1000  # two largest bf16 steps, and a ragged end
    numel = n * part
    shard = part if op_name == "AllGather" else numel
    op = getattr(ops, op_name)(shard, torch.bfloat16, method, programs=1)
    largest = (sizing.CE_STEP_BYTES if method == "ce" else sizing.STEP_BYTES) // 2
    assert op.block == largest, f"{method} steps {op.block} elements"
    everyone = _inputs(w, (shard,), torch.bfloat16, call=0)
    for _ in range(2):
        out = op(everyone[w.rank].to(w.device)).cpu()
    if op_name == "AllGather":
        assert torch.equal(out, torch.cat(everyone))
        tridist.barrier_all()
        op.free()
        return
    reference = sum(x.double() for x in everyone)
    if op_name == "ReduceScatter":
        reference = reference[w.rank * part:(w.rank + 1) * part]
    torch.testing.assert_close(out.double(), reference, rtol=1e-2, atol=1e-2)
    tridist.barrier_all()
    op.free()


@pytest.mark.parametrize("op_name, method", [
    ("AllGather", m) for m in ("push", "pull", "ce", "2d", "ring")] + [
    ("ReduceScatter", m) for m in ("one_shot", "ce", "2d", "ring")] + [
    ("AllReduce", m) for m in ("one_shot", "two_shot", "ce")])
def test_largest_steps(world, op_name, method):
    if world.size == 1 and op_name != "AllGather":
        pytest.skip("a reduction's steps are checked where there is something to sum: 2 ranks and more")
    if method in ("pull", "ce") and (world.nnodes or 1) > 1:
        pytest.skip(f"{method} runs on one node (test_all_gather and the others check that it refuses more)")
    world.run(_largest_steps, op_name=op_name, method=method)


def _several_programs(w, op_name, method, calls=3):
    """bf16, ragged, on up to 16 programs: every destination's data is cut over several programs
    (`splits` > 1), in small slices, random and different every call, back to back into poisoned
    outputs. The all-reduce gives every rank the same bits."""
    part = 2050  # elements per destination: two 2048-element steps (the second ragged), 1025 LL words
    shard = part if op_name == "AllGather" else w.world_size * part
    if op_name == "AllReduce" and method != "ll":  # (LL moves whole 4-byte words)
        shard += 1  # a ragged last chunk
    with _small_pieces():
        op = getattr(ops, op_name)(shard, torch.bfloat16, method, programs=16)
    splits = op.workspace.splits if method == "ll" else op.splits
    assert splits > 1, f"{op_name} {method}: {splits} program(s) per destination"
    everyone = [_inputs(w, (shard,), torch.bfloat16, call) for call in range(calls)]
    out_numel = {"AllGather": w.world_size * shard, "ReduceScatter": part, "AllReduce": shard}[op_name]
    outs = [_poisoned((out_numel,), torch.bfloat16, w.device) for _ in range(calls)]
    for call in range(calls):
        op(everyone[call][w.rank].to(w.device), outs[call])
    for call in range(calls):
        if op_name == "AllGather":
            assert torch.equal(outs[call].cpu(), torch.cat(everyone[call])), f"call {call}"
            continue
        reference = sum(x.double() for x in everyone[call])
        if op_name == "ReduceScatter":
            reference = reference[w.rank * part:(w.rank + 1) * part]
        torch.testing.assert_close(outs[call].cpu().double(), reference, rtol=1e-2, atol=1e-2)
        if op_name == "AllReduce":
            bits = ops.all_gather(outs[call].view(torch.int16)).view(w.world_size, -1)
            assert (bits == bits[0]).all(), f"call {call}: ranks got different bits"
    tridist.barrier_all()
    op.free()


@pytest.mark.parametrize("op_name, method", [
    ("AllGather", m) for m in ("push", "pull", "ll", "ce", "2d", "ring")] + [
    ("ReduceScatter", m) for m in ("ll", "one_shot", "ce", "2d", "ring")] + [
    ("AllReduce", m) for m in ("one_shot", "two_shot", "ll", "ce")])
def test_several_programs_per_destination(world, op_name, method):
    if world.backend == "emulator" and world.name not in ("2", "3", "2x2"):
        pytest.skip("in the emulator at 2, 3 and 2x2 ranks only: even, odd and across nodes (CI's time)")
    if method in ("pull", "ll", "ce") and (world.nnodes or 1) > 1:
        pytest.skip(f"{method} runs on one node (test_all_gather and the others check that it refuses more)")
    world.run(_several_programs, op_name=op_name, method=method)


def _ll_past_2_31(w, op_name):
    """LL packets carry the low 32 bits of the call epoch: calls 2^31 - 1 to 2^31 + 1 of an
    instance are as correct as the first."""
    numel = 64 * w.world_size
    op = getattr(ops, op_name)(numel, torch.float32, "ll")
    op.workspace.calls.fill_((2**31 - 2) * op.workspace.splits)  # the next call's epoch: 2^31 - 1
    tridist.barrier_all()
    for call in range(3):
        everyone = _inputs(w, (numel,), torch.float32, call)
        out = op(everyone[w.rank].to(w.device)).cpu().double()
        reference = sum(x.double() for x in everyone)
        if op_name == "ReduceScatter":
            reference = reference.view(w.world_size, -1)[w.rank]
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    tridist.barrier_all()
    op.free()


@pytest.mark.parametrize("op_name", ["ReduceScatter", "AllReduce"])
def test_ll_epochs_past_2_31(world, op_name):
    if (world.nnodes or 1) > 1:
        pytest.skip("LL packets reach the ranks of one node")
    world.run(_ll_past_2_31, op_name=op_name)


def test_steps_for():
    """Steps grow to STEP_BYTES only while every program still gets one; warps keep 64 bytes or
    fewer per thread."""
    assert sizing.steps_for(1000, 2, 132) == (2048, 1, 4)
    assert sizing.steps_for(132 * 4096 - 1, 2, 132) == (2048, 132, 4)
    assert sizing.steps_for(132 * 4096, 2, 132) == (4096, 132, 4)
    assert sizing.steps_for(132 * 8192, 2, 132) == (8192, 132, 8)
    assert sizing.steps_for(1 << 26, 2, 66) == (8192, 66, 8)
    assert sizing.steps_for(1 << 26, 4, 66) == (4096, 66, 8)
    assert sizing.steps_for(1 << 26, 1, 66) == (16384, 66, 8)
    assert sizing.steps_for(1 << 26, 2, 66, sizing.CE_STEP_BYTES) == (4096, 66, 4)


def _reuse_after_free(w):
    """An op built where a freed one lived must not take the packets that one left for its own."""
    n = 256
    for round_ in range(3):  # each round's op lives where the last one did, and calls with its epochs
        op = ops.AllReduce(n, torch.float32, "ll")
        x = torch.full((n,), float(round_ * 10 + w.rank), device=w.device)
        expected = torch.full((n,), float(sum(round_ * 10 + r for r in range(w.world_size))))
        assert torch.equal(op(x).cpu(), expected), f"round {round_}"
        tridist.barrier_all()
        op.free()


def test_reuse_after_free(world):
    if (world.nnodes or 1) > 1:
        pytest.skip("LL packets reach the ranks of one node")
    world.run(_reuse_after_free)


def _bad_input(w):
    x = torch.zeros(8, device=w.device)
    huge = (1 << 31) // w.world_size  # elements per rank whose gathered rows pass 2^31
    for build in (lambda: ops.AllGather(huge, torch.uint8, "push"), lambda: ops.AllReduce(huge, torch.bfloat16, "ll"),
                  lambda: ops.ReduceScatter(w.world_size << 30, torch.bfloat16, "one_shot")):
        with pytest.raises(ValueError, match="32-bit offsets"):
            build()
    with pytest.raises(ValueError, match="dtype"):
        ops.all_gather(torch.zeros(8, dtype=torch.bool, device=w.device))
    with pytest.raises(ValueError, match="dtype"):
        ops.all_reduce(torch.zeros(8, dtype=torch.int64, device=w.device))
    with pytest.raises(ValueError, match="contiguous"):
        ops.all_reduce(torch.zeros(4, 4, device=w.device).t())
    with pytest.raises(ValueError, match="unknown method"):
        ops.all_gather(x, method="carrier-pigeon")
    with pytest.raises(ValueError, match="out must be"):
        ops.all_gather(x, out=torch.empty(3, device=w.device))
    with pytest.raises(ValueError, match="multiple of the world size|multiple of world_size"):
        ops.reduce_scatter(torch.zeros(w.world_size * 4 + 1, device=w.device))
    with pytest.raises(ValueError, match="programs must be a positive int"):
        ops.AllGather(8, torch.float32, "push", programs=0)
    if w.nnodes == 1:
        with pytest.raises(ValueError, match="4-byte words"):
            ops.ReduceScatter(w.world_size * 3, torch.bfloat16, "ll")
    with pytest.raises(ValueError, match="reduce_scatter takes"):
        ops.ReduceScatter(8, torch.int32)  # rejected before anything is allocated
    with pytest.raises(ValueError, match="non-negative int number of elements"):
        ops.AllGather(-1, torch.float32)
    op = ops.AllReduce(8, torch.float32)
    with pytest.raises(ValueError, match="built for 8"):
        op(torch.zeros(9, device=w.device))
    op.free()


def _auto_odd_sizes(w):
    """`auto` never picks LL packets for data that is not whole 4-byte words."""
    x = torch.arange(3 * w.world_size, dtype=torch.bfloat16, device=w.device) + w.rank
    everyone = [torch.arange(3 * w.world_size, dtype=torch.float64) + r for r in range(w.world_size)]
    total = sum(everyone)
    assert torch.equal(ops.all_gather(x).cpu().double(), torch.cat(everyone))
    assert torch.equal(ops.all_reduce(x).cpu().double(), total)
    assert torch.equal(ops.reduce_scatter(x).cpu().double(), total[3 * w.rank:3 * (w.rank + 1)])


def test_auto_odd_sizes(world):
    world.run(_auto_odd_sizes)


def test_bad_input_fails_before_launch(world):
    if world.size == 1:
        pytest.skip("a reduce-scatter of world_size * 4 + 1 elements is refused from 2 ranks on (1 divides it)")
    world.run(_bad_input)


def _custom_ops(w):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.arange(4 * w.world_size, dtype=torch.float32, device=w.device) + w.rank

    def layer(t):
        gathered = torch.ops.tridist.all_gather(t, "auto")
        return torch.ops.tridist.reduce_scatter(gathered, "auto"), torch.ops.tridist.all_reduce(t * 2, "auto")

    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    scattered, reduced = compiled(x)
    everyone = [torch.arange(4 * w.world_size, dtype=torch.float32) + r for r in range(w.world_size)]
    gathered = torch.cat(everyone)
    chunk = gathered.numel() // w.world_size
    assert torch.equal(scattered.cpu(), w.world_size * gathered[w.rank * chunk:(w.rank + 1) * chunk])
    assert torch.equal(reduced.cpu(), 2 * sum(everyone))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert torch.ops.tridist.all_gather(fake).shape == (w.world_size * x.numel(),)
        assert torch.ops.tridist.reduce_scatter(fake).shape == (4,)
        assert torch.ops.tridist.all_reduce(fake).shape == x.shape


@pytest.mark.at_most_4_ranks
def test_custom_ops_under_torch_compile(world):
    world.run(_custom_ops)


def _graph_replays(w, replays):
    """Every method captured once in a CUDA graph and replayed `replays` times back to back with new
    inputs (`_small_integers`); every 50th replay is checked, exactly, against torch on every rank's
    inputs."""
    n = 4096
    cases = [(ops.AllGather(n, torch.bfloat16, m), "gather") for m in ("push", "pull", "ll", "ce", "2d", "ring")
             if w.nnodes == 1 or m in ("push", "2d", "ring")]
    cases += [(ops.ReduceScatter(n, torch.bfloat16, m), "scatter") for m in ("ll", "one_shot", "ce", "2d", "ring")
              if w.nnodes == 1 or m not in ("ll", "ce")]
    cases += [(ops.AllReduce(n, torch.bfloat16, m), "reduce") for m in ("one_shot", "two_shot", "ll", "ce")
              if w.nnodes == 1 or m not in ("ll", "ce")]
    for op, kind in cases:
        x = torch.zeros(n, dtype=torch.bfloat16, device=w.device)
        out = torch.empty(n * w.world_size if kind == "gather" else n // w.world_size if kind == "scatter" else n,
                          dtype=torch.bfloat16, device=w.device)
        op(x, out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op(x, out)
        for i in range(replays):
            x.copy_(_small_integers(n, torch.bfloat16, w.rank, i))
            graph.replay()
            if i % 50 == 49:
                everyone = [_small_integers(n, torch.bfloat16, r, i) for r in range(w.world_size)]
                total = sum(e.float() for e in everyone).to(torch.bfloat16)
                expected = {"gather": torch.cat(everyone), "reduce": total,
                            "scatter": total.view(w.world_size, -1)[w.rank]}[kind]
                assert torch.equal(out.cpu(), expected), (type(op).__name__, getattr(op, "method", ""), i)
        tridist.barrier_all()
        op.free()


def test_cuda_graph_replays(world):
    if world.backend == "emulator":
        pytest.skip("CUDA graphs need GPUs")
    world.run(_graph_replays, replays=1000)


def _two_streams(w, calls, gather, scatter):
    """Instances used at once from two streams, with no synchronisation between them: an all-reduce
    and a reduce-scatter (method `scatter`) on one, an all-gather (method `gather`) on the other;
    inputs `_small_integers`, results exact."""
    n = 3 << 13  # a multiple of every world size up to 8 but 5 and 7
    a, b = ops.AllReduce(n, torch.float32), ops.AllGather(n, torch.float32, gather)
    c = ops.ReduceScatter(n, torch.float32, scatter)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    everyone = [[_small_integers(n, torch.float32, r, i) for r in range(w.world_size)] for i in range(calls)]
    xs = [e[w.rank].to(w.device) for e in everyone]
    reduced = [torch.empty(n, device=w.device) for _ in range(calls)]
    scattered = [torch.empty(n // w.world_size, device=w.device) for _ in range(calls)]
    gathered = [torch.empty(n * w.world_size, device=w.device) for _ in range(calls)]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    for i in range(calls):
        with torch.cuda.stream(streams[0]):
            a(xs[i], reduced[i])
            c(xs[i], scattered[i])
        with torch.cuda.stream(streams[1]):
            b(xs[i], gathered[i])
    torch.cuda.synchronize()
    for i in range(calls):
        total = sum(everyone[i])
        assert torch.equal(reduced[i].cpu(), total), f"call {i}: all_reduce"
        assert torch.equal(scattered[i].cpu(), total.view(w.world_size, -1)[w.rank]), f"call {i}: reduce_scatter"
        assert torch.equal(gathered[i].cpu(), torch.cat(everyone[i])), f"call {i}: all_gather"
    tridist.barrier_all()
    for op in (a, b, c):
        op.free()


@pytest.mark.parametrize("gather, scatter", [("auto", "auto"), ("2d", "2d"), ("ring", "ring"), ("ce", "ce")])
def test_two_streams(world, gather, scatter):
    """With "ce" both streams queue barriers every call: each instance needs its own (`sync.Barrier`)."""
    if world.backend == "emulator":
        pytest.skip("streams need GPUs")
    if gather == "ce" and (world.nnodes or 1) > 1:
        pytest.skip("the copy engines reach peers on one node only")
    world.run(_two_streams, calls=20, gather=gather, scatter=scatter)


def _call_order(w):
    """An op called on a second stream starts after the one called before it on the first stream,
    here held back by a 200 ms sleep queued before it."""
    n = 1 << 16
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    a, b = ops.AllGather(n, torch.float32), ops.AllGather(n, torch.float32)  # one instance per stream
    x = torch.full((n,), float(w.rank), device=w.device)
    for stream in (first, second):
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(first):
        tridist.sleep_async(200_000)
        out_a = a(x)
    with torch.cuda.stream(second):
        out_b = b(x)
        done = second.record_event()
    done.synchronize()
    assert first.query(), "the all-gather called second ended before the one called first (ops.call_order)"
    torch.cuda.synchronize()
    assert torch.equal(out_a, out_b) and torch.equal(out_b.view(w.world_size, n)[:, 0].cpu(),
                                                      torch.arange(w.world_size, dtype=torch.float32))
    tridist.barrier_all()
    a.free()
    b.free()


def test_call_order_waits_only_when_the_stream_changes(monkeypatch):
    """`call_order.take_turn`'s bookkeeping, host code only (CUDA's part is the GPU test below): on
    the stream of the previous op nothing; on another stream a wait for an event recorded on the
    previous one; none between a stream being captured and one that is not."""
    import contextlib

    from tridist.ops import call_order

    class FakeStream:
        def __init__(self, name, capturing=False):
            self.name, self.capturing, self.device, self.waited = name, capturing, "cuda:0", []

        def record_event(self):
            return f"event on {self.name}"

        def wait_event(self, event):
            self.waited.append(event)

    current = [None]

    @contextlib.contextmanager
    def on(stream):
        before, current[0] = current[0], stream
        yield
        current[0] = before

    monkeypatch.setattr(call_order.backend, "is_emulator", lambda: False)
    monkeypatch.setattr(call_order.torch.cuda, "current_stream", lambda: current[0])
    monkeypatch.setattr(call_order.torch.cuda, "stream", on)
    monkeypatch.setattr(call_order.torch.cuda, "is_current_stream_capturing", lambda: current[0].capturing)
    monkeypatch.setattr(call_order, "_last", [None])
    a, b, captured = FakeStream("a"), FakeStream("b"), FakeStream("captured", capturing=True)
    for stream in (a, a, b, b, a, captured, b):
        current[0] = stream
        call_order.take_turn()
    assert a.waited == ["event on b"] and b.waited == ["event on a"] and captured.waited == []


def test_ops_start_in_call_order(world):
    """Ops called on two streams start on the GPU in the order they were called (`ops.call_order`):
    otherwise two ranks may start them in different orders, each holding the SMs that its peer's
    first kernel needs, and hang (two ring all-gathers in `tridist stress` did, on two GPUs)."""
    if world.backend == "emulator":
        pytest.skip("streams need GPUs")
    world.run(_call_order)


@pytest.mark.parametrize("op, nbytes, ranks, nodes, method", [
    ("all_gather", 4 << 10, 2, 1, "ll"), ("all_gather", 1 << 20, 4, 1, "ll"), ("all_gather", 6, 2, 1, "push"),
    ("all_gather", 16 << 20, 4, 1, "2d"), ("all_gather", 16 << 20, 2, 1, "push"), ("all_gather", 64 << 20, 4, 1, "ring"), ("all_gather", 64 << 20, 2, 1, "push"),
    ("all_gather", 256 << 20, 2, 1, "push"), ("all_gather", 256 << 20, 4, 1, "ring"), ("all_gather", 4 << 10, 4, 2, "2d"),
    ("reduce_scatter", 4 << 10, 2, 1, "ll"), ("reduce_scatter", 1 << 20, 4, 1, "ll"),
    ("reduce_scatter", 12, 2, 1, "one_shot"),
    ("reduce_scatter", 4 << 20, 4, 1, "one_shot"), ("reduce_scatter", 256 << 20, 2, 1, "one_shot"),
    ("reduce_scatter", 256 << 20, 4, 1, "one_shot"), ("reduce_scatter", 4 << 10, 4, 2, "2d"),
    ("all_reduce", 4 << 10, 2, 1, "ll"), ("all_reduce", 6, 2, 1, "one_shot"), ("all_reduce", 1 << 20, 4, 1, "two_shot"), ("all_reduce", 2 << 20, 2, 1, "one_shot"),
    ("all_reduce", 4 << 20, 4, 1, "two_shot"), ("all_reduce", 64 << 20, 2, 1, "two_shot"),
    ("all_reduce", 16 << 20, 4, 1, "two_shot"), ("all_reduce", 64 << 20, 4, 1, "rs_ag"),
    ("all_reduce", 256 << 20, 4, 1, "rs_ag"), ("all_reduce", 256 << 20, 4, 2, "two_shot"),
    ("all_reduce", 4 << 10, 4, 2, "one_shot"),
])
def test_auto_crossovers(op, nbytes, ranks, nodes, method):
    """What `auto` picks, by size, ranks and nodes: the crossovers measured on 2 and 4 H200s
    (see the `choose_*` docstrings); host code only."""
    from types import SimpleNamespace

    choose = {"all_gather": policy.choose_all_gather, "reduce_scatter": policy.choose_reduce_scatter,
              "all_reduce": policy.choose_all_reduce}[op]
    assert choose(nbytes, SimpleNamespace(world_size=ranks, nnodes=nodes)) == method


@pytest.mark.parametrize("op, nbytes, nodes, method", [
    ("all_gather", 1 << 20, 1, "ll"), ("all_gather", 64 << 20, 1, "push"), ("all_gather", 256 << 20, 1, "ce"),
    ("all_gather", 256 << 20, 2, "2d"),
    ("all_reduce", 256 << 10, 1, "ll"), ("all_reduce", 4 << 20, 1, "two_shot"), ("all_reduce", 4 << 20, 2, "one_shot"),
])
def test_auto_crossovers_symmetric(op, nbytes, nodes, method):
    """What `auto` picks for a symmetric all-gather output or all-reduce buffer (2 ranks)."""
    from types import SimpleNamespace

    choose = {"all_gather": policy.choose_all_gather, "all_reduce": policy.choose_all_reduce}[op]
    assert choose(nbytes, SimpleNamespace(world_size=2, nnodes=nodes), True) == method


# ---- within process groups (`group=`) ------------------------------------------------------------------


def _group_payload(group_id: int, rank: int, call: int, n: int) -> torch.Tensor:
    """World rank `rank`'s input to call `call` within group `group_id`: integers that say which
    group, rank, call and element, in fp32 below 2^24, so that a group's sums are exact (tolerance
    0) and a row from another rank, group or call cannot pass."""
    return ((group_id * 8 + call) * 8 + rank) * 1024 + torch.arange(n, dtype=torch.float32) % 1024


def _collectives_in(pg, group_id: int, n: int, every_method: bool = True) -> None:
    """With `every_method`, every method of the three ops within `pg` (the one-node ones where it
    spans one node, else their refusal), two calls each; then the symmetric paths on the group's own
    allocations and the functions' `auto`. Results compared exactly with the sums and rows of the
    group's payloads."""
    w = tridist.world()
    g = tridist.group(pg)

    def mine(call, numel):
        return _group_payload(group_id, w.rank, call, numel).to(w.device)

    def everyone(call, numel):
        return [_group_payload(group_id, r, call, numel) for r in g.ranks]

    gathered, total = torch.cat, sum
    cases = [(ops.AllGather, allgather.CLASSES, n, gathered),
             (ops.ReduceScatter, reducescatter.CLASSES, g.size * n, lambda e: sum(e).view(g.size, -1)[g.rank]),
             (ops.AllReduce, allreduce.CLASSES, n, total)]
    for build, classes, numel, expected in cases if every_method else ():
        for method, kind in classes.items():
            if kind.one_node and not g.is_one_node:
                with pytest.raises(ValueError, match="within one node; this group spans 2 nodes"):
                    build(numel, torch.float32, method, group=pg)
                continue
            with _small_pieces():
                op = build(numel, torch.float32, method, group=pg)
            for call in range(2):
                assert torch.equal(op(mine(call, numel)).cpu(), expected(everyone(call, numel))), \
                    (build.__name__, method, call)
            tridist.barrier_all(pg)
            op.free()
    out = tridist.symm_empty((g.size * n,), torch.float32, group=pg, name="group test out")
    x = tridist.symm_empty((n,), torch.float32, group=pg, name="group test x")
    for call in range(2):  # the copy engines into a symmetric out; the two-shot in place, staged across nodes
        if g.is_one_node:
            assert torch.equal(ops.all_gather(mine(call, n), out, method="ce", group=pg).cpu(),
                               gathered(everyone(call, n)))
        x.copy_(mine(call, n))
        assert torch.equal(ops.all_reduce_(x, method="two_shot", group=pg).cpu(), total(everyone(call, n)))
        assert torch.equal(ops.all_gather(mine(call, n), group=pg).cpu(), gathered(everyone(call, n)))
        assert torch.equal(ops.reduce_scatter(mine(call, g.size * n), group=pg).cpu(),
                           sum(everyone(call, g.size * n)).view(g.size, -1)[g.rank])
    tridist.barrier_all(pg)
    for t in (x, out):
        tridist.symm_free(t)


def _collectives_in_mesh_groups(w):
    """A DeviceMesh's groups: "tp" pairs [0, 1] and [2, 3] at once, each on data (and sizes) of its
    own, then "dp" [0, 2] and [1, 3], strided (across nodes at 2x2): each rank runs in two groups."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(w.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    _collectives_in(tp, group_id=w.rank // 2, n=37 + 8 * (w.rank // 2))
    _collectives_in(dp, group_id=2 + w.rank % 2, n=29 + 8 * (w.rank % 2))
    # One shape in both groups: the functions keep an instance per group, not one for the shape.
    x = _group_payload(4, w.rank, 0, 64).to(w.device)
    for pg in (tp, dp, None):
        members = tridist.group(pg).ranks
        assert torch.equal(ops.all_reduce(x, group=pg).cpu(), sum(_group_payload(4, r, 0, 64) for r in members))
    # A symmetric x of the tp group's is not mapped on the dp peer: refused on both dp ranks.
    held = tridist.symm_zeros((64,), torch.float32, group=tp, name="tp's x")
    op = ops.AllReduce(64, torch.float32, "two_shot", symmetric_in_place=True, group=dp)
    with pytest.raises(ValueError, match=r"the group of ranks \[\d, \d\], without ranks \[\d\] of this op's"):
        op(held, held)
    tridist.barrier_all()
    op.free()
    tridist.symm_free(held)


@pytest.mark.worlds("4", "2x2")
def test_collectives_in_groups(world):
    world.run(_collectives_in_mesh_groups)


def _collectives_beside_other_work(w):
    """World 3: ranks 0 and 2 run the ops in their group while rank 1, not a member, runs them
    alone (a group of one) and is refused the pair's group before anything is launched."""
    pair, alone = dist.new_group([0, 2]), dist.new_group([1])
    if w.rank == 1:
        x = _group_payload(7, 1, 0, 33).to(w.device)
        assert torch.equal(ops.all_reduce(x, group=alone).cpu(), x.cpu())
        assert torch.equal(ops.all_gather(x, group=alone).cpu(), x.cpu())
        for call in (lambda: ops.all_reduce(x, group=pair), lambda: ops.AllGather(33, torch.float32, group=pair)):
            with pytest.raises(ValueError, match="rank 1 is not a member of this process group"):
                call()
    else:
        _collectives_in(pair, group_id=5, n=45, every_method=False)  # (every method: test_collectives_in_groups)
        with pytest.raises(ValueError, match="into 2 chunks; make it a multiple of the group size"):
            ops.reduce_scatter(torch.zeros(3, device=w.device), group=pair)  # checked within the pair only
    tridist.barrier_all()


@pytest.mark.worlds("3")
def test_collectives_beside_a_rank_doing_other_work(world):
    world.run(_collectives_beside_other_work)
