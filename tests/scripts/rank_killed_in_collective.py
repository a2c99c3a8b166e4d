"""Rank 1 is killed (SIGKILL) while rank 0 waits for it inside an all-reduce: the launcher must end
the job, name rank 1, and leave no rank process behind. Each rank writes its pid into the folder
TRIDIST_TEST_PIDS, so that the test can check."""
import os
import signal
import time

import torch

import tridist
from tridist import ops

w = tridist.init()
with open(os.path.join(os.environ["TRIDIST_TEST_PIDS"], str(w.rank)), "w") as f:
    f.write(str(os.getpid()))
op = ops.AllReduce(1024, torch.float32, "one_shot")
x = torch.ones(1024, device=w.device)
assert torch.equal(op(x).cpu(), torch.full((1024,), float(w.world_size)))  # one call together: it works
tridist.barrier_all()
if w.rank == 1:
    time.sleep(2)  # by now rank 0 is inside the next call, waiting for this rank's data
    os.kill(os.getpid(), signal.SIGKILL)
op(x)
if w.device.type == "cuda":
    torch.cuda.synchronize()
raise AssertionError(f"rank {w.rank} finished an all-reduce that rank 1 never joined")
