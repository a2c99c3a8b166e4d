"""The local MoE's choices: which rows its tiles take (`experts`' two layouts) and the tiles of its
two kernels. None of these has been timed yet: they are first picks from the grouped GEMM's
(`gemm.grouped`, `gemm.persistent`) and from what a decode step reads, for `tridist bench moe_local
--sweep` to check on a GPU."""
import triton

from ...sizing import programs_for

DENSE_TOKENS = 64
"""Up to this many tokens a call takes the dense rows (`experts`): a tile per used expert whose rows
are every token, those routed elsewhere masked. Compute is cheap there (a decode batch), and it
needs no sort; past it, the wasted rows (T of every expert's tile, about T * topk / E of them used)
cost more than the sort saves, and the pairs are sorted by expert."""

# Tiles of the dense rows: few rows, so the kernels stream the weights; the column tiles are the
# widest that still give every SM a program (`dense_configs`), each reading whole 128-byte rows
# or more of a weight tile (BLOCK_K rows a step, in flight `num_stages` deep).
DENSE_UP_COLUMNS = (64, 32)   # per half: the gate's and the up's columns of one tile
DENSE_DOWN_COLUMNS = (128, 64)
DENSE_BLOCK_K = 128
DENSE_STAGES = 4

# Tiles of the sorted rows (prefill): the grouped GEMM's big tile. The gate and up halves of a tile
# make one 128 x 256 product, as `persistent`'s first config. The down kernel's epilogue (the parts
# stored, the counts, a finished token's sum read back) is long beside its main loop at K = 768:
# at 3 stages a program takes 98 KB of shared memory and 126 registers a thread, so that two share
# an SM and one's epilogue runs beside the other's loop (at 4 stages, 131 KB: one an SM;
# benchmarks/NOTES.md, "The local MoE's down kernel: registers").
SORTED_UP = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
SORTED_DOWN = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)

# The emulator: small tiles, so that small shapes have several of them.
EMULATOR_UP = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)
EMULATOR_DOWN = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)


def dense(tokens: int) -> bool:
    """Whether a call of `tokens` tokens takes the dense rows."""
    return tokens <= DENSE_TOKENS


def dense_rows(tokens: int) -> int:
    """BLOCK_M of the dense rows: every token, at least the 16 rows a tensor-core product takes."""
    return max(16, triton.next_power_of_2(tokens))


def configs(device, tokens: int, topk: int, experts: int, inner: int, hidden: int) -> tuple[dict, dict]:
    """(the gate/up kernel's config, the down kernel's) for a call of `tokens` tokens of `topk`
    experts each, of `experts` experts of `inner` x `hidden`: dicts of BLOCK_M, BLOCK_N, BLOCK_K,
    GROUP_M, num_warps, num_stages."""
    if device.type != "cuda":
        up, down = dict(EMULATOR_UP), dict(EMULATOR_DOWN)
    elif dense(tokens):
        slots, programs = min(experts, tokens * topk), programs_for(device)

        def widest(columns, n):
            return next((c for c in columns if slots * triton.cdiv(n, c) >= programs), columns[-1])

        up, down = ({"BLOCK_N": widest(columns, n), "BLOCK_K": DENSE_BLOCK_K, "GROUP_M": 1, "num_warps": 4,
                     "num_stages": DENSE_STAGES} for columns, n in ((DENSE_UP_COLUMNS, inner),
                                                                    (DENSE_DOWN_COLUMNS, hidden)))
    else:
        up, down = dict(SORTED_UP), dict(SORTED_DOWN)
    if dense(tokens):
        up["BLOCK_M"] = down["BLOCK_M"] = dense_rows(tokens)
    return up, down
