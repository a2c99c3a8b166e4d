"""Ranks 0 and 1 all-reduce within their pair, and rank 2 passes the pair's group too, which it is not
a member of (a ValueError), then all meet at a barrier: the peers' errors and the job's last line
must name rank 2 and quote its error (tests/test_launcher.py)."""
import torch
import torch.distributed as dist

import tridist
from tridist import ops

w = tridist.init()
pair = dist.new_group([0, 1])
ops.all_reduce(torch.ones(8, device=w.device), group=pair)
tridist.barrier_all()
