"""What `method="auto"` runs for `all_reduce_rms_norm` (`choose_all_reduce_rms_norm`), and how a row
is cut into the chunks a program holds at once (`row_shape`).

None of the crossovers here has been timed yet: they follow the all-reduce's measured ones
(`collectives.policy`) and the bytes each method receives, and say so.
"""
import triton

from ..collectives.policy import LL_MAX_SENT_BYTES

ONE_PASS_MAX = 16384
"""Rows of at most this many elements are held in registers whole (16 warps, 32 elements a
thread): read once, normed, written. A longer row is cut in chunks of `CHUNK`: its new residual is
stored chunk by chunk while the squares are summed, then read back for the norm (two passes)."""

CHUNK = 8192
"""Elements of a chunk of a row longer than `ONE_PASS_MAX`."""

ELEMENTS_PER_THREAD = 16
"""Elements of a chunk each thread holds (a register budget, not timed): a chunk of 4096 runs on 8
warps, of 2048 or fewer on 4, of 8192 or more on 16."""

DECODE_MAX_TOKENS = 256
"""Up to this many rows ("decode sizes") the op is one kernel whatever the ranks: `ll` or `one_shot`."""


def row_shape(hidden: int, block: int | None = None) -> tuple[int, int, bool]:
    """(BLOCK, num_warps, one_pass) for rows of `hidden` elements: BLOCK elements per chunk (a power
    of two), the whole row in one chunk up to `ONE_PASS_MAX` (one pass), else chunks of `CHUNK`.
    `block` (a power of two) sets the chunk instead: rows longer than it take two passes."""
    if block is None:
        block = triton.next_power_of_2(hidden) if hidden <= ONE_PASS_MAX else CHUNK
    else:
        block = min(block, triton.next_power_of_2(hidden))
    warps = min(16, max(4, block // (32 * ELEMENTS_PER_THREAD)))
    return block, warps, hidden <= block


def row_programs(tokens: int, programs: int) -> int:
    """Programs of the fused methods' kernels for `tokens` rows, each a contiguous range of rows of
    the same length (the last shorter): at most `programs`, and none without a row."""
    per_program = triton.cdiv(tokens, programs)
    return triton.cdiv(tokens, per_program)


def choose_all_reduce_rms_norm(tokens: int, hidden: int, itemsize: int, ranks) -> str:
    """The method `"auto"` runs for `tokens` rows of `hidden` elements of `itemsize` bytes among
    `ranks` (the world or the op's group): `"local"` at world size 1; on one node `"ll"` while a
    rank sends (`tokens * hidden * itemsize * (world_size - 1)` bytes) at most the all-reduce's
    `LL_MAX_SENT_BYTES` and a row is whole 4-byte words; `"one_shot"` up to `DECODE_MAX_TOKENS`
    rows, and beyond while it receives no more than the two-shot would (`world_size * itemsize <=
    8`: one-shot receives `(world_size - 1) * itemsize` bytes per element, the two-shot of fp32
    sums `2 (world_size - 1) / world_size * 4`); else `"two_shot"` (prefill sizes on many ranks)."""
    n = ranks.world_size
    if n == 1:
        return "local"
    sent = tokens * hidden * itemsize * (n - 1)
    if ranks.nnodes == 1 and sent <= LL_MAX_SENT_BYTES and hidden * itemsize % 4 == 0:
        return "ll"
    if tokens <= DECODE_MAX_TOKENS or n * itemsize <= 8:
        return "one_shot"
    return "two_shot"
