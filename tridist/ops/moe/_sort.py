"""A stable counting sort on the device, which the routing of both MoE families stands on: items
(tokens, or (token, expert) pairs) each belong to one or more groups (ranks, or experts), and every
item gets its place among its group's items in item order; every group gets its item count.
Expert parallelism places tokens among those sent to each rank and pairs among those of each
expert (`expert_parallel`); the tensor-parallel ops place a rank's pairs among those of each
expert (`tensor_parallel.routing`).

Two launches, each over (blocks of items, chunks of groups), so that no program walks more than
one block (`count`, for the totals alone, is the first with the blocks' counts added up):
1. `block_counts_kernel`: block b's items of each group -> block_counts[b, group].
2. `positions_kernel`: block b's items go after those of the blocks before it (the sum of their
   counts, which every program loads at once) and after the earlier items of block b itself (a
   cumulative sum over the block); the last block's programs also write the totals. Items of one
   block need no counts of other blocks: one launch. Blocks are short (`sort_shape`): a program
   that walks many items in turn is slow, however few the groups (benchmarks/NOTES.md, "Moved
   from the code's docstrings (issue 41)", "tridist/ops/moe/_sort.py").
"""
import torch
import triton
import triton.language as tl

from tridist.runtime.jit import jit

# A program compares STEP items with GROUPS groups at once (STEP x GROUPS <= SORT_IDS, STEP <=
# MAX_STEP), and loads the counts of up to SORT_IDS // GROUPS earlier blocks at once.
SORT_IDS = 8192
MAX_STEP = 256


@triton.jit
def _hits(idx_ptr, item, inside, topk, group, groups, per_group):
    """[items, groups] int32: 1 where `item` belongs to `group`, that is where one of its `topk` ids
    (int64 at idx_ptr + item * topk + k) is in [group * per_group, (group + 1) * per_group). Ids
    below 0 belong to no group."""
    hits = tl.zeros([item.shape[0], group.shape[0]], dtype=tl.int32)
    real = inside[:, None] & (group < groups)[None, :]
    for k in range(topk):
        # int32 from here: a 64-bit division costs tens of instructions.
        ids = tl.load(idx_ptr + item.to(tl.int64) * topk + k, mask=inside, other=-1).to(tl.int32)
        target = tl.where(ids >= 0, ids // per_group, -1)
        hits = tl.maximum(hits, ((target[:, None] == group[None, :]) & real).to(tl.int32))
    return hits


@jit
def block_counts_kernel(idx_ptr, block_counts_ptr, items, topk, groups, per_group, per_block, ADD: tl.constexpr,
                        GROUPS: tl.constexpr, STEP: tl.constexpr):
    """Program (b, c): block_counts[b, g] = the items of [b * per_block, (b + 1) * per_block) in
    group g, for the groups c * GROUPS ... (c + 1) * GROUPS - 1; ADD (`count`): added to
    block_counts[g] instead, the totals."""
    block = tl.program_id(0)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    stop = tl.minimum(items, (block + 1) * per_block)
    total = tl.zeros([GROUPS], dtype=tl.int32)
    for start in range(block * per_block, stop, STEP):
        item = start + tl.arange(0, STEP)
        total += tl.sum(_hits(idx_ptr, item, item < stop, topk, group, groups, per_group), 0)
    if ADD:
        tl.atomic_add(block_counts_ptr + group, total, mask=group < groups)
    else:
        tl.store(block_counts_ptr + block * groups + group, total, mask=group < groups)


@jit
def positions_kernel(idx_ptr, block_counts_ptr, positions_ptr, order_ptr, counts_ptr, items, topk, groups, per_group,
                     per_block, blocks, ONE_GROUP: tl.constexpr, ORDER: tl.constexpr, GROUPS: tl.constexpr,
                     STEP: tl.constexpr, BLOCKS: tl.constexpr):
    """Program (b, c), for the groups c * GROUPS ... (c + 1) * GROUPS - 1 and block b's items:
    - ONE_GROUP (topk 1: an item is a (token, expert) pair): positions[i] for items with a group
      (others are left alone);
    - else (an item is a token, a group a rank): positions[i * groups + group], -1 where item i is
      not in that group; and with ORDER the inverse, order[group * items + position] = i.
    The last block's programs write counts[group]. With one block, block_counts is not read."""
    block = tl.program_id(0)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    real = group < groups
    earlier = tl.arange(0, BLOCKS)
    before = tl.sum(tl.load(block_counts_ptr + earlier[:, None] * groups + group[None, :],
                            mask=(earlier < block)[:, None] & real[None, :], other=0), 0)
    stop = tl.minimum(items, (block + 1) * per_block)
    for start in range(block * per_block, stop, STEP):
        item = start + tl.arange(0, STEP)
        inside = item < stop
        hits = _hits(idx_ptr, item, inside, topk, group, groups, per_group)
        position = tl.cumsum(hits, 0) - hits + before[None, :]
        if ONE_GROUP:
            tl.store(positions_ptr + item, tl.sum(hits * position, 1), mask=inside & (tl.sum(hits, 1) > 0))
        else:
            tl.store(positions_ptr + item.to(tl.int64)[:, None] * groups + group[None, :],
                     tl.where(hits > 0, position, -1), mask=inside[:, None] & real[None, :])
            if ORDER:
                tl.store(order_ptr + group.to(tl.int64)[None, :] * items + position, item[:, None], mask=hits > 0)
        before += tl.sum(hits, 0)
    if block == blocks - 1:
        tl.store(counts_ptr + group, before, mask=real)


def sort_shape(items: int, groups: int, one_group: bool) -> tuple[int, int, int, int]:
    """(GROUPS, STEP, items per block, blocks) for `items` over `groups`: chunks of 16 groups a
    program for pairs (experts may be hundreds), of up to 64 for tokens (ranks); steps of at most
    MAX_STEP items; blocks of whole steps, as few steps a
    block as keeps the blocks within the SORT_IDS // GROUPS that `positions_kernel` sums at once."""
    chunk = min(triton.next_power_of_2(groups), 16 if one_group else 64)
    step = min(MAX_STEP, SORT_IDS // chunk)
    steps = triton.cdiv(items, step)
    per_block = step * triton.cdiv(steps, max(1, SORT_IDS // chunk))
    return chunk, step, per_block, triton.cdiv(items, per_block)


def sort(idx, positions, counts, groups: int, per_group: int, one_group: bool, order=None) -> None:
    """Queue the sort of `idx` (int64: [items, topk]; `one_group`: [pairs], topk 1; ids -1 or in
    [0, groups * per_group): `drop_ids` makes them so where the host could not check them) into
    `positions` and `counts` (int32; see `positions_kernel`). `order` (int32 [groups, items], not
    with `one_group`): each group's items in place order."""
    items, topk = (idx.numel(), 1) if one_group else idx.shape
    if items == 0:
        counts.zero_()
        return
    chunk, step, per_block, blocks = sort_shape(items, groups, one_group)
    grid = (blocks, triton.cdiv(groups, chunk))
    block_counts = counts  # not read with one block
    if blocks > 1:
        block_counts = torch.empty((blocks, groups), dtype=torch.int32, device=idx.device)
        block_counts_kernel[grid](idx_ptr=idx, block_counts_ptr=block_counts, items=items, topk=topk, groups=groups,
                                  per_group=per_group, per_block=per_block, ADD=False, GROUPS=chunk, STEP=step,
                                  num_warps=4)
    positions_kernel[grid](idx_ptr=idx, block_counts_ptr=block_counts, positions_ptr=positions,
                           order_ptr=positions if order is None else order, counts_ptr=counts, items=items, topk=topk,
                           groups=groups, per_group=per_group, per_block=per_block, blocks=blocks,
                           ONE_GROUP=one_group, ORDER=order is not None, GROUPS=chunk, STEP=step,
                           BLOCKS=triton.next_power_of_2(blocks), num_warps=4)


def count(idx, counts, groups: int, per_group: int) -> None:
    """Add to `counts` (int32 [groups]) the items of each group, `idx` as `sort` takes it with
    `one_group` (one launch, for a caller that needs no positions)."""
    items = idx.numel()
    if items == 0:
        return
    chunk, step, per_block, blocks = sort_shape(items, groups, True)
    block_counts_kernel[(blocks, triton.cdiv(groups, chunk))](
        idx_ptr=idx, block_counts_ptr=counts, items=items, topk=1, groups=groups, per_group=per_group,
        per_block=per_block, ADD=True, GROUPS=chunk, STEP=step, num_warps=4)


@jit
def drop_ids_kernel(idx_ptr, kept_ptr, dropped_ptr, items, limit, LOWEST: tl.constexpr, BLOCK: tl.constexpr):
    """kept[i] = idx[i] where it is in [LOWEST, limit), else -1; dropped[0] += the ids replaced.
    LOWEST -1 keeps -1 (none) as it is, uncounted; 0 counts it too."""
    item = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = item < items
    ids = tl.load(idx_ptr + item, mask=inside, other=-1)
    bad = inside & ((ids < LOWEST) | (ids >= limit))
    tl.store(kept_ptr + item, tl.where(bad, -1, ids), mask=inside)
    count = tl.sum(bad.to(tl.int64), 0)
    if count > 0:
        tl.atomic_add(dropped_ptr, count)


def drop_ids(idx: torch.Tensor, lowest: int, limit: int, dropped: torch.Tensor) -> torch.Tensor:
    """`idx` (int64) with every id outside `lowest` ... limit - 1 replaced by -1 (none), and their
    number added to `dropped` (int64 [1]), all on the device: one launch, no synchronisation.
    `lowest`: -1 where -1 is an id (none: `EPBuffer`), 0 where it is not (`ag_moe`)."""
    kept = torch.empty_like(idx)
    if idx.numel():
        block = min(1024, triton.next_power_of_2(idx.numel()))
        drop_ids_kernel[(triton.cdiv(idx.numel(), block),)](idx_ptr=idx, kept_ptr=kept, dropped_ptr=dropped,
                                                             items=idx.numel(), limit=limit, LOWEST=lowest,
                                                             BLOCK=block)
    return kept
