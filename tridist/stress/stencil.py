"""Stress cases of the stencils (`tridist.ops.stencil`, family "stencil"): the Jacobi solver
`Jacobi2D` (op "jacobi"), which has only its class.

A call loads a random domain (float32, boundary included, the same on every rank), then makes 1 to
3 runs of 1 to 4 iterations each, back to back with no host synchronisation, each run's method
drawn ("host_loop" or "fused"), so that later runs go on from the state and the halo signals
earlier runs left, across methods. Rows per rank from 1 to `Limits.rows` / world size, columns
from 1 to what fits `Limits.nbytes`; the default tile and programs, or (one call in four) a tile
of any powers of two and from one program to one per tile, so that the fused kernel's programs
stride over several tiles. After each run this rank's rows must equal `jacobi_reference` of the
whole domain bit for bit (the solvers make the same float32 operations in the same order). `load`
poisons the plane the first iteration writes with NaN; the copies of the solutions are poisoned too.

Not captured in CUDA graphs: `load` synchronises the ranks on the host, and each run's launches
carry its iteration numbers, so a replay could not run on new data.

Shape (`Call.shape`): (rows per rank, columns, iterations of run 1, of run 2, ...); method: the
runs' methods joined by "+"; config: BLOCK_R, BLOCK_C and programs, or None for the defaults.
"""
import torch
import triton

from tridist import ops
from tridist.ops.stencil import jacobi

from .cases import Expected, OpCases, Trial, log_uniform, poison, random_tensor, register, seed_of

MAX_RUNS, MAX_ITERATIONS = 3, 4
CONFIG_SHARE = 1 / 4  # calls with a tile and programs of their own rather than the defaults
MAX_BLOCK_C, MAX_TILE = 256, 2048  # columns and points of `jacobi.tile_for`'s largest tiles
# In the emulator a program costs about 35 ms an iteration (3 ranks on 2 cores): there a tile of a
# config takes at least a quarter of the columns and half the rows, at most 8 tiles a rank.
EMULATOR_COLUMN_TILES, EMULATOR_ROW_TILES = 4, 2


def _power_of_two(rng, least: int, most: int) -> int:
    """A power of two from `least` to `most`, each rounded up to one (`least` where it passes `most`)."""
    low, high = (triton.next_power_of_2(v).bit_length() - 1 for v in (least, most))
    return 2 ** rng.randint(low, max(low, high))


class JacobiCases(OpCases):
    name, family = "jacobi", "stencil"
    forms = ("class",)
    modes = ("eager", "streams")

    def draw(self, rng, world, limits):
        rows = log_uniform(rng, 1, max(1, limits.rows // world.world_size))
        cols = log_uniform(rng, 1, max(1, limits.nbytes // (2 * 4 * (rows + 2)) - 2))  # two float32 planes
        runs = rng.randint(1, MAX_RUNS)
        methods = [rng.choice(jacobi.METHODS) for _ in range(runs)]
        iterations = [rng.randint(1, MAX_ITERATIONS) for _ in range(runs)]
        config = None
        if rng.random() < CONFIG_SHARE:
            gpu = world.device.type == "cuda"
            block_c = _power_of_two(rng, 1 if gpu else -(-cols // EMULATOR_COLUMN_TILES), min(MAX_BLOCK_C, cols))
            block_r = _power_of_two(rng, 1 if gpu else -(-rows // EMULATOR_ROW_TILES), min(rows, MAX_TILE // block_c))
            tiles = triton.cdiv(rows, block_r) * triton.cdiv(cols, block_c)
            config = {"BLOCK_R": block_r, "BLOCK_C": block_c, "programs": rng.randint(1, tiles)}
        return dict(method="+".join(methods), dtype=torch.float32, shape=(rows, cols, *iterations), config=config)

    def trial(self, call, world):
        return JacobiTrial(call, world)


class JacobiTrial(Trial):
    """The domain, and `out`: a copy of this rank's rows (boundary columns included) after each run."""

    def __init__(self, call, world):
        self.spec, self.world = call, world
        self.rows, self.cols, *self.iterations = call.shape
        self.methods = call.method.split("+")
        self.out = torch.empty(len(self.iterations), self.rows, self.cols + 2, device=world.device)

    def fill(self, seed):
        W, me = self.world.world_size, self.world.rank
        self.domain = random_tensor((W * self.rows + 2, self.cols + 2), torch.float32, seed_of(seed, "domain"),
                                    self.world.device)
        mine = slice(1 + me * self.rows, 1 + (me + 1) * self.rows)
        state, solutions = self.domain, []
        for iterations in self.iterations:
            state = jacobi.jacobi_reference(state, iterations)
            solutions.append(state[mine])
        width = self.cols + 2

        def where(i: int) -> str:
            run, at = divmod(i, self.rows * width)
            row, column = divmod(at, width)
            return (f"after run {run + 1} ({self.methods[run]}), this rank's row {row} (the domain's "
                    f"{1 + me * self.rows + row}), column {column}")

        expected = Expected(torch.stack(solutions), where=where)
        poison(self.out, expected)
        return expected

    def build(self):
        config = self.spec.config or {}
        block = (config["BLOCK_R"], config["BLOCK_C"]) if config else None
        return ops.Jacobi2D(self.world.world_size * self.rows, self.cols, programs=config.get("programs"), block=block)

    def call(self, solver):
        solver.load(self.domain)
        for run, (method, iterations) in enumerate(zip(self.methods, self.iterations)):
            self.out[run].copy_(solver.run(iterations, method))
        return self.out


register(JacobiCases())
