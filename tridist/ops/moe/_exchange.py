"""The protocol of the family's all-to-alls (`all_to_all`, and expert parallelism's dispatches and
combines), and the device helpers its kernels share: rows sent into a peer's symmetric staging,
the signal that says they are there, the waits for it, and the layout a receiver computes from the
counts (the routing of tokens to ranks and experts is `_sort`'s).

Every op of this family follows one protocol, the same for every world and node layout:
1. **Send.** For each destination rank p, programs (p, s) copy the rows this rank sends to p into
   this rank's region of p's staging (stores through `dl.symm_at` on this node, one NVSHMEM put a
   row to another node), write the counts p needs to place them, and raise flag (rank, s) on p to
   the call's epoch.
2. **Receive.** The same programs then wait for the flags of the sources whose counts they need,
   work out where each source's rows go in the output (packed in rank order, or by expert), and
   copy them out of staging.
Only one network round is needed, whatever the routing: a sender never waits to learn where its
rows will land, because each source has a region of its own in the receiver's staging, as big as
the most rows it may send. Epochs and two slots (see `protocol.py`) make back-to-back calls safe:
every call waits for a flag from every peer. Where a receiver needs every sending program's part,
the senders add to an arrival counter per source instead of raising a flag each (`arrive`).

Within a process group the same protocol runs among the group's members: ranks, peers and
`local_world_size` are the group's, and every helper that names a rank takes the kernel's `group`
(None: the world, compiled as before groups existed).
"""
import triton
import triton.language as tl

import tridist.language as dl

from ..protocol import call_epoch, in_slot
from ..gemm.grouped import pick


@triton.jit
def exchange_program(calls_ptr, staging_ptr, slot_numel, group=None):
    """Where every program of an exchange kernel (grid (world, splits)) starts: (the call's epoch,
    this rank, the world size, the peer and the split the program serves, the call's slot of the
    staging); ranks of `group`, if given."""
    epoch = call_epoch(calls_ptr)
    return (epoch, dl.rank(group), dl.num_ranks(group), tl.program_id(0), tl.program_id(1),
            in_slot(staging_ptr, epoch, slot_numel))


@triton.jit
def copy_rows(src_ptr, src_rows, dst_ptr, dst_rows, mask, width, BLOCK_W: tl.constexpr):
    """dst[dst_rows[i]] = src[src_rows[i]] where mask[i]: rows of `width` elements, moved in tiles of
    (rows, BLOCK_W). Row offsets are 64-bit: a staging slot may pass 2^31 elements."""
    columns = tl.arange(0, BLOCK_W)[None, :]
    src = src_ptr + src_rows.to(tl.int64)[:, None] * width
    dst = dst_ptr + dst_rows.to(tl.int64)[:, None] * width
    rows = mask[:, None]
    for start in range(0, width, BLOCK_W):
        inside = rows & (start + columns < width)
        tl.store(dst + start + columns, tl.load(src + start + columns, mask=inside), mask=inside)


@triton.jit
def send_rows(src_ptr, src_rows, dst_ptr, dst_rows, mask, width, peer, local_world_size, BLOCK_R: tl.constexpr,
              BLOCK_W: tl.constexpr, group=None):
    """Copy rows src[src_rows[i]] to rows dst[dst_rows[i]] of `peer`'s copy of the symmetric `dst`
    (`dst_ptr` is this rank's address of it), for the BLOCK_R rows where mask[i]. On this node the
    program stores through the peer's pointer; on another node each row is an NVSHMEM put (the
    caller's `raise_flag` completes them before the flag). `peer` and `local_world_size` are of
    `group`, if given."""
    if dl.rank(group) // local_world_size == peer // local_world_size:
        copy_rows(src_ptr, src_rows, dl.symm_at(dst_ptr, peer, group), dst_rows, mask, width, BLOCK_W)
    else:
        nbytes = width * (src_ptr.dtype.element_ty.primitive_bitwidth // 8)
        for i in range(BLOCK_R):
            if pick(mask.to(tl.int32), i) != 0:
                dl.shmem.putmem_nbi_block(dst_ptr + pick(dst_rows, i).to(tl.int64) * width,
                                          src_ptr + pick(src_rows, i).to(tl.int64) * width, nbytes, peer, group)


@triton.jit
def send_values(ptr, offsets, values, mask, peer, local_world_size, BLOCK: tl.constexpr, group=None):
    """Store values[i] at ptr[offsets[i]] on `peer` where mask[i] (BLOCK of them; `ptr` is this
    rank's address of a symmetric buffer): through the peer's pointer on this node, one NVSHMEM `p`
    each on another. `peer` and `local_world_size` are of `group`, if given."""
    if dl.rank(group) // local_world_size == peer // local_world_size:
        tl.store(dl.symm_at(ptr + offsets, peer, group), values, mask=mask)
    else:
        for i in range(BLOCK):
            if pick(mask.to(tl.int32), i) != 0:
                dl.shmem.p(ptr + pick(offsets, i), pick(values, i), peer, group)


@triton.jit
def _publish(flag_ptr, value, peer, local_world_size, sig_op: tl.constexpr, group=None):
    """Set (or add to) `peer`'s word at `flag_ptr` once every row and value this program sent it has
    landed. On this node every thread first fences its own stores: rows are stored by all the
    program's threads, and the release that `dl.notify` gives after its barrier is one thread's. On
    another node every thread completes its puts (`quiet`) before one thread signals. `peer` and
    `local_world_size` are of `group`, if given."""
    if dl.rank(group) // local_world_size == peer // local_world_size:
        dl.fence("sys")
        dl.notify(flag_ptr, peer, signal=value, sig_op=sig_op, group=group)
    else:
        dl.shmem.quiet()
        dl.notify(flag_ptr, peer, signal=value, sig_op=sig_op, comm_scope="inter_node", group=group)


@triton.jit
def raise_flag(flag_ptr, epoch, peer, local_world_size, group=None):
    """Set `peer`'s flag at `flag_ptr` to `epoch` once what this program sent it has landed (`peer`
    of `group`, if given)."""
    _publish(flag_ptr, epoch, peer, local_world_size, "set", group)


@triton.jit
def arrive(counter_ptr, peer, local_world_size, group=None):
    """Add 1 to `peer`'s arrival counter at `counter_ptr` once what this program sent it has landed
    (`peer` of `group`, if given).
    A counter per source replaces a flag per (source, program): a receiver that needs every program's
    part waits on one word a source, where waiting on each of a hundred flags in turn costs a memory
    round trip each."""
    _publish(counter_ptr, 1, peer, local_world_size, "add", group)


@triton.jit
def arrivals_at_least(counters_ptr, source, count):
    """Wait until `source`'s arrival counter here (`counters_ptr` + source) is at least `count`;
    returns a token for `dl.consume_token`. Counters only grow: the programs of call e add after those
    of call e - 1 on the same stream, so `count` = e x programs per source means all of call e's have
    arrived, and (e - 1) x programs + 1 that one of them has."""
    return dl.shmem.signal_wait_until(counters_ptr + source, dl.shmem.CMP_GE, count)


@triton.jit
def await_counts(arrivals_ptr, counts, sources, epoch, splits):
    """Wait for the counts of sources 0 ... sources - 1 (one of each one's programs of this call has
    arrived); returns `counts` made to depend on the waits."""
    for source in range(sources):
        counts = dl.consume_token(counts, arrivals_at_least(arrivals_ptr, source, (epoch - 1) * splits + 1))
    return counts


@triton.jit
def split_rows(total, split, splits):
    """Part `split` [start, stop) of `total` rows cut in `splits` nearly equal parts."""
    per_split = tl.cdiv(total, splits)
    start = tl.minimum(split * per_split, total)
    return start, tl.minimum(start + per_split, total)


@triton.jit
def gather(values, index):
    """values[index[i]] for every i: `values` a small vector held by the program, `index` a vector
    of indices into it."""
    lanes = tl.arange(0, values.shape[0])[None, :]
    return tl.sum(tl.where(index[:, None] == lanes, values[None, :], 0), 1)


@triton.jit
def chunk_of(rows, ends):
    """For each row index in `rows`, the chunk it falls in, chunks ending at the cumulative `ends`."""
    return tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), 1)


def matrix_pad(length: int) -> int:
    """W_PAD, E_PAD or G_PAD: a side of a receiver's count matrix (a row per source, a column per
    local expert), a power of two and at least 16. Triton 3.6 (sm_90) lowers a scan over a side
    shorter than the elements a thread holds in the kernel's 16-byte copies (4 int32, 8 int16,
    16 int8: the matrix takes the copies' layout) wrongly or not at all:
    - 2 rows, int32 copies: rows of the second source placed wrong (`test_low_latency_placement`
      shows the scan placing rows wrong), exact with 4 rows;
    - columns: 2 local experts in the low-latency receive (int32 copies of 256 words), and 3 or 4
      experts per rank in `all_to_all_v` of bf16 and int8 rows (G_PAD 4; int8 also at 8; copies of
      512 elements), stopped in the scan's lowering (an assertion in ScanOpToLLVM.cpp); compiled
      for sm_90 here, every one of them compiles with 16.
    16 covers every element size; the padding costs a few words of counts."""
    return max(16, triton.next_power_of_2(length))
