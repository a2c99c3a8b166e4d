"""The MoE family's choices: how the tensor-parallel ops (`ag_moe`, `moe_rs`) walk their GEMM's tiles,
and how many SMs `moe_rs` gives the combine beside its GEMM. (ag_moe moves its tokens as ag_gemm
moves A: its `comm="auto"` is `gemm.policy.choose_ag_gemm_comm`'s.) Within a process group, the
group's ranks are the ranks they count."""

TILE_ORDERS = ("auto", "source", "expert")
"""The `tile_order`s of `ag_moe` and `moe_rs` (the walks: `tensor_parallel.routing`)."""

AG_MOE_SOURCE_ROWS = 256
"""ag_moe's "auto" walks by source where the (source, expert) segments average at least this many
rows: below, the GEMM waits on the weights, which the walk by source reads once per rank.
Measured: benchmarks/NOTES.md, "Moved from the code's docstrings (issue 41)",
"tridist/ops/moe/policy.py"."""

MOE_RS_SOURCE_ROWS = None
"""moe_rs's "auto" walks by expert at any size (None: no number of rows makes it walk by source):
by source its peers' combine holds a quarter of the SMs through the GEMM, and by expert was the
faster at every layer measured. Measured: benchmarks/NOTES.md, "Moved from the code's docstrings
(issue 41)", "tridist/ops/moe/policy.py"."""

MOE_RS_COMM_SHARE = 4
"""moe_rs's combine for the peers, beside the GEMM, runs on 1 / MOE_RS_COMM_SHARE of the SMs: the
fastest share of those tried at every layer. Measured: benchmarks/NOTES.md, "Moved from the code's
docstrings (issue 41)", "tridist/ops/moe/policy.py"."""


def choose_tile_order(tile_order: str, pairs: int, experts: int, source_rows: int | None, ranks) -> bool:
    """Whether an op of `pairs` rows of h over `experts` walks its tiles by expert: with several
    ranks (`ranks`: the op's `ops.ranks.Ranks`, or the world), where `tile_order` is "expert", or
    "auto" and the segments average fewer than `source_rows` rows (None: any number). At one rank
    both walks are one. Raises ValueError for another order."""
    if tile_order not in TILE_ORDERS:
        raise ValueError(f"tile_order must be one of {', '.join(map(repr, TILE_ORDERS))}; got {tile_order!r}")
    world_size = ranks.world_size
    if world_size == 1 or tile_order == "source":
        return False
    return tile_order == "expert" or source_rows is None or pairs < source_rows * world_size * experts


def moe_rs_comm_programs(comm_programs: int | None, programs: int) -> int:
    """The programs of moe_rs's combine for the peers beside its GEMM: `comm_programs` if given,
    else MOE_RS_COMM_SHARE's part of the `programs` the op may use."""
    return comm_programs or max(1, programs // MOE_RS_COMM_SHARE)
