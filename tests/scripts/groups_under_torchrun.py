"""A job that starts torch.distributed itself (gloo) before `tridist.init()`, as a PyTorch program
that adopts tridist would, under torchrun: each rank runs an all-gather within a group of its own at
the same time (group rank 0 is world rank 1 on rank 1) (tests/test_groups.py)."""
import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo")  # before tridist: tridist.init() joins it

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import tridist  # noqa: E402

from tests.test_groups import _allgather_in  # noqa: E402

w = tridist.init()
alone = [dist.new_group([rank]) for rank in range(w.world_size)]  # every rank makes every group
g = tridist.group(alone[w.rank])
assert (g.ranks, g.rank) == ((w.rank,), 0) and not g.is_world
_allgather_in(g, group_id=w.rank, n=40, calls=2, tag="alone")
tridist.barrier_all()
print(f"rank {w.rank}: groups correct", flush=True)
tridist.finalize()
