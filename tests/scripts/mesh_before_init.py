"""A script that builds a DeviceMesh before `tridist.init()` (`before`: the mesh starts
torch.distributed from the launcher's MASTER_ADDR and MASTER_PORT, as under torchrun, and tridist
joins it) or after it (`after`: the mesh takes the torch.distributed that tridist started), then
all-gathers within the mesh's group (tests/test_launcher.py)."""
import os
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh

import tridist
from tridist import ops

order = sys.argv[1]
if order == "before":
    mesh = init_device_mesh("cpu" if tridist.BACKEND == "emulator" else "cuda", (int(os.environ["WORLD_SIZE"]),),
                            mesh_dim_names=("tp",))
w = tridist.init()
if order == "after":
    mesh = init_device_mesh(w.device.type, (w.world_size,), mesh_dim_names=("tp",))
x = torch.arange(4, dtype=torch.float32, device=w.device) + 10 * w.rank
expected = torch.cat([torch.arange(4, dtype=torch.float32) + 10 * r for r in range(w.world_size)])
assert torch.equal(ops.all_gather(x, group=mesh.get_group("tp")).cpu(), expected), f"rank {w.rank}: wrong all-gather"
print(f"rank {w.rank}: mesh {order} tridist.init, all-gather correct", flush=True)
tridist.finalize()
