"""`ops.all_reduce_(x)` sums in place, as `torch.distributed.all_reduce(x)` does (code ported from it
used to lose the sum with `ops.all_reduce(x)`, which returns a new tensor): regular and symmetric
tensors, every method, the custom op under torch.compile, against the sum computed on the host."""
import pytest
import torch

import tridist
from tridist import ops
from tridist.ops.collectives import allreduce


def _everyone(w, n: int, call: int):
    """Every rank's input of one call: integers (exact sums in fp32), encoding rank and index."""
    return [(torch.arange(n) * 7 + rank * 1000 + call) % 4093 for rank in range(w.world_size)]


def _in_place(w):
    n = 1000
    for call, method in enumerate(allreduce.METHODS):
        everyone = _everyone(w, n, call)
        x = everyone[w.rank].float().to(w.device)
        assert ops.all_reduce_(x, method=method) is x
        assert torch.equal(x.cpu(), sum(everyone).float()), method
    x = tridist.symm_empty((n,), torch.float32)
    everyone = _everyone(w, n, 99)
    x.copy_(everyone[w.rank].float())
    ops.all_reduce_(x)
    assert torch.equal(x.cpu(), sum(everyone).float())
    compiled = torch.compile(lambda t: torch.ops.tridist.all_reduce_(t), backend="eager", fullgraph=True)
    y = everyone[w.rank].float().to(w.device)
    compiled(y)
    assert torch.equal(y.cpu(), sum(everyone).float())
    tridist.barrier_all()
    tridist.symm_free(x)


@pytest.mark.worlds("2")
def test_all_reduce_in_place(world):
    world.run(_in_place)
