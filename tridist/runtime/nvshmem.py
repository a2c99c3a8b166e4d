"""The GPU backend: one NVSHMEM symmetric heap per rank, allocated through PyTorch.

PyTorch's symmetric memory, with its NVSHMEM backend, allocates the heap (`nvshmem_malloc` under the
hood) and tells us where each peer's copy is mapped. Kernels call NVSHMEM's device functions from
`libnvshmem_device.bc`, which Triton links into each module; every compiled module must then be
initialised with `nvshmemx_cumodule_init` before its first launch.
"""
import os
import sys
import sysconfig

import torch
import torch.distributed as dist

from . import device_library
from .errors import TridistError

# NVLink multicast must stay off on the machines we test on; these keep every library away from it.
SAFE_ENVIRONMENT = {
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}
# NVSHMEM's symmetric heap holds ours and whatever else is allocated in it (PyTorch's symmetric
# memory adds a signal pad to each allocation; NVSHMEM keeps state of its own there): room for those.
_HEAP_HEADROOM = 1 << 30
_INSTALL_HINT = ("install the NVSHMEM wheel that matches your CUDA: `pip install tridist[gpu]`, or "
                 "`pip install nvidia-nvshmem-cu13` (CUDA 13) / `nvidia-nvshmem-cu12` (CUDA 12); or point "
                 "NVSHMEM_LIB_DIR at the folder that holds libnvshmem_device.bc")


def device_library_candidates() -> list[str]:
    folders = []
    if os.environ.get("NVSHMEM_LIB_DIR"):
        folders.append(os.environ["NVSHMEM_LIB_DIR"])
    for root in [sysconfig.get_path("purelib"), *sys.path]:
        folders.append(os.path.join(root, "nvidia", "nvshmem", "lib"))
    folders += ["/usr/local/lib", "/usr/lib", "/opt/nvidia/nvshmem/lib"]
    seen = []
    for folder in folders:
        if folder and folder not in seen:
            seen.append(folder)
    return [os.path.join(folder, "libnvshmem_device.bc") for folder in seen]


def find_device_library() -> str:
    for path in device_library_candidates():
        if os.path.exists(path):
            return path
    raise TridistError(f"NVSHMEM device library libnvshmem_device.bc not found; {_INSTALL_HINT}")


class NvshmemTransport:
    """Heap, peer views and host synchronisation for the `nvshmem` backend."""

    def __init__(self, rank: int, world_size: int, device: torch.device, heap_bytes: int, reachable: list[bool],
                 process_group: str = "nccl"):
        """`process_group`: torch.distributed's backend when this starts it, "nccl", or "gloo" where
        ranks share a GPU (`runtime/sharing.py`): NCCL refuses two ranks on one GPU."""
        self.device_library = device_library.for_kernels(find_device_library())
        for key, value in SAFE_ENVIRONMENT.items():
            os.environ[key] = value
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap_bytes + _HEAP_HEADROOM))
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            if process_group == "nccl":
                dist.init_process_group("nccl", device_id=device)
            else:
                dist.init_process_group(process_group)
        elif process_group != "nccl" and "nccl" in dist.get_backend():
            raise TridistError(
                f"torch.distributed was started with {dist.get_backend()!r}, but ranks share a GPU here "
                "(TRIDIST_RANKS_PER_GPU) and NCCL refuses two ranks on one GPU: start it with "
                "dist.init_process_group('gloo'), or let tridist.init() start it")
        if dist.get_world_size() != world_size:
            raise TridistError(f"torch.distributed has {dist.get_world_size()} ranks, tridist expects {world_size}")
        # NCCL's barrier takes the device (else it guesses one); gloo's takes none.
        self._barrier_devices = [device.index] if "nccl" in dist.get_backend() else None
        import torch.distributed._symmetric_memory as symm_mem

        if not symm_mem.is_nvshmem_available():
            raise TridistError(f"this PyTorch build cannot use NVSHMEM; {_INSTALL_HINT}")
        symm_mem.set_backend("NVSHMEM")
        self.device = device
        self.heap = symm_mem.empty(heap_bytes, dtype=torch.uint8, device=device)
        self.heaps = [None] * world_size
        if world_size > 1:  # PyTorch's rendezvous wants company; alone, the heap is all there is
            handle = symm_mem.rendezvous(self.heap, dist.group.WORLD.group_name)
            self.heaps = [handle.get_buffer(peer, (heap_bytes,), torch.uint8, 0) if reachable[peer] else None
                          for peer in range(world_size)]
        self.heaps[rank] = self.heap

    def barrier(self, group=None) -> None:
        """Host barrier of every rank, or of `group`'s members only (a Group), after the device work
        queued before it."""
        torch.cuda.synchronize(self.device)
        dist.barrier(group=_process_group(group), device_ids=self._barrier_devices)
        torch.cuda.synchronize(self.device)

    def allgather_objects(self, value, group=None) -> list:
        """Every member's `value` (any picklable object), in group order, among `group`'s members (a
        Group) or every rank (None). A host collective that moves a pickle through the process group:
        never while a CUDA graph is captured (with NCCL it copies a CPU tensor to the GPU, which a
        capture refuses)."""
        process_group = _process_group(group)
        everyone = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(everyone, value, group=process_group)
        return everyone

    def allgather_ints(self, values: tuple, group=None) -> list:
        return self.allgather_objects(tuple(values), group)

    def close(self, failed: bool = False) -> None:
        if not failed:
            torch.cuda.synchronize(self.device)


def _process_group(group):
    """The torch.distributed group of a Group (None: the default group, the world)."""
    return None if group is None or group.is_world else group.process_group
