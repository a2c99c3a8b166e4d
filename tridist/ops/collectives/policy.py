"""What `method="auto"` runs for each collective, and the other choices of the family's sizing.

Every threshold is a named constant that says why it sits where it does and where its measurement
is (H200s joined by NVLink, bf16): docs/performance.md, section "2 x H200 (NV18)", holds the latest
figure of every size, benchmarks/NOTES.md the runs behind each crossover. An op built with `group=`
chooses by the group's size and nodes, as for a world of that shape (the measurements are worlds').
"""

LL_MAX_GATHERED_BYTES = 1 << 20
"""An all-gather of at most this many bytes in all (every rank's shard together) runs in LL packets:
up to there their doubled bytes cost less than the signal round trip they save (docs/performance.md,
"2 x H200 (NV18)"; benchmarks/NOTES.md, "Moved from the code's docstrings (issue 41)")."""

LL_MAX_SENT_BYTES = 1 << 20
"""A reduce-scatter or all-reduce in which a rank sends at most this many bytes runs in LL packets,
for the same reason (same sections)."""

ONE_SHOT_MAX_SENT_BYTES = 4 << 20
"""An all-reduce in which a rank sends at most this many bytes runs one-shot (one step, world_size - 1
copies received) with 2 ranks, where the two-shot receives as much in two steps, and across nodes;
above, the two-shot's 2 (n-1)/n of the data received wins (docs/performance.md, "2 x H200 (NV18)":
one-shot at 4 MB, two-shot from 16 MB). From 3 ranks on one node the two-shot takes over from LL
directly: one-shot receives (n-1)/2 times its bytes ("4 x H200 (NV18)": at 1 MB two-shot 20.8 us,
one-shot 23.4)."""

RS_AG_MIN_BYTES = 64 << 20
"""From 4 ranks on one node, an all-reduce of at least this many bytes a rank (regular tensors) runs as
`rs_ag`, the reduce-scatter and then the all-gather of the sums as two kernels (at this size the ring
all-gather): at 64 and 256 MB it beat the two-shot by 10 and 13 %, at 16 MB it was level ("4 x
H200 (NV18)"; benchmarks/NOTES.md, "rs_ag at 4 ranks, timed"). With 2 ranks not
measured: the two-shot stays."""

TWO_D_ONE_NODE_RANKS = 4
"""From this many ranks on one node, an all-gather larger than LL's range and smaller than
`RING_MIN_GATHERED_BYTES` runs the `2d` method (on one node, its node-local half alone: each
rank's programs spread the shard to every peer in whole tasks, without the push's slices): at 4 and
16 MB it beat the push by 7 and 9 % ("4 x H200 (NV18)"); with 2 ranks the push was as fast or faster
("2 x H200 (NV18)")."""

RING_MIN_GATHERED_BYTES = 64 << 20
"""From 4 ranks on one node, an all-gather of at least this many bytes in all runs as a ring: each
rank then sends to one neighbour, and at 64 and 256 MB that beat the push, which sends to every
peer at once ("4 x H200 (NV18)"); with 2 ranks both send to the one peer, and the push wins."""

CE_SYMMETRIC_MIN_BYTES = 64 << 20
"""Above this, an all-gather into a symmetric `out` runs on the copy engines, which then write straight
into the peers' `out` and skip the staging: faster than the sliced push at 256 MB, not at 64 MB
(benchmarks/NOTES.md, "Collectives on symmetric tensors")."""

SYMMETRIC_TWO_PER_SM_BYTES = 64 << 20
"""From this size the in-place symmetric two-shot all-reduce runs two programs per SM unless its
caller caps the programs: faster from 64 MB, slower below (benchmarks/NOTES.md, "Collectives on
symmetric tensors" and "Moved from the code's docstrings (issue 41)")."""


def choose_all_gather(total_bytes: int, ranks, symmetric_out: bool = False) -> str:
    """The method `"auto"` runs for an all-gather of `total_bytes` (all ranks' shards together) among
    `ranks` (the world or the op's group: its `world_size` and `nnodes`): `"2d"` across nodes (each
    shard crosses the network once per node, where `"push"` sends it once per rank; not measured
    across nodes); `"ll"` up to `LL_MAX_GATHERED_BYTES` when every shard is whole 4-byte words;
    `"ce"` into a symmetric `out` above `CE_SYMMETRIC_MIN_BYTES`; else `"push"`. The copy engines
    are otherwise left to callers that keep the SMs busy with other work: on their own the SM
    methods are faster. From 4 ranks, `"ring"` from `RING_MIN_GATHERED_BYTES`, and `"2d"` between
    LL's range and it (`TWO_D_ONE_NODE_RANKS`)."""
    if ranks.nnodes > 1:
        return "2d"
    if total_bytes <= LL_MAX_GATHERED_BYTES and total_bytes % (4 * ranks.world_size) == 0:
        return "ll"
    if symmetric_out and total_bytes > CE_SYMMETRIC_MIN_BYTES:
        return "ce"
    if ranks.world_size >= 4 and total_bytes >= RING_MIN_GATHERED_BYTES:
        return "ring"
    if ranks.world_size >= TWO_D_ONE_NODE_RANKS and total_bytes > LL_MAX_GATHERED_BYTES:
        return "2d"
    return "push"


def choose_reduce_scatter(nbytes: int, ranks) -> str:
    """The method `"auto"` runs for a reduce-scatter of `nbytes` per rank among `ranks` (the world
    or the op's group): `"2d"` across nodes (it puts each node's sum over the network once; not
    measured across nodes); `"ll"` while a rank sends ((world-1)/world of x) at most
    `LL_MAX_SENT_BYTES` and its chunk is whole 4-byte words; else `"one_shot"`. `"ce"` is left to
    callers that keep the SMs busy with other work: on their own the SM methods are faster
    (benchmarks/NOTES.md, "Moved from the code's docstrings (issue 41)")."""
    n = ranks.world_size
    if ranks.nnodes > 1:
        return "2d"
    if n > 1 and nbytes * (n - 1) // n <= LL_MAX_SENT_BYTES and (nbytes // n) % 4 == 0:
        return "ll"
    return "one_shot"


def choose_all_reduce(nbytes: int, ranks, symmetric_in_place: bool = False) -> str:
    """The method `"auto"` runs for an all-reduce of `nbytes` per rank among `ranks` (the world or
    the op's group), by what a rank sends (`nbytes * (world_size - 1)`): `"ll"` on one node up to
    `LL_MAX_SENT_BYTES` of whole 4-byte words, `"one_shot"` up to `ONE_SHOT_MAX_SENT_BYTES` with 2
    ranks or across nodes, `"rs_ag"` from 4 ranks on one node from `RS_AG_MIN_BYTES`, else
    `"two_shot"`. In place on a symmetric x on one node the two-shot needs no staging and takes over
    from `"ll"` directly. `"ce"` is left to callers that keep the
    SMs busy with other work: on their own the SM methods are faster (same section)."""
    n = ranks.world_size
    sent = nbytes * (n - 1)
    if ranks.nnodes == 1 and sent <= LL_MAX_SENT_BYTES and nbytes % 4 == 0:
        return "ll"
    one_node_two_shot = ranks.nnodes == 1 and (symmetric_in_place or n > 2)
    if sent <= ONE_SHOT_MAX_SENT_BYTES and not one_node_two_shot:
        return "one_shot"
    if ranks.nnodes == 1 and n >= 4 and nbytes >= RS_AG_MIN_BYTES and not symmetric_in_place:
        return "rs_ag"
    return "two_shot"


def symmetric_two_shot_programs(nbytes: int, programs: int) -> int:
    """The programs the in-place symmetric two-shot all-reduce of `nbytes` per rank runs when its
    caller does not cap them: `programs` (one per SM), twice that from `SYMMETRIC_TWO_PER_SM_BYTES`."""
    return 2 * programs if nbytes >= SYMMETRIC_TWO_PER_SM_BYTES else programs
