"""The gemm family's choices: the method each overlapped GEMM runs for `"auto"` (or, where the
user has no choice, for the topology), and the thresholds behind the default configs.

Every threshold is a named constant, with why it sits where it does and where the measurements
behind it are written down: a section of docs/performance.md, or of benchmarks/NOTES.md (its
section "Moved from the code's docstrings (issue 41)" keeps, under the name of the module they
came from, what the code's docstrings used to say about them).
"""

GEMM_AR_LL_MAX_ROWS = 128
"""gemm_ar's LL packets beat one_shot up to this many rows on one node: at decode-sized M latency
dominates, above it the packets' doubled bytes cost more than the flag round trips they save.
docs/performance.md, "2 x H200 (NV18)" (gemm_ar (ll)); benchmarks/NOTES.md, "Moved from the code's
docstrings (issue 41)", "tridist/ops/gemm/policy.py"."""

DECODE_TILES = ((64, (64, 128)), (128, (128, 64)))
"""The default tile (BLOCK_M, BLOCK_N) of a decode batch, by the most rows it takes: with few rows
the GEMM streams B, so one row of tiles should read it once; these are the tiles `tridist.tune`
picked on 2 x H200. Larger products take `persistent.pick_tile`'s tile. benchmarks/NOTES.md, "Moved
from the code's docstrings (issue 41)", "tridist/ops/gemm/persistent.py"."""

GROUPED_DECODE_ROWS = 64
"""The grouped GEMM takes its decode configs while its groups average this many rows or fewer: a
few rows per expert leave the GEMM streaming the weights, where 64-row tiles (the smallest wgmma
takes) with deep pipelines keep HBM busy. benchmarks/NOTES.md, "Moved from the code's docstrings
(issue 41)", "tridist/ops/gemm/policy.py" (where the decode layer's timings are)."""

CE_PUSH_IN_TURN = True
"""ag_gemm's comm="ce" (and ag_moe's) pushes the shard to one peer after another, so that each rank
receives its next rank's shard, the one its GEMM reads after its own, at the links' whole rate
(`CopyEnginePush.push(..., in_turn=True)`); False pushes to every peer at once, a stream each, which
was slower at 4 ranks than pulling one shard after another (benchmarks/NOTES.md, "ag_gemm at 4 ranks:
the copy engines' order"); in turn has not been timed yet: `tridist bench ag_gemm --ce-order` times
either."""

SM_COMM_SHARE = 16
"""ag_gemm's comm="sm" (and ag_moe's) pushes the shard with 1/SM_COMM_SHARE of the SMs by default
(8 of an H200's 132), and the GEMM keeps the others: "sm" is there for several nodes, where the
network, not these programs, sets the pace. No measurement across nodes has set it."""


def choose_gemm_ar(m: int, ranks) -> str:
    """The method gemm_ar's `"auto"` runs for an m-row product among `ranks` (an `ops.ranks.Ranks`
    or the world: what counts is the nodes they span): `"ll"` up to `GEMM_AR_LL_MAX_ROWS` rows on
    one node (LL packets reach the peers of this node only), else `"one_shot"`."""
    return "ll" if ranks.nnodes == 1 and m <= GEMM_AR_LL_MAX_ROWS else "one_shot"


def choose_ag_gemm_comm(ranks) -> str:
    """The comm ag_gemm's (and ag_moe's) `"auto"` runs among `ranks` (as `choose_gemm_ar`'s):
    `"ce"` on one node, where the copy engines move the shard and the GEMM keeps every SM; else
    `"sm"`, the one that crosses nodes."""
    return "ce" if ranks.nnodes == 1 else "sm"


def choose_gemm_rs(ranks) -> str:
    """The method gemm_rs runs among `ranks` (as `choose_gemm_ar`'s; it takes no `method=`):
    `"one_shot"` on one node, where every partial tile goes straight to its owner; `"2d"` across
    nodes, where the tiles are summed on each node first, so that each crosses to another node
    once."""
    return "one_shot" if ranks.nnodes == 1 else "2d"
