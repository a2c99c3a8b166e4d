"""Records of partial attention, how they merge, and the exchange that merges them across ranks.

A record is the attention of a group of query heads (the GROUP = Hq / Hkv heads of one KV head, of
one sequence) over some set of positions: the GROUP output rows, already normalised, then their
GROUP log-sum-exps (base 2: lse = log2 sum_i 2^(s_i), s_i = q . k_i * sm_scale * log2(e)), in fp32,
`record_size(GROUP, D)` words padded to whole 64-byte lines. Records of disjoint position sets
merge exactly: with M the largest lse, o = sum_r 2^(lse_r - M) o_r / sum_r 2^(lse_r - M), and lse =
M + log2 of that sum. An empty set has lse = -inf and o = 0 and weighs nothing; if every record
is empty the merge gives o = 0 (softmax over no positions; SDPA would give NaN).

The exchange (several ranks). A unit is a (sequence b, KV head h) pair, unit = b * Hkv + h. On each
rank the split-KV kernel's last program of a unit merges that rank's records of it and sends the
result to every rank, itself included (`send_record`): into row `rank` of the unit's records in
slot e % 2 of each rank's staging (through `dl.symm_at` on this node, an NVSHMEM put on another),
then raises flag (unit, rank) there to e, the call's epoch. Then the combine kernel, on every rank,
waits for flags (unit, 0..world-1) and merges the world records of the unit in rank order, so every
rank computes the same bits. Its programs wait only on split-KV kernels, which wait on nothing, so
neither kernel needs its whole grid resident.

Epochs and slots. The combine kernel counts its calls (`_protocol.call_epoch`); the split-KV kernel,
queued before it on the same stream, reads the same counter: e = count // combine programs + 1.
Two slots suffice: a rank that sends into slot e % 2 in call e has finished the combine of call
e - 1, which waited for every rank's flag of call e - 1, raised after that rank had finished the
combine of call e - 2, the last reader of slot e % 2.
"""
import triton
import triton.language as tl

import tridist.language as dl
from tridist.runtime.jit import jit

from .._protocol import after_flags, call_epoch, finish_call


@triton.constexpr_function
def record_size(group, head_dim):
    """fp32 words of one record: group * head_dim outputs and group lse, padded to 16 words."""
    return triton.cdiv(group * (head_dim + 1), 16) * 16


@triton.constexpr_function
def group_rows(group):
    """Rows of a record's outputs in a block: the group padded to a power of two."""
    return triton.next_power_of_2(group)


def merge_rows(group: int, head_dim: int, num_warps: int, count: int) -> int:
    """Records a merge loads at once (of `count`): about 32 fp32 words a thread. The last program of
    a unit merges `splits` records alone, one round of loads after another, so rounds should be few;
    but the merge must not set the registers of the split-KV kernel's every program (and so how many
    an SM holds): at 32 words it takes at most the 128 registers the paged loop over K and V takes
    anyway (GQA 4 and 32, D 64 and 128, on sm_90), and 120 with the contiguous loop, which is held to
    3 programs per SM by its shared memory."""
    return max(1, min(triton.next_power_of_2(count), 32 * 32 * num_warps // (group_rows(group) * head_dim)))


@triton.jit
def merge_records(records, stride, count, GROUP: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr):
    """Merge `count` records `stride` words apart, ROWS at a time, in order. Returns (acc, m, l),
    acc [group_rows, D] and m, l [group_rows, 1]: `finish_record` makes the merged record of them.
    The loads skip L1 (`.cg`): other programs or ranks wrote the records, and this SM may hold
    stale lines of them from an earlier call."""
    heads = tl.arange(0, group_rows(GROUP))[None, :, None]
    outputs = heads * D + tl.arange(0, D)[None, None, :]
    rows = tl.arange(0, ROWS)[:, None, None]
    m = tl.full([group_rows(GROUP), 1], float("-inf"), tl.float32)
    l = tl.zeros([group_rows(GROUP), 1], tl.float32)  # noqa: E741 - the softmax denominator, as the papers name it
    acc = tl.zeros([group_rows(GROUP), D], tl.float32)
    for first in range(0, count, ROWS):
        mask = (first + rows < count) & (heads < GROUP)
        base = records + (first + rows) * stride
        lse = tl.load(base + GROUP * D + heads, mask=mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(base + outputs, mask=mask, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        pivot = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing attended yet: all weights 0
        scale = tl.exp2(m - pivot)
        weight = tl.exp2(lse - pivot[None])
        l = l * scale + tl.sum(weight, axis=0)  # noqa: E741
        acc = acc * scale + tl.sum(weight * o, axis=0)
        m = m_new
    return acc, m, l


@triton.jit
def finish_record(acc, m, l):
    """(output, lse) from a merge's or an attention's (acc, m, l), m and l a column: 0 and -inf
    where l is 0."""
    seen = l > 0
    total = tl.where(seen, l, 1.0)
    return acc / total, tl.where(seen, m + tl.log2(total), float("-inf"))


@triton.jit
def store_record(record, o, lse, GROUP: tl.constexpr, D: tl.constexpr):
    """Write a record of (output [rows, D], lse [rows, 1]) for the first GROUP rows."""
    heads = tl.arange(0, o.shape[0])[:, None]
    tl.store(record + heads * D + tl.arange(0, D)[None, :], o, mask=heads < GROUP)
    tl.store(record + GROUP * D + heads, lse, mask=heads < GROUP)


@triton.jit
def store_output(out_ptr, unit, o, GROUP: tl.constexpr, D: tl.constexpr):
    """The first GROUP rows of o ([rows, D]) into rows unit * GROUP... of out ([B, Hq, D])."""
    heads = tl.arange(0, o.shape[0])[:, None]
    tl.store(out_ptr + (unit * GROUP + heads) * D + tl.arange(0, D)[None, :], o.to(out_ptr.dtype.element_ty),
             mask=heads < GROUP)


@triton.jit
def send_record(o, lse, unit, units, staging_ptr, flags_ptr, calls_ptr, slot_numel, combine_programs,
                local_world_size, GROUP: tl.constexpr, D: tl.constexpr):
    """This rank's merged record of `unit` to every rank (this one first), with flag (unit, rank)."""
    epoch = dl.ld(calls_ptr, scope="gpu", semantic="relaxed") // combine_programs + 1
    me = dl.rank()
    world = dl.num_ranks()
    record = staging_ptr + (epoch % 2) * slot_numel + (me * units + unit) * record_size(GROUP, D)
    flag = flags_ptr + (epoch % 2) * (units * world) + unit * world + me
    # Every record first, then the flags: the first flag's release waits for all the stores at once,
    # the later ones for nothing (one NVLink round trip, not one per peer).
    for step in range(world):
        peer = (me + step) % world
        if peer // local_world_size == me // local_world_size:
            store_record(dl.symm_at(record, peer), o, lse, GROUP, D)
    for step in range(world):
        peer = (me + step) % world
        if peer // local_world_size == me // local_world_size:
            dl.notify(flag, peer, signal=epoch, sig_op="set")
        else:  # from this rank's copy, stored above and made visible by the first notify's barrier
            dl.shmem.putmem_signal_nbi_block(record, record, record_size(GROUP, D) * 4, flag, epoch,
                                             dl.shmem.SIGNAL_SET, peer)
    dl.shmem.quiet()


@jit
def flash_decode_combine_kernel(out_ptr, staging_ptr, flags_ptr, calls_ptr, units, slot_numel,
                                GROUP: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr):
    """Program t merges units t, t + programs, ...: each unit's records from every rank, in rank
    order, once their flags are up, into the GROUP rows of out ([B, Hq, D]) that belong to it."""
    epoch = call_epoch(calls_ptr)
    world = dl.num_ranks()
    stage = staging_ptr + (epoch % 2) * slot_numel
    flags = flags_ptr + (epoch % 2) * (units * world)
    for unit in range(tl.program_id(0), units, tl.num_programs(0)):
        records = after_flags(stage + unit * record_size(GROUP, D), flags + unit * world, world, epoch)
        acc, m, l = merge_records(records, units * record_size(GROUP, D), world, GROUP, D, ROWS)
        o, _ = finish_record(acc, m, l)
        store_output(out_ptr, unit, o, GROUP, D)
    finish_call(calls_ptr)
