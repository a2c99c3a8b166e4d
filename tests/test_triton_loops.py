"""What our persistent kernels ask of Triton's loop flattening (`tl.range(..., flatten=True)`), checked
without communication: a value carried from one tile to the next and acted on one tile late.

moe_rs's GEMM counted its tiles wrongly flattened on an H100 (2026-11-26, `late = source` outside a
branch; it now assigns `late` in one, as gemm_rs does). Its sm_90 TTGIR (Triton 3.6) shows why:
`late = source`, with `source` loaded before the inner loop, became a yield of that value at every
step of the fused loop, so the count after the inner loop's last step already saw this tile's
source. `count_late_kernel` is that loop alone.
gemm_rs raises its flags one tile late too, but assigns `late` inside a branch after the inner loop,
which the fused loop yields only at the last step (`flag_late_kernel`; its TTGIR looks right)."""
import pytest
import torch
import triton
import triton.language as tl

BLOCK = 16


@triton.jit
def _inner_sum(x_ptr, K, BLOCK: tl.constexpr):
    """The inner loop flattening fuses with the tiles' loop (a GEMM's K loop, in small)."""
    acc = tl.zeros([BLOCK], tl.float32)
    for k in range(0, K, BLOCK):
        acc += tl.load(x_ptr + k + tl.arange(0, BLOCK))
    return acc


@triton.jit
def count_late_kernel(x_ptr, source_ptr, counts_ptr, out_ptr, tiles, K, FLATTEN: tl.constexpr, BLOCK: tl.constexpr,
                      IN_BRANCH: tl.constexpr):
    """moe_rs's pattern: a tile's source counted one tile late, the last after the loop. IN_BRANCH
    assigns `late` inside a branch after the inner loop (always taken): the fused loop then yields it
    from that branch only (its TTGIR read here), the way out for moe_rs."""
    late = tl.cast(-1, tl.int32)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
        source = tl.load(source_ptr + tile)
        acc = _inner_sum(x_ptr, K, BLOCK)
        if late >= 0:
            tl.atomic_add(counts_ptr + late, 1)
        if IN_BRANCH:
            if source >= 0:
                late = source
        else:
            late = source
        tl.store(out_ptr + tile * BLOCK + tl.arange(0, BLOCK), acc)
    if late >= 0:
        tl.atomic_add(counts_ptr + late, 1)


@triton.jit
def flag_late_kernel(x_ptr, owner_ptr, stored_ptr, raised_ptr, out_ptr, tiles, K, FLATTEN: tl.constexpr,
                     BLOCK: tl.constexpr):
    """gemm_rs's pattern: a tile for another owner raises its flag at the program's next tile (or
    after the loop), recording the program's step then; stored_ptr records the step of its store."""
    late = tl.cast(-1, tl.int32)
    step = tl.cast(0, tl.int32)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
        owner = tl.load(owner_ptr + tile)
        acc = _inner_sum(x_ptr, K, BLOCK)
        if late >= 0:
            tl.store(raised_ptr + late, step)
            late = tl.cast(-1, tl.int32)
        if owner != 0:
            tl.store(out_ptr + tile * BLOCK + tl.arange(0, BLOCK), acc)
            tl.store(stored_ptr + tile, step)
            late = tile
        step += 1
    if late >= 0:
        tl.store(raised_ptr + late, step)


def _count_late(w, flatten, programs, in_branch):
    tiles, k = 12, 4 * BLOCK
    sources = torch.tensor([t * 3 // tiles for t in range(tiles)], dtype=torch.int32)  # 4 tiles each of 3
    x = torch.arange(k, dtype=torch.float32, device=w.device)
    counts = torch.zeros(3, dtype=torch.int32, device=w.device)
    out = torch.empty(tiles * BLOCK, device=w.device)
    count_late_kernel[(programs,)](x, sources.to(w.device), counts, out, tiles, k, FLATTEN=flatten, BLOCK=BLOCK,
                                   IN_BRANCH=in_branch)
    assert counts.tolist() == [4, 4, 4], \
        f"in_branch={in_branch}, flatten={flatten}, {programs} programs: counts {counts.tolist()}"


def _flag_late(w, flatten, programs):
    tiles, k = 12, 4 * BLOCK
    owners = torch.tensor([t % 3 for t in range(tiles)], dtype=torch.int32)  # tiles of owner 0 raise nothing
    x = torch.arange(k, dtype=torch.float32, device=w.device)
    stored = torch.full((tiles,), -1, dtype=torch.int32, device=w.device)
    raised = torch.full((tiles,), -1, dtype=torch.int32, device=w.device)
    out = torch.empty(tiles * BLOCK, device=w.device)
    flag_late_kernel[(programs,)](x, owners.to(w.device), stored, raised, out, tiles, k, FLATTEN=flatten, BLOCK=BLOCK)
    stored, raised = stored.tolist(), raised.tolist()
    for tile, owner in enumerate(owners.tolist()):
        if owner == 0:
            assert raised[tile] == -1, f"flatten={flatten}, {programs} programs: tile {tile} raised a flag"
        else:  # raised at a later step than its store: never before the data
            assert raised[tile] == stored[tile] + 1, (f"flatten={flatten}, {programs} programs: tile {tile} stored "
                                                      f"at step {stored[tile]}, raised at {raised[tile]}")


@pytest.mark.worlds("1", "2")  # 2: where the GPU suite runs with ranks sharing GPUs, it has no world 1
@pytest.mark.parametrize("programs", [1, 12], ids=["one program", "a tile per program"])
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("pattern", ["count", "count in a branch", "flag"])
def test_late_action_sees_the_previous_tile(world, pattern, flatten, programs, request):
    if world.backend == "nvshmem" and pattern == "count" and flatten:
        request.applymarker(pytest.mark.xfail(strict=True, reason="Triton 3.6 fuses this loop nest wrongly (see the "
                                                                  "module docstring); strict: a fix shows here"))
    if pattern == "flag":
        world.run(_flag_late, flatten=flatten, programs=programs)
    else:
        world.run(_count_late, flatten=flatten, programs=programs, in_branch=pattern == "count in a branch")
