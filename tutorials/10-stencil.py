"""# 10. A stencil in one kernel: co-resident launches and grid barriers

A 2D Jacobi solver: a grid of points inside a fixed boundary, where every iteration replaces each
point by the mean of its four neighbours. Split by rows across ranks, every iteration needs one
row from the rank above and one from the rank below (the *halos*). The classic multi-GPU version
launches a kernel per iteration and synchronises all ranks on the host in between. Here one kernel
runs every iteration: each rank waits only for the two halo rows it needs, as signals from its
neighbours, and the programs of the kernel meet at a barrier of their own between iterations.

You will learn:

- why a kernel whose programs wait on each other needs them all *resident* at once, and how to
  launch it that way: `kernel[grid](..., coresident=True)`, with `tridist.coresident_programs`
  saying how many programs fit (the role of CUDA's cooperative launch and NVSHMEM's collective
  launch);
- `dl.grid_barrier`: a barrier among the programs of one launch, which needs no reset between
  iterations or launches;
- halos moved with `dl.shmem.putmem_signal_block` and awaited with `dl.shmem.signal_wait_until`,
  with double-buffered planes and signals whose values only grow.

Run: `tridist run -n 2 tutorials/10-stencil.py`

`tridist.ops.Jacobi2D` is the same solver for large domains (tiles instead of whole rows; its two
methods, this kernel's and the host loop, are `tridist/ops/stencil/fused.py` and `host_loop.py`),
and `tridist bench jacobi` times them against each other.
"""
import sys

import torch
import triton.language as tl

import tridist
import tridist.language as dl

# %%
# ## The domain and its layout
#
# The domain has `ROWS_PER_RANK * world` rows of `COLS` interior points, inside a boundary that
# never changes: the top edge is hot (1.0), the other edges cold (0.0). Rank r keeps its rows in a
# symmetric buffer of two *planes*, each `ROWS_PER_RANK + 2` rows of `COLS + 2` columns: row 0 is
# its top halo (the last row of rank r - 1, or the domain's top edge on rank 0), then its own rows,
# then its bottom halo; columns 0 and `COLS + 1` are the left and right edges. Iteration k reads
# plane `(k - 1) % 2` and writes plane `k % 2`, so no point is overwritten while a neighbour still
# needs its old value.
#
# The reference computes the whole domain in one process, in the same order of operations as the
# kernel: the results must be equal bit for bit.
ROWS_PER_RANK = 8
COLS = 16
BAND = 2  # rows per program: 4 programs per rank


def initial_domain(rows: int) -> torch.Tensor:
    domain = torch.zeros(rows + 2, COLS + 2)
    domain[0] = 1.0
    domain[1:-1, 1:-1] = torch.rand(rows, COLS, generator=torch.Generator().manual_seed(0))
    return domain


def reference(domain: torch.Tensor, iterations: int) -> torch.Tensor:
    for _ in range(iterations):
        following = domain.clone()
        following[1:-1, 1:-1] = ((domain[:-2, 1:-1] + domain[2:, 1:-1]) + (domain[1:-1, :-2] + domain[1:-1, 2:])) * 0.25
        domain = following
    return domain


# %%
# ## The kernel
#
# Program p relaxes rows `1 + p * BAND` to `(p + 1) * BAND` of the rank's rows, every iteration.
# Two kinds of waiting keep it correct:
#
# - *Across ranks*, only the programs holding the first and the last row wait, for their halo.
#   After computing iteration k, the first program puts its first row into the bottom halo of the
#   rank above (plane `k % 2`) with `putmem_signal_block`, which sets a signal word there to k once
#   the row has landed; the last program does the same towards the rank below. Before iteration k
#   reads a halo, the program waits for that halo's signal to reach k - 1. The signals are
#   double-buffered like the planes (word `[k % 2][side]`), and a rank can only be one iteration
#   ahead of its neighbours, so "at least k - 1" never sees a value of a later iteration, and
#   nothing is ever reset.
# - *Within the rank*, a program's first and last rows read rows that its neighbouring programs
#   wrote in the iteration before. So after each iteration every program waits at
#   `dl.grid_barrier(counter)` until all have finished it. The counter word only grows: the n-th
#   barrier it sees waits for n x programs arrivals, which works across iterations and launches
#   alike. Like `dl.wait`, it returns a token; passing the planes' pointer through
#   `dl.consume_token` keeps the next iteration's loads after it.
#
# Before a program puts a row it has just stored, `tl.debug_barrier()` waits for all its threads:
# Triton spreads a row's stores over the threads differently from the put's reads.
@tridist.jit
def jacobi_kernel(planes_ptr, signals_ptr, counter_ptr, rows, first, iterations, COLS: tl.constexpr,
                  BAND: tl.constexpr):
    me = dl.rank()
    world = dl.num_ranks()
    width = COLS + 2
    plane = (rows + 2) * width
    program = tl.program_id(0)
    r = 1 + program * BAND + tl.arange(0, BAND)[:, None]
    c = 1 + tl.arange(0, COLS)[None, :]
    mask = r <= rows
    first_row = (program == 0) & (me > 0)  # this program's band starts where the rank above ends
    last_row = (program == tl.num_programs(0) - 1) & (me < world - 1)
    last = first + iterations - 1
    for k in range(first, last + 1):
        src = planes_ptr + ((k - 1) % 2) * plane
        dst = planes_ptr + (k % 2) * plane
        if k > 1:  # the halos of iteration k - 1 (iteration 1 reads the ones loaded by the host)
            halo_signals = signals_ptr + ((k - 1) % 2) * 2
            if first_row:
                src = dl.consume_token(src, dl.shmem.signal_wait_until(halo_signals, dl.shmem.CMP_GE, k - 1))
            if last_row:
                src = dl.consume_token(src, dl.shmem.signal_wait_until(halo_signals + 1, dl.shmem.CMP_GE, k - 1))
        center = r * width + c
        up = tl.load(src + center - width, mask=mask)
        down = tl.load(src + center + width, mask=mask)
        left = tl.load(src + center - 1, mask=mask)
        right = tl.load(src + center + 1, mask=mask)
        tl.store(dst + center, ((up + down) + (left + right)) * 0.25, mask=mask)
        if first_row | last_row:
            tl.debug_barrier()
        sent = signals_ptr + (k % 2) * 2
        if first_row:  # my first row -> the bottom halo of the rank above (its signal [k % 2][1])
            dl.shmem.putmem_signal_block(dst + (rows + 1) * width + 1, dst + width + 1, COLS * 4, sent + 1, k,
                                         dl.shmem.SIGNAL_SET, me - 1)
        if last_row:  # my last row -> the top halo of the rank below (its signal [k % 2][0])
            dl.shmem.putmem_signal_block(dst + 1, dst + rows * width + 1, COLS * 4, sent, k, dl.shmem.SIGNAL_SET,
                                         me + 1)
        if k < last:
            planes_ptr = dl.consume_token(planes_ptr, dl.grid_barrier(counter_ptr))
    dl.shmem.quiet()


# %%
# ## Launching it co-resident
#
# A GPU starts a program only where an SM has room for it, and keeps it there until it ends. If
# the grid had more programs than fit at once, the ones running would wait at the grid barrier
# for ones that can never start: a hang. `coresident=True` checks the grid against what the
# compiled kernel allows before launching (registers, shared memory and warps per program, times
# the SMs this process may use, fewer when ranks share a GPU; in the emulator, where every program
# of such a launch runs on a thread of its own, a thread cap) and refuses one that is too large,
# naming the numbers. `tridist.coresident_programs` gives the limit for a kernel and its
# arguments, so a persistent kernel can size its grid to it.
#
# The run below makes two launches, 6 iterations then 4, the second going on from the first:
# signals and the barrier's counter carry over with no reset, and the result after 10 iterations
# must equal one process's bit for bit.
def main():
    w = tridist.init()
    rows = ROWS_PER_RANK * w.world_size
    domain = initial_domain(rows)
    mine = domain[w.rank * ROWS_PER_RANK:(w.rank + 1) * ROWS_PER_RANK + 2]
    planes = tridist.symm_empty((2, ROWS_PER_RANK + 2, COLS + 2), torch.float32)
    planes.copy_(mine.expand(2, *mine.shape).to(w.device))
    signals = tridist.signals(4)
    counter = torch.zeros(1, dtype=torch.int64, device=w.device)
    arguments = dict(planes_ptr=planes, signals_ptr=signals, counter_ptr=counter, rows=ROWS_PER_RANK, COLS=COLS,
                     BAND=BAND)
    programs = ROWS_PER_RANK // BAND
    limit = tridist.coresident_programs(jacobi_kernel, first=1, iterations=1, **arguments)
    try:
        jacobi_kernel[(limit + 1,)](first=1, iterations=1, coresident=True, **arguments)
        sys.exit("a grid larger than can be resident was launched")
    except ValueError as refusal:
        if w.rank == 0:
            print(f"refused before launching: {str(refusal).split(': ', 1)[1][:110]}...")
    tridist.barrier_all()
    done = 0
    for iterations in (6, 4):
        jacobi_kernel[(programs,)](first=done + 1, iterations=iterations, coresident=True, **arguments)
        done += iterations
    tridist.barrier_all()
    got = planes[done % 2, 1:ROWS_PER_RANK + 1].cpu()
    expected = reference(domain, done)[1 + w.rank * ROWS_PER_RANK:1 + (w.rank + 1) * ROWS_PER_RANK]
    if not torch.equal(got, expected):
        sys.exit(f"rank {w.rank}: after {done} iterations the rows differ from one process by up to "
                 f"{(got - expected).abs().max().item()}")
    print(f"rank {w.rank}: {done} iterations of {rows} x {COLS} in {programs} co-resident programs per rank, "
          "equal to one process bit for bit")
    tridist.symm_free(signals)
    tridist.symm_free(planes)
    tridist.finalize()


if __name__ == "__main__":
    main()
