"""A job that starts torch.distributed itself (gloo) before `tridist.init()`, as a PyTorch program
that adopts tridist would, under torchrun: two groups of two ranks each run an all-gather at once
(tests/test_groups.py)."""
import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo")  # before tridist: tridist.init() joins it

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import tridist  # noqa: E402

from tests.test_groups import _allgather_in  # noqa: E402

w = tridist.init()
pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
g = tridist.group(pairs[w.rank // 2])
_allgather_in(g, group_id=w.rank // 2, n=40, calls=2, tag="pair")
tridist.barrier_all()
print(f"rank {w.rank}: groups correct", flush=True)
tridist.finalize()
