"""The routing's stable counting sort (`tridist.ops.moe._sort`) against a sort on the host: pairs
over many experts and tokens over ranks, several blocks each, ids of -1 and out of range, no items;
each group's items in place order; `count`, which adds the totals alone; and `drop_ids`, which
makes the ids out of range -1 and counts them."""
import pytest
import torch
import triton

from tridist.ops.moe import _sort as sort


def _expected(idx: torch.Tensor, groups: int, per_group: int):
    """(member [items, groups] bool, place [items, groups], counts [groups]) on the host."""
    group = torch.where(idx >= 0, idx // per_group, -1)
    member = (group[:, :, None] == torch.arange(groups)[None, None, :]).any(1)
    place = member.int().cumsum(0) - member.int()
    return member, place, member.int().sum(0)


def _sort_body(w):
    generator = torch.Generator().manual_seed(5)
    cases = [  # (items, topk, groups, per_group, one_group)
        (1500, 1, 40, 1, True),     # pairs over 40 experts: 6 blocks of 256, 3 chunks of 16
        (5000, 3, 3, 4, False),     # tokens over 3 ranks of 4 experts: 20 blocks of 256
        (37, 2, 5, 2, False),
        (0, 2, 5, 2, False),
    ]
    for items, topk, groups, per_group, one_group in cases:
        idx = torch.randint(-1, groups * per_group + 2, (items, topk), generator=generator)
        counts = torch.full((groups,), -7, dtype=torch.int32, device=w.device)
        positions = torch.full((items,) if one_group else (items, groups), -7, dtype=torch.int32, device=w.device)
        order = None if one_group else torch.full((groups, max(items, 1)), -7, dtype=torch.int32, device=w.device)
        sort.sort(idx.view(-1).to(w.device) if one_group else idx.to(w.device), positions, counts, groups,
                  per_group, one_group=one_group, order=order)
        member, place, expected_counts = _expected(idx, groups, per_group)
        what = f"{items} items of top-{topk} over {groups} groups"
        assert torch.equal(counts.cpu(), expected_counts.int()), what
        if one_group:  # an item's one group: its place there; items of no group left alone
            added = torch.ones(groups, dtype=torch.int32, device=w.device)
            sort.count(idx.view(-1).to(w.device), added, groups, per_group)
            assert torch.equal(added.cpu(), expected_counts.int() + 1), f"count: {what}"
            expected = torch.where(member.any(1), (place * member).sum(1), -7).int()
        else:
            expected = torch.where(member, place, -1).int()
            for group in range(groups):  # the inverse: each group's items in place order
                items_of = member[:, group].nonzero().flatten().int()
                assert torch.equal(order[group, :len(items_of)].cpu(), items_of), f"order of group {group}: {what}"
        assert torch.equal(positions.cpu(), expected), what
    idx = torch.tensor([[3, -1, 9], [-2, 0, 8], [1 << 40, -(1 << 40), 7]])
    for lowest, kept, dropped in ((-1, [[3, -1, -1], [-1, 0, -1], [-1, -1, 7]], 5),
                                  (0, [[3, -1, -1], [-1, 0, -1], [-1, -1, 7]], 6)):
        count = torch.full((1,), 10, dtype=torch.int64, device=w.device)
        assert sort.drop_ids(idx.to(w.device), lowest, 8, count).tolist() == kept, f"drop_ids from {lowest}"
        assert int(count) == 10 + dropped, f"drop_ids from {lowest}: counted {int(count) - 10}"


@pytest.mark.worlds("1")
def test_sort(world):
    world.run(_sort_body)


@pytest.mark.parametrize("items, groups, one_group", [(1, 1, True), (10 ** 6, 256, True), (10 ** 6, 8, False),
                                                      (4096, 2, False), (1024, 256, True)])
def test_sort_shape(items, groups, one_group):
    """Blocks of whole steps covering every item, few enough for `positions_kernel` to sum at once."""
    chunk, step, per_block, blocks = sort.sort_shape(items, groups, one_group)
    assert chunk * step <= sort.SORT_IDS and step <= sort.MAX_STEP and per_block % step == 0
    assert (blocks - 1) * per_block < items <= blocks * per_block
    assert triton.next_power_of_2(blocks) * chunk <= sort.SORT_IDS
