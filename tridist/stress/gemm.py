"""Stress cases of the GEMMs (`tridist.ops.gemm`): matmul, ag_gemm (every comm), gemm_rs and
gemm_ar (every method), in bf16, fp16 and fp8 (with per-tensor scales, b column-major), at the
default config of their size or, one call in eight, at one of `gemm.configs` the op takes.

Sizes keep the TMA alignment the ops require (K a multiple of 16 bytes, N of 8), gemm_rs's M a
multiple of the world size. Every rank makes every rank's operands and scales from the call's seed
and checks its output within `gemm_tolerance`.
"""
import random

import torch

from tridist import ops
from tridist.ops import gemm
from tridist.ops.gemm import gemm_all_reduce, persistent, shard_gather

from .cases import (Expected, Invalid, OpCases, Trial, draw_method, gemm_tolerance, log_uniform, poison, random_tensor,
                    register, round_up, seed_of)

CONFIG_SHARE = 1 / 8  # calls that pass an explicit config rather than the default of their size


class _GemmCases(OpCases):
    family = "gemm"
    flatten = True  # whether the op takes configs with FLATTEN (Triton flattens its loop nest)

    def draw(self, rng, world, limits):
        dtype = rng.choice(persistent.DTYPES)
        k = round_up(log_uniform(rng, 1, limits.k), 16 // dtype.itemsize)
        n = round_up(log_uniform(rng, 1, limits.n), 8)
        config = None
        if rng.random() < CONFIG_SHARE:
            config = rng.choice(gemm.configs(world.device, dtype=dtype))
            if config["FLATTEN"] and not self.takes_flatten(world):
                raise Invalid(f"{self.name}: config with FLATTEN, which it refuses")
        return dict(dtype=dtype, shape=(self.rows(rng, world, limits), k, n), config=config,
                    method=self.method(rng, world))

    def rows(self, rng, world, limits) -> int:
        return log_uniform(rng, 1, limits.rows)

    def method(self, rng, world):
        return None

    def takes_flatten(self, world) -> bool:
        return True

    def trial(self, call, world):
        return GemmTrial(call, world)


class MatmulCases(_GemmCases):
    name = "matmul"
    forms = ("function",)


class AgGemmCases(_GemmCases):
    """shape: (rows of a_shard, K, N)."""
    name = "ag_gemm"

    def rows(self, rng, world, limits):
        return log_uniform(rng, 1, max(1, limits.rows // world.world_size))

    def method(self, rng, world):
        return draw_method(rng, self.name, shard_gather.COMMS, world, ("ce",), "comm")


class GemmRsCases(_GemmCases):
    """shape: (M, K, N), M a multiple of the world size."""
    name = "gemm_rs"

    def rows(self, rng, world, limits):
        return world.world_size * log_uniform(rng, 1, max(1, limits.rows // world.world_size))

    def takes_flatten(self, world):
        return world.nnodes == 1  # across nodes its two-level kernel cannot flatten


class GemmArCases(_GemmCases):
    name = "gemm_ar"

    def method(self, rng, world):
        return draw_method(rng, self.name, gemm_all_reduce.METHODS, world, ("ll",))

    def takes_flatten(self, world):
        return False


class GemmTrial(Trial):
    """a (rows x K) and b (K x N; for fp8 the transpose of a contiguous N x K), with fp32 scales for fp8."""

    def __init__(self, call, world):
        self.spec, self.world = call, world
        rows, k, n = call.shape
        device = world.device
        self.a = torch.empty(rows, k, dtype=call.dtype, device=device)
        self.fp8 = call.dtype == gemm.FP8
        self.b_storage = torch.empty((n, k) if self.fp8 else (k, n), dtype=call.dtype, device=device)
        self.b = self.b_storage.t() if self.fp8 else self.b_storage
        self.scales = (torch.empty(1, device=device), torch.empty(1, device=device)) if self.fp8 else (None, None)
        out_rows = {"ag_gemm": world.world_size * rows, "gemm_rs": rows // world.world_size}.get(call.op, rows)
        self.out = torch.empty(out_rows, n, dtype=gemm.out_dtype(call.dtype), device=device)

    def _operands(self, seed: int, rank: int) -> tuple:
        """Rank `rank`'s (a, b's storage, scale_a, scale_b). ag_gemm's scale_a scales all of A, so
        every rank has the same."""
        rows, k, n = self.spec.shape
        device = self.world.device
        a = random_tensor((rows, k), self.spec.dtype, seed_of(seed, rank, 0), device)
        b = random_tensor(tuple(self.b_storage.shape), self.spec.dtype, seed_of(seed, rank, 1), device)
        if not self.fp8:
            return a, b, 1.0, 1.0
        scale_a = random.Random(seed_of(seed, rank if self.spec.op != "ag_gemm" else -1, 2)).uniform(0.25, 2)
        return a, b, scale_a, random.Random(seed_of(seed, rank, 3)).uniform(0.25, 2)

    def _product(self, operands) -> torch.Tensor:
        a, b, scale_a, scale_b = operands
        return (a.float() @ (b.float().t() if self.fp8 else b.float())) * (scale_a * scale_b)

    def fill(self, seed):
        w, op = self.world, self.spec.op
        everyone = [self._operands(seed, rank) for rank in range(w.world_size)]
        mine = everyone[w.rank]
        partials = 0
        if op == "matmul":
            reference = self._product(mine)
        elif op == "ag_gemm":
            reference = self._product((torch.cat([e[0] for e in everyone]), *mine[1:]))
        else:
            reference = sum(self._product(e) for e in everyone)
            partials = w.world_size
            if op == "gemm_rs":
                rows = self.out.shape[0]
                reference = reference[w.rank * rows:(w.rank + 1) * rows]
        expected = Expected(reference, gemm_tolerance(reference, self.out.dtype, partials),
                            where=lambda i: f"row {i // self.out.shape[1]}, column {i % self.out.shape[1]}")
        poison(self.out, expected)
        self.a.copy_(mine[0])
        self.b_storage.copy_(mine[1])
        if self.fp8:
            self.scales[0].fill_(mine[2])
            self.scales[1].fill_(mine[3])
        return expected

    def build(self):
        c = self.spec
        rows, k, n = c.shape
        if c.op == "ag_gemm":
            return ops.AllGatherGEMM(rows, k, n, c.dtype, c.method, config=c.config)
        if c.op == "gemm_rs":
            return ops.GemmReduceScatter(rows, k, n, c.dtype, config=c.config)
        return ops.GemmAllReduce(rows, k, n, c.dtype, c.method, config=c.config)

    def call(self, op):
        c = self.spec
        scale_a, scale_b = self.scales
        if op is not None:
            return op(self.a, self.b, self.out, scale_a=scale_a, scale_b=scale_b)
        if c.op == "matmul":
            return gemm.matmul(self.a, self.b, self.out, config=c.config, scale_a=scale_a, scale_b=scale_b)
        if c.op == "ag_gemm":
            return ops.ag_gemm(self.a, self.b, self.out, comm=c.method, config=c.config, scale_a=scale_a,
                               scale_b=scale_b)
        if c.op == "gemm_rs":
            return ops.gemm_rs(self.a, self.b, self.out, config=c.config, scale_a=scale_a, scale_b=scale_b)
        return ops.gemm_ar(self.a, self.b, self.out, method=c.method, config=c.config, scale_a=scale_a,
                           scale_b=scale_b)


for _cases in (MatmulCases(), AgGemmCases(), GemmRsCases(), GemmArCases()):
    register(_cases)
