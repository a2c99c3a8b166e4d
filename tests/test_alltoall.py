"""all_to_all_v, all_to_all_v_2d and all_to_all_v_2d_offset against host references, exact: every
row's payload encodes its source rank and row, outputs are poisoned, splits are random or edge
cases (empty, all to one rank, a rank that sends nothing, every row of x), calls run back to back
with no host synchronisation; the 2-D round trip returns every row; overflow is refused on the
device; bad input before any launch; within process groups, several at once."""
import hashlib
import os

import pytest
import torch
import torch.distributed as dist

import tridist
import tridist.language as dl
from tridist import ops

ROWS, ROW = 12, (3, 2)  # rows of x, and the shape of a row
POISON = -7


def _payload(rank, rows, dtype=torch.float32):
    """Row i of rank r holds r * 1000 + i * 10 + (its element index): any misrouted row shows."""
    values = rank * 1000 + torch.arange(rows)[:, None] * 10 + torch.arange(6)[None, :]
    return values.view(rows, *ROW).to(dtype)


def _splits(kind, rank, world_size, experts, seed):
    """Every rank's splits for one call, alike on every rank: [world_size * experts] row counts summing
    to at most ROWS."""
    n = world_size * experts
    if kind == "random" or (kind == "rank 1 sends nothing" and rank != 1):
        counts = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(seed * 31 + rank))
        while counts.sum() > ROWS:
            counts[int(counts.argmax())] -= 1
        return counts
    counts = torch.zeros(n, dtype=torch.int64)
    if kind == "all to rank 0":
        counts[0] = ROWS
    elif kind == "full":  # every row of x, spread over every chunk
        counts += ROWS // n
        counts[-1] += ROWS - int(counts.sum())
    return counts


def _reference_1d(every, me, tag=0):
    """What rank `me` receives from `every` rank's splits, in rank order, and its splits/offsets
    (rank s's payload: `_payload(tag + s)`)."""
    rows, splits = [], []
    for source, counts in enumerate(every):
        start = int(counts[:me].sum())
        rows.append(_payload(tag + source, ROWS)[start:start + int(counts[me])])
        splits.append(int(counts[me]))
    offsets = [sum(splits[:q]) for q in range(len(splits))]
    return torch.cat(rows), splits, offsets


def _reference_2d(every, me, experts, align, tag=0):
    """Chunks for `me`'s experts, expert-major, each expert aligned: (rows by offset, splits, offsets)
    (rank s's payload: `_payload(tag + s)`)."""
    world_size = len(every)
    chunks = {}
    for source, counts in enumerate(every):
        start = 0
        for p in range(world_size):
            for e in range(experts):
                n = int(counts[p * experts + e])
                if p == me:
                    chunks[e, source] = _payload(tag + source, ROWS)[start:start + n]
                start += n
    placed, splits, offsets, start = {}, [], [], 0
    for e in range(experts):
        at = start
        for source in range(world_size):
            placed[at] = chunks[e, source]
            splits.append(chunks[e, source].shape[0])
            offsets.append(at)
            at += chunks[e, source].shape[0]
        start += max(-(-(at - start) // align), 1) * align  # as PyTorch's: an empty expert takes `align` rows
    return placed, splits, offsets


def _all_to_all(w, kinds, experts, align, group=None, tag=0):
    """Each kind of splits once, back to back, in the 1-D layout (experts 1) or the 2-D one and back;
    within `group` (None: the world), rank r of it sending `_payload(tag + r)`."""
    g = tridist.group(group)
    capacity = g.size * ROWS + experts * align
    every = {kind: [_splits(kind, r, g.size, experts, call) for r in range(g.size)]
             for call, kind in enumerate(kinds)}
    x = _payload(tag + g.rank, ROWS).to(w.device)
    calls = []
    for kind in kinds:  # no host synchronisation between the calls
        splits = every[kind][g.rank].to(w.device)
        out = torch.full((capacity, *ROW), POISON, dtype=torch.float32, device=w.device)
        if experts == 1:
            calls.append((kind, out, ops.all_to_all_v(x, splits, out, group=group)))
        else:
            result = ops.all_to_all_v_2d(x, splits, out, major_align=align, group=group)
            back = torch.full((ROWS, *ROW), POISON, dtype=torch.float32, device=w.device)
            calls.append((kind, out, result, back, ops.all_to_all_v_2d_offset(out, result, back, group=group)))
    for kind, out, result, *way_back in calls:
        what = f"{kind}, experts {experts}, align {align}, ranks {list(g.ranks)}"
        if experts == 1:
            rows, splits, offsets = _reference_1d(every[kind], g.rank, tag)
            assert torch.equal(out[:rows.shape[0]].cpu(), rows), what
            assert (out[rows.shape[0]:] == POISON).all(), f"{what}: rows written past those received"
        else:
            placed, splits, offsets = _reference_2d(every[kind], g.rank, experts, align, tag)
            for at, rows in placed.items():
                assert torch.equal(out[at:at + rows.shape[0]].cpu(), rows), f"{what}: chunk at row {at}"
            back, back_result = way_back
            sent = int(every[kind][g.rank].sum())
            assert torch.equal(back[:sent].cpu(), _payload(tag + g.rank, ROWS)[:sent]), f"{what}: the way back"
            assert back_result[0].tolist() == every[kind][g.rank].tolist(), f"{what}: splits of the way back"
            assert back_result[1].tolist() == (torch.cumsum(every[kind][g.rank], 0)
                                               - every[kind][g.rank]).tolist(), f"{what}: offsets of the way back"
        assert result[0].tolist() == splits and result[1].tolist() == offsets, f"{what}: {result.tolist()}"
    tridist.barrier_all(group)


KINDS = ["random", "all to rank 0", "rank 1 sends nothing", "full"]


@pytest.mark.worlds("1", "2", "3", "4", "2x2")
def test_all_to_all_v(world):
    world.run(_all_to_all, kinds=KINDS, experts=1, align=1)


@pytest.mark.worlds("1", "2", "3", "2x2")
def test_all_to_all_v_2d_and_back(world):
    world.run(_all_to_all, kinds=KINDS, experts=3, align=4)


@pytest.mark.worlds("2")
def test_all_to_all_v_2d_unaligned(world):
    world.run(_all_to_all, kinds=["random", "full"], experts=2, align=1)


def _in_groups(w):
    """Within process groups, payloads tagged with the group: world 3, the group [0, 2] while rank 1
    runs its own calls in a group of one and is refused the pair's; else the pairs [0, 1] and
    [2, 3] at once, on different splits and numbers of calls, then the strided [0, 2] and [1, 3]
    (across nodes in 2x2) in the 2-D layout and back."""
    if w.world_size == 3:
        pair, alone = dist.new_group([0, 2]), dist.new_group([1])  # every rank makes every group
        if w.rank == 1:
            x = _payload(0, ROWS).to(w.device)
            splits = torch.zeros(2, dtype=torch.int64, device=w.device)
            with pytest.raises(ValueError, match="rank 1 is not a member of this process group"):
                ops.all_to_all_v(x, splits, torch.empty_like(x), group=pair)
            _all_to_all(w, ["random", "full"], experts=1, align=1, group=alone, tag=70)
        else:
            _all_to_all(w, ["random", "rank 1 sends nothing"], experts=2, align=1, group=pair, tag=50)
    else:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mine = w.rank // 2
        _all_to_all(w, [["random", "full"], ["all to rank 0", "random", "rank 1 sends nothing"]][mine], experts=1,
                    align=1, group=pairs[mine], tag=10 * (mine + 1))
        _all_to_all(w, ["random"], experts=3, align=4, group=strided[w.rank % 2], tag=30 + 10 * (w.rank % 2))
    tridist.barrier_all()


@pytest.mark.worlds("3", "4", "2x2")
def test_all_to_all_v_in_groups(world):
    world.run(_in_groups)


def _bits(rank, width, dtype):
    """Rank `rank`'s x: ROWS rows of `width` random elements of `dtype` (random bytes), as uint8."""
    return torch.randint(0, 255, (ROWS, width * dtype.itemsize), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(rank))


def _check_even_split(w, out, width, dtype, what):
    """out after `all_to_all_v` of every rank's `_bits` with ROWS // world rows to each rank."""
    step = ROWS // w.world_size
    expected = torch.cat([_bits(q, width, dtype)[w.rank * step:(w.rank + 1) * step] for q in range(w.world_size)])
    assert torch.equal(out[:expected.shape[0]].cpu().view(torch.uint8), expected), what


def _dtypes(w):
    """Every dtype the rows may hold moves bit for bit, whatever the bits mean."""
    splits = torch.full((w.world_size,), ROWS // w.world_size, dtype=torch.int64, device=w.device)
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int32, torch.uint8, torch.int64):
        x = _bits(w.rank, 4, dtype).view(dtype).to(w.device)
        out = torch.zeros((w.world_size * ROWS, 4), dtype=dtype, device=w.device)
        ops.all_to_all_v(x, splits, out)
        _check_even_split(w, out, 4, dtype, dtype)
    tridist.barrier_all()


@pytest.mark.worlds("2")
def test_all_to_all_v_dtypes(world):
    world.run(_dtypes)


def _wide_rows(w):
    """Rows of 1024 elements in bf16 and int8 (copies of 512 elements a step, 8 and 16 a thread) with
    1 to 4 experts a rank, every layout, there and back exact. Triton 3.6 failed to compile the kernel
    for sm_90 at such widths where the count matrix was narrower than a thread's elements (a stress
    call on an H100, 2026-11-26: `_exchange.matrix_pad`)."""
    for dtype in (torch.bfloat16, torch.int8):
        for experts in (1, 3, 4):
            bits = _bits(w.rank, 1024, dtype)
            x = bits.view(dtype).to(w.device)
            splits = _splits("full", w.rank, w.world_size, experts, 0).to(w.device)
            out = torch.zeros((w.world_size * ROWS + experts, 1024), dtype=dtype, device=w.device)
            back = torch.zeros_like(x)
            ops.all_to_all_v_2d_offset(out, ops.all_to_all_v_2d(x, splits, out), back)
            what = f"{dtype}, {experts} experts a rank"
            assert torch.equal(back.cpu().view(torch.uint8), bits), f"{what}: the round trip"
            if experts == 1:
                out.zero_()
                ops.all_to_all_v(x, splits, out)
                _check_even_split(w, out, 1024, dtype, what)
    tridist.barrier_all()


@pytest.mark.worlds("2")
def test_all_to_all_v_wide_rows(world):
    world.run(_wide_rows)


def _deterministic(w):
    """The same inputs give the same bits (a hash over three calls)."""
    x = _payload(w.rank, ROWS).to(w.device)
    splits = _splits("random", w.rank, w.world_size, 2, 5).to(w.device)
    digests = set()
    for _ in range(3):
        out = torch.zeros((w.world_size * ROWS + 8, *ROW), device=w.device)
        result = ops.all_to_all_v_2d(x, splits, out, major_align=4)
        digests.add(hashlib.sha256(out.cpu().numpy().tobytes() + result.cpu().numpy().tobytes()).hexdigest())
    assert len(digests) == 1
    tridist.barrier_all()


@pytest.mark.worlds("3")
def test_all_to_all_v_deterministic(world):
    world.run(_deterministic)


def _overflow(w):
    """More rows arriving than out holds. In the emulator: refused on the device, naming the rank
    and the counts. On GPUs without TRIDIST_DEBUG (and in the emulator with `dl.check` made what it
    compiles to there, nothing): the rows past out's end are dropped, the others land, and the
    returned splits say how many came."""
    x = _payload(w.rank, ROWS).to(w.device)
    splits = torch.full((w.world_size,), ROWS // w.world_size, dtype=torch.int64, device=w.device)
    out = torch.full((ROWS - 1, *ROW), POISON, dtype=torch.float32, device=w.device)
    if w.backend == "emulator":
        with pytest.raises(tridist.DeviceCheckError, match=rf"rank {w.rank}.*rows arriving > rows of out: {ROWS} "
                                                           rf"\(limit {ROWS - 1}\)"):
            ops.all_to_all_v(x, splits, out)
    with pytest.MonkeyPatch.context() as monkeypatch:
        if w.backend == "emulator":
            monkeypatch.setattr(dl, "check", lambda *args: None)
        result = ops.all_to_all_v(x, splits, out)
    rows, counts, offsets = _reference_1d([splits.cpu()] * w.world_size, w.rank)  # every rank sends alike
    assert result[0].tolist() == counts and result[1].tolist() == offsets
    assert torch.equal(out.cpu(), rows[:ROWS - 1])


@pytest.mark.worlds("1")
def test_all_to_all_v_overflow(world):
    if world.backend != "emulator" and os.environ.get("TRIDIST_DEBUG") == "1":
        pytest.skip("with TRIDIST_DEBUG=1 a GPU traps on the overflow (dl.check), which ends the test's process")
    world.run(_overflow)


def _bad_input(w):
    x = _payload(w.rank, ROWS).to(w.device)
    out = torch.zeros((ROWS * w.world_size, *ROW), device=w.device)
    splits = torch.zeros(w.world_size, dtype=torch.int64, device=w.device)
    cases = [
        (lambda: ops.all_to_all_v(x, splits.int(), out), "int64"),
        (lambda: ops.all_to_all_v(x, splits[:0] if w.world_size == 1 else splits[:1], out), "shape"),
        (lambda: ops.all_to_all_v(x, splits, torch.zeros((ROWS, 2, 2), device=w.device)), "out must be"),
        (lambda: ops.all_to_all_v(x.double(), splits, out.double()), "dtype"),
        (lambda: ops.all_to_all_v(x[:, :, :1], splits, out), "contiguous"),
        (lambda: ops.all_to_all_v_2d(x, splits, out, major_align=0), "major_align"),
        (lambda: ops.all_to_all_v_2d_offset(x, splits, out), "shape"),
        (lambda: ops.AllToAllV(ROWS, -1, ROW, torch.float32), "out_rows"),
        (lambda: ops.AllToAllV(ROWS, ROWS, ROW, torch.float32, layout="columns"), "unknown layout"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    tridist.barrier_all()


@pytest.mark.worlds("1")
def test_all_to_all_v_bad_input(world):
    world.run(_bad_input)


def _ranks_disagree(w):
    """Ranks that pass different shapes are told so, every one of them, at once, instead of waiting
    for each other: a rank with no rows at all (0 rows of x) where its peers have some, or an
    instance's call refused on one rank only."""
    splits = torch.zeros(w.world_size, dtype=torch.int64, device=w.device)
    out = torch.zeros((ROWS * w.world_size, *ROW), device=w.device)
    rows = 0 if w.rank == 0 else ROWS
    with pytest.raises(ValueError, match=r"all_to_all_v \(rank layout\): ranks passed different shape of x "
                                         rf"\(rank 0: \(0, 3, 2, 'float32'\), rank 1: \({ROWS}, 3, 2, 'float32'\)"):
        ops.all_to_all_v(torch.zeros((rows, *ROW), device=w.device), splits, out)
    op = ops.AllToAllV(ROWS, ROWS * w.world_size, ROW, torch.float32)
    x = torch.zeros((ROWS - (w.rank == 0), *ROW), device=w.device)
    with pytest.raises(ValueError, match=rf"all_to_all_v: rank 0: this all-to-all was built for x of shape "
                                         rf"\({ROWS}, 3, 2\)"):
        op(x, splits, out)
    tridist.barrier_all()
    op.free()


@pytest.mark.worlds("2")
def test_all_to_all_v_ranks_disagree(world):
    world.run(_ranks_disagree)


def _custom_ops(w):
    """The custom ops under torch.compile and with fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = _payload(w.rank, ROWS).to(w.device)
    splits = torch.full((w.world_size,), 2, dtype=torch.int64, device=w.device)
    out, result = torch.compile(lambda x, s: torch.ops.tridist.all_to_all_v(x, s, w.world_size * ROWS),
                                backend="eager", fullgraph=True)(x, splits)
    rows, counts, offsets = _reference_1d([splits.cpu()] * w.world_size, w.rank)
    assert result.tolist() == [counts, offsets]
    assert torch.equal(out[:rows.shape[0]].cpu(), rows)
    with FakeTensorMode() as mode:
        fx, fs = mode.from_tensor(x), mode.from_tensor(splits)
        out, result = torch.ops.tridist.all_to_all_v(fx, fs, 40)
        assert out.shape == (40, *ROW) and result.shape == (2, w.world_size)
        out, result = torch.ops.tridist.all_to_all_v_2d(fx, fs, 40, 4)
        assert out.shape == (40, *ROW) and result.shape == (2, w.world_size)
        out, result = torch.ops.tridist.all_to_all_v_2d_offset(fx, mode.from_tensor(torch.zeros(2, w.world_size,
                                                                                              dtype=torch.int64)), 9)
        assert out.shape == (9, *ROW) and result.shape == (2, w.world_size)
    tridist.barrier_all()


@pytest.mark.worlds("2")
def test_all_to_all_v_custom_ops(world):
    world.run(_custom_ops)


def _graph_replays(w, replays):
    """One all_to_all_v_2d and its way back captured in a CUDA graph, replayed with new splits copied
    in; each replay's received chunks, splits and offsets checked against the host's reference, and
    the rows that come back against x."""
    op = ops.AllToAllV(ROWS, w.world_size * ROWS + 8, ROW, torch.float32, experts_per_rank=2, layout="expert")
    back_op = ops.AllToAllV(w.world_size * ROWS + 8, ROWS, ROW, torch.float32, experts_per_rank=2,
                            layout="expert_offset")
    x = _payload(w.rank, ROWS).to(w.device)
    splits = torch.zeros(2 * w.world_size, dtype=torch.int64, device=w.device)
    out = torch.zeros((w.world_size * ROWS + 8, *ROW), device=w.device)
    back = torch.zeros((ROWS, *ROW), device=w.device)
    op(x, splits, out, major_align=4)  # warm up: the first call fits the grid
    back_op(out, op(x, splits, out, major_align=4), back)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = op(x, splits, out, major_align=4)
        back_op(out, result, back)
    for i in range(replays):
        every = [_splits("random", r, w.world_size, 2, i) for r in range(w.world_size)]
        mine = every[w.rank].to(w.device)
        splits.copy_(mine)
        back.fill_(POISON)
        graph.replay()
        placed, counts, offsets = _reference_2d(every, w.rank, 2, 4)
        assert result.tolist() == [counts, offsets], i
        for at, rows in placed.items():
            assert torch.equal(out[at:at + rows.shape[0]].cpu(), rows), f"replay {i}: chunk at row {at}"
        sent = int(mine.sum())
        assert torch.equal(back[:sent], x[:sent]), i
    torch.cuda.synchronize()
    tridist.barrier_all()
    op.free()
    back_op.free()


@pytest.mark.worlds("1", "2", "2x1", "4")
def test_all_to_all_v_cuda_graph_replays(world):
    if world.backend == "emulator":
        pytest.skip("CUDA graphs need GPUs")
    world.run(_graph_replays, replays=1000)


def _against_pytorch(w):
    """PyTorch's all_to_all_vdev on the same inputs gives the same rows and splits."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    try:
        symm_mem.set_backend("NVSHMEM")
        group = dist.group.WORLD.group_name
        x = symm_mem.empty((ROWS, 6), dtype=torch.float32, device=w.device)
        theirs = symm_mem.empty((w.world_size * ROWS, 6), dtype=torch.float32, device=w.device)
        splits = symm_mem.empty(w.world_size, dtype=torch.int64, device=w.device)
        result = symm_mem.empty((2, w.world_size), dtype=torch.int64, device=w.device)
        symm_mem.rendezvous(x, group)
        symm_mem.rendezvous(theirs, group)
        symm_mem.rendezvous(splits, group)
        symm_mem.rendezvous(result, group)
    except Exception as error:  # noqa: BLE001 - an older torch, or NVSHMEM's backend not usable here
        return f"PyTorch's all_to_all_vdev is not available here: {error}"
    x.copy_(_payload(w.rank, ROWS).view(ROWS, 6))
    splits.copy_(_splits("random", w.rank, w.world_size, 1, 3))
    theirs.fill_(POISON)
    torch.ops.symm_mem.all_to_all_vdev(x, theirs, splits, result, group)
    ours = torch.full_like(theirs, POISON)
    mine = ops.all_to_all_v(x.clone(), splits.clone(), ours)
    received = int(result[0].sum())
    assert torch.equal(mine, result) and torch.equal(ours[:received], theirs[:received])
    return None


@pytest.mark.worlds("2")
def test_all_to_all_v_against_pytorch(world):
    if world.backend == "emulator":
        pytest.skip("PyTorch's all_to_all_vdev needs GPUs")
    skipped = world.run(_against_pytorch)[0]
    if skipped:
        pytest.skip(skipped)
