"""`tridist info`: what this machine offers tridist, and what to fix."""
import os
import platform

import torch
import triton

from . import backend, config
from .nvshmem import device_library_candidates, find_device_library


def report() -> str:
    lines = [f"tridist backend: {backend.BACKEND}"]
    lines.append(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}")
    fixes = []
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        lines.append(f"CUDA {torch.version.cuda}, {count} GPU(s):")
        for i in range(count):
            lines.append(f"  {i}: {torch.cuda.get_device_name(i)}")
        lines.append("peer access (row can read/write column):")
        for i in range(count):
            row = ["self" if i == j else ("P2P " if torch.cuda.can_device_access_peer(i, j) else "--  ")
                   for j in range(count)]
            lines.append(f"  {i}: " + " ".join(row))
        try:
            lines.append(f"NVSHMEM device library: {find_device_library()}")
        except Exception as error:  # noqa: BLE001 - reported, not raised
            lines.append(f"NVSHMEM device library: missing; searched {', '.join(device_library_candidates())}")
            fixes.append(str(error))
        import torch.distributed._symmetric_memory as symm_mem

        if not symm_mem.is_nvshmem_available():
            fixes.append("this PyTorch build has no NVSHMEM support; install a CUDA build of PyTorch >= 2.9")
    else:
        lines.append("no CUDA GPU: kernels run in the CPU emulator (Triton's interpreter, one process per rank)")
        import numpy

        if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
            fixes.append(f"numpy {numpy.__version__} breaks Triton's interpreter: pip install 'numpy<2.4'")
    lines.append("settings:")
    for name, meaning in config.SETTINGS.items():
        lines.append(f"  {name}={os.environ.get(name, '')!s:<10} {meaning}")
    lines.append("to fix: " + ("; ".join(fixes) if fixes else "nothing"))
    return "\n".join(lines)
