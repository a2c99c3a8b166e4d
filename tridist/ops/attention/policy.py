"""flash_decode's choices: the configs of the split-KV kernel (`configs`), how many chunks each
sequence's positions are cut in (`choose_splits`), and the combine kernel's shape
(`combine_shape`). Each constant says why it is what it is, and where it was measured.

A config is a dict: BLOCK_N, positions per step of a program's loop; num_warps and num_stages, as
Triton takes them (a paged cache gets PAGED_EXTRA_STAGES more); and either programs_per_sm, how
many programs of the split-KV kernel per SM the split count aims at, or splits, a fixed number of
chunks per sequence.
"""
import torch
import triton

# Programs of the split-KV kernel per SM that the split count aims at, where they cannot all be
# resident at once: neither 2 nor 6 an SM was faster at every shape (benchmarks/NOTES.md, "Split
# counts").
PROGRAMS_PER_SM = 4
# The configs swept on GPUs (`tridist bench flash_decode --sweep`), the default first.
GPU_CONFIGS = [dict(BLOCK_N=block, num_warps=warps, num_stages=stages, programs_per_sm=PROGRAMS_PER_SM)
               for block in (64, 32, 128) for warps, stages in ((4, 3), (4, 2), (4, 4), (8, 3))]
# The emulator: small steps, so that tiny test sequences still take several steps and chunks.
EMULATOR_CONFIGS = [dict(BLOCK_N=16, num_warps=4, num_stages=1, programs_per_sm=PROGRAMS_PER_SM)]
# A chunk shorter than this many steps spends more on its record than it saves (a judgement: not
# measured on its own).
MIN_STEPS_PER_SPLIT = 4
# Stages a paged cache compiles with beyond the config's num_stages: the block table's load, on which
# the K and V addresses depend, takes two stages of Triton's pipeline, which would otherwise leave one
# K/V tile in flight (benchmarks/NOTES.md, "Moved from the code's docstrings (issue 41)",
# attention/decode.py).
PAGED_EXTRA_STAGES = 2

# The combine kernel: fp32 values a program loads at once, 32 a thread of its COMBINE_WARPS warps
# (a register budget), and the fewest output columns a program merges: a piece's rows are then at
# least 32 bytes, one sector of memory.
COMBINE_TILE = 4096
COMBINE_WARPS = 4
MIN_COLUMNS = 8


def configs(device: torch.device) -> list[dict]:
    """The configs to sweep on `device`, the default first."""
    return [dict(c) for c in (GPU_CONFIGS if device.type == "cuda" else EMULATOR_CONFIGS)]


def choose_splits(config: dict, units: int, capacity: int, sms: int, resident: int | None = None) -> int:
    """Chunks per sequence: `splits` if the config fixes them; else enough for about
    programs_per_sm programs of (units x splits) per SM, but where the kernel's programs can all be
    resident at once (`resident` of them: `tridist.coresident_programs`), no more than fill that
    one wave, since a wave that ends in a tail of one program an SM is what costs (benchmarks/NOTES.md,
    "Split counts"); each chunk at least MIN_STEPS_PER_SPLIT steps of the longest sequence this
    cache can hold (`capacity` positions)."""
    if "splits" in config:
        return config["splits"]
    wanted = most_splits(config, units, sms)
    if resident is not None and units <= resident:
        wanted = min(wanted, resident // units)
    return max(1, min(wanted, capacity // (MIN_STEPS_PER_SPLIT * config["BLOCK_N"])))


def most_splits(config: dict, units: int, sms: int) -> int:
    """The most chunks per sequence `choose_splits` gives, whatever the cache: what `partials` holds."""
    return config["splits"] if "splits" in config else max(1, triton.cdiv(config["programs_per_sm"] * sms, units))


def combine_shape(group: int, head_dim: int, splits: int, world_size: int) -> tuple[int, int, int]:
    """(COLUMNS, ROWS, RANK_ROWS) of the combine kernel: the output columns of an item, and how
    many records (of `splits` chunks) and pieces (of `world_size` ranks) it loads at once. Columns
    as few as let every chunk load at once within COMBINE_TILE, but not below MIN_COLUMNS."""
    rows_of_group = triton.next_power_of_2(group)
    columns = max(MIN_COLUMNS, min(head_dim, COMBINE_TILE // (triton.next_power_of_2(splits) * rows_of_group)))
    per_round = max(1, COMBINE_TILE // (rows_of_group * columns))
    return (columns, min(triton.next_power_of_2(splits), per_round),
            min(triton.next_power_of_2(world_size), per_round))
