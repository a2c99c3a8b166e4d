"""`linear`'s choices: which rows go to the split-K kernel (`MAX_ROWS`), and the kernel's config
for a product (`config`): its block sizes, warps, stages, and how many ranges K is split into.

A config is a dict: DOT (tensor cores; else FMA, for one row), TMA (the weight read through a
tensor descriptor; else pointer loads), BLOCK_N (output columns a program computes), BLOCK_K
(weight columns per step of its loop), num_warps, num_stages (steps in flight), splits (the most
ranges of K; `split_k.split_plan` makes them even).
"""
import triton

MAX_ROWS = 64
"""The split-K kernel takes products of up to this many rows of x; more go to cuBLAS
(`F.linear`): from about there the weight is no longer all a product reads, and cuBLAS's tiles
reuse it across rows."""

FMA_MAX_ROWS = 0
"""Products of this many rows or fewer take the FMA variant (no tensor cores); 0: none does."""

PROGRAMS_PER_SM = 4
"""The split count aims at about this many programs per SM: enough to keep every SM streaming
while the last programs of a wave finish."""

MIN_SPLIT_STEPS = 4
"""A range of K holds at least this many BLOCK_K steps: a shorter one spends more on its partial
tile and its pipeline's start than it saves."""

# (most rows, plain config, swiglu config), by the most rows each takes. Past 16 rows x's tile is
# as big as the weight's: at BLOCK_K 128 four stages of both take 128 KB of shared memory, one
# program an SM, which streams the weight too slowly (benchmarks/NOTES.md, "The decode GEMM by
# shape"); BLOCK_K 64 halves that.
GPU_CONFIGS = [
    (16, dict(DOT=True, TMA=True, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
     dict(DOT=True, TMA=True, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)),
    (64, dict(DOT=True, TMA=True, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
     dict(DOT=True, TMA=True, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)),
]
FMA_CONFIG = dict(DOT=False, TMA=False, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
# The emulator: small blocks, so that tiny test shapes still take several tiles, steps and splits.
EMULATOR_CONFIG = dict(DOT=True, TMA=False, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)
EMULATOR_MIN_SPLIT_STEPS = 1


def config(m: int, n: int, k: int, sms: int, swiglu: bool = False, gpu: bool = True) -> dict:
    """The config of an m-row product with n output columns (the gate's or up's with swiglu, whose
    weight has 2n rows) over k, on `sms` SMs (`gpu`: else the emulator's blocks), splits included."""
    if not gpu:
        chosen, least_steps = EMULATOR_CONFIG, EMULATOR_MIN_SPLIT_STEPS
    elif m <= FMA_MAX_ROWS:
        chosen, least_steps = FMA_CONFIG, MIN_SPLIT_STEPS
    else:
        plain, fused = next((p, s) for most, p, s in GPU_CONFIGS if m <= most)
        chosen, least_steps = (fused if swiglu else plain), MIN_SPLIT_STEPS
    return {**chosen, "splits": splits_for(n, k, sms, chosen, least_steps)}


def pipeline_bytes(config: dict, m: int, swiglu: bool, element_size: int = 2) -> int:
    """Shared memory the kernel's pipeline takes for m rows under `config`: num_stages steps of the
    weight's tile (two with swiglu) and of x's (m padded as the kernel pads it); none without DOT,
    whose loads go to registers."""
    if not config["DOT"]:
        return 0
    rows = max(16, triton.next_power_of_2(m))
    return (config["BLOCK_N"] * (2 if swiglu else 1) + rows) * config["BLOCK_K"] * element_size * config["num_stages"]


def splits_for(n: int, k: int, sms: int, chosen: dict, least_steps: int = MIN_SPLIT_STEPS) -> int:
    """Ranges of K for `chosen`'s tiles of n columns: the largest power of two that keeps the grid
    within PROGRAMS_PER_SM programs per SM and every range at least `least_steps` steps long (1 if
    none does)."""
    tiles = triton.cdiv(n, chosen["BLOCK_N"])
    steps = triton.cdiv(k, chosen["BLOCK_K"])
    splits = 1
    while tiles * splits * 2 <= PROGRAMS_PER_SM * sms and steps // (splits * 2) >= least_steps:
        splits *= 2
    return splits
