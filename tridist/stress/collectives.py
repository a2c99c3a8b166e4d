"""Stress cases of the collectives (`tridist.ops.collectives`): all_gather, reduce_scatter and
all_reduce, every method including `auto`, every dtype each takes.

- all_gather: out of place or in place (x is out's own row); into a regular or a symmetric out.
  Exact: the output must hold every rank's bits.
- reduce_scatter: out of place or in place (out is x's own chunk). Within `sum_tolerance`.
- all_reduce: out of place or in place (out=x); in place on a symmetric x (the symmetric two-shot
  on one node). Within `sum_tolerance`.
"""
import torch

import tridist
from tridist import ops
from tridist.ops import _protocol
from tridist.ops.collectives import allgather, allreduce, reducescatter

from .cases import (Expected, Invalid, OpCases, Trial, draw_method, log_uniform, poison, random_tensor, register,
                    seed_of, sum_tolerance)

# Methods that reach their peers through pointers or copy engines, so within one node only.
ONE_NODE = {op: tuple(name for name, kind in front.CLASSES.items() if kind.one_node)
            for op, front in (("all_gather", allgather), ("reduce_scatter", reducescatter), ("all_reduce", allreduce))}


def _draw_method(rng, op: str, methods, world, ll_bytes: int) -> str:
    """A method of `op`; `ll_bytes`: what each LL packet row carries, which must be whole 4-byte words."""
    method = draw_method(rng, op, methods, world, ONE_NODE[op])
    if method == "ll" and ll_bytes % 4:
        raise Invalid(f"{op} method 'll': data not whole 4-byte words")
    return method


class _Everyone:
    """Every rank's input of one call, made from its seed on this rank's device."""

    def __init__(self, world, seed: int, shape, dtype: torch.dtype):
        self.inputs = [random_tensor(shape, dtype, seed_of(seed, rank), world.device)
                       for rank in range(world.world_size)]
        self.mine = self.inputs[world.rank]


class AllGatherCases(OpCases):
    name, family = "all_gather", "collectives"

    def draw(self, rng, world, limits):
        dtype = rng.choice(allgather.DTYPES)
        n = log_uniform(rng, 1, limits.nbytes // dtype.itemsize)
        method = _draw_method(rng, self.name, allgather.METHODS, world, n * dtype.itemsize)
        return dict(method=method, dtype=dtype, shape=(n,), in_place=rng.random() < 0.5,
                    symmetric=rng.random() < 0.5)

    def trial(self, call, world):
        return AllGatherTrial(call, world)


class AllGatherTrial(Trial):
    def __init__(self, call, world):
        self.spec, self.world = call, world
        (n,) = call.shape
        shape = (world.world_size * n,)
        self.out = (tridist.symm_empty(shape, call.dtype) if call.symmetric
                    else torch.empty(shape, dtype=call.dtype, device=world.device))
        self.x = (self.out[world.rank * n:(world.rank + 1) * n] if call.in_place
                  else torch.empty(n, dtype=call.dtype, device=world.device))

    def fill(self, seed):
        (n,) = self.spec.shape
        everyone = _Everyone(self.world, seed, (n,), self.spec.dtype)
        expected = Expected(torch.cat(everyone.inputs), where=lambda i: f"rank {i // n}'s element {i % n}")
        poison(self.out, expected)
        self.x.copy_(everyone.mine)  # after the poison: in place, x is a row of out
        return expected

    def build(self):
        c = self.spec
        return ops.AllGather(c.shape[0], c.dtype, c.method, symmetric_out=c.symmetric)

    def call(self, op):
        if op is None:
            return ops.all_gather(self.x, self.out, method=self.spec.method)
        return op(self.x, self.out)

    def free(self):
        if self.spec.symmetric:
            tridist.symm_free(self.out)


class ReduceScatterCases(OpCases):
    name, family = "reduce_scatter", "collectives"

    def draw(self, rng, world, limits):
        dtype = rng.choice(_protocol.SUPPORTED)
        chunk = log_uniform(rng, 1, max(1, limits.nbytes // dtype.itemsize // world.world_size))
        method = _draw_method(rng, self.name, reducescatter.METHODS, world, chunk * dtype.itemsize)
        return dict(method=method, dtype=dtype, shape=(chunk,), in_place=rng.random() < 0.5)

    def trial(self, call, world):
        return ReduceScatterTrial(call, world)


class ReduceScatterTrial(Trial):
    """shape: (elements of out,); x has world_size times as many."""

    def __init__(self, call, world):
        self.spec, self.world = call, world
        (m,) = call.shape
        self.x = torch.empty(world.world_size * m, dtype=call.dtype, device=world.device)
        self.mine = slice(world.rank * m, (world.rank + 1) * m)
        self.out = self.x[self.mine] if call.in_place else torch.empty(m, dtype=call.dtype, device=world.device)

    def fill(self, seed):
        everyone = _Everyone(self.world, seed, self.x.shape, self.spec.dtype)
        parts = [x[self.mine] for x in everyone.inputs]
        reference = sum(p.double() for p in parts)
        expected = Expected(reference, sum_tolerance(parts, reference, self.spec.dtype))
        self.x.copy_(everyone.mine)
        if not self.spec.in_place:
            poison(self.out, expected)
        return expected

    def build(self):
        return ops.ReduceScatter(self.x.numel(), self.spec.dtype, self.spec.method)

    def call(self, op):
        if op is None:
            return ops.reduce_scatter(self.x, self.out, method=self.spec.method)
        return op(self.x, self.out)


class AllReduceCases(OpCases):
    name, family = "all_reduce", "collectives"

    def draw(self, rng, world, limits):
        dtype = rng.choice(_protocol.SUPPORTED)
        n = log_uniform(rng, 1, limits.nbytes // dtype.itemsize)
        method = _draw_method(rng, self.name, allreduce.METHODS, world, n * dtype.itemsize)
        in_place = rng.random() < 0.5
        return dict(method=method, dtype=dtype, shape=(n,), in_place=in_place,
                    symmetric=in_place and rng.random() < 0.5)

    def trial(self, call, world):
        return AllReduceTrial(call, world)


class AllReduceTrial(Trial):
    def __init__(self, call, world):
        self.spec, self.world = call, world
        (n,) = call.shape
        self.x = (tridist.symm_empty((n,), call.dtype) if call.symmetric
                  else torch.empty(n, dtype=call.dtype, device=world.device))
        self.out = self.x if call.in_place else torch.empty(n, dtype=call.dtype, device=world.device)

    def fill(self, seed):
        everyone = _Everyone(self.world, seed, self.x.shape, self.spec.dtype)
        reference = sum(x.double() for x in everyone.inputs)
        expected = Expected(reference, sum_tolerance(everyone.inputs, reference, self.spec.dtype))
        self.x.copy_(everyone.mine)
        if not self.spec.in_place:
            poison(self.out, expected)
        return expected

    def build(self):
        c = self.spec
        return ops.AllReduce(c.shape[0], c.dtype, c.method, symmetric_in_place=c.symmetric)

    def call(self, op):
        if op is None:
            return ops.all_reduce(self.x, out=self.out, method=self.spec.method)
        return op(self.x, self.out)

    def free(self):
        if self.spec.symmetric:
            tridist.symm_free(self.x)


for _cases in (AllGatherCases(), ReduceScatterCases(), AllReduceCases()):
    register(_cases)
