"""Chooses the backend of this process once, before any kernel is defined.

Kernels are defined when their modules are imported, and Triton decides at definition time whether
a kernel is compiled for the GPU or run by its interpreter, so the choice cannot wait for `init()`.
"""
import os

from . import config, sharing

NVSHMEM = "nvshmem"
EMULATOR = "emulator"
BACKENDS = (NVSHMEM, EMULATOR)


def _choose() -> str:
    name = config.requested_backend()
    if not name:
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            name = EMULATOR
        else:
            import torch

            # device_count asks NVML and leaves CUDA uninitialised (is_available would initialise it), so
            # that this process may still fork workers that use CUDA (`tridist precompile` does).
            name = NVSHMEM if torch.cuda.device_count() > 0 else EMULATOR
    if name not in BACKENDS:
        raise ValueError(f"TRIDIST_BACKEND={name!r}: use one of {', '.join(BACKENDS)}")
    if name == EMULATOR:
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise ValueError("TRIDIST_BACKEND=nvshmem but TRITON_INTERPRET=1: unset TRITON_INTERPRET to run on GPUs")
    return name


sharing.prepare_process()  # before `_choose` may start CUDA: the MPS percentage is read then
BACKEND = _choose()
"""This process's backend, `"nvshmem"` or `"emulator"`, chosen when tridist is first imported:
TRIDIST_BACKEND if set, else the emulator under TRITON_INTERPRET=1, else nvshmem where CUDA GPUs
are present. Fixed for the life of the process (kernels are defined for one backend)."""


def is_emulator() -> bool:
    return BACKEND == EMULATOR
