"""`tridist info`: what this machine offers tridist, and what to fix."""
import platform

import torch
import triton

from . import backend, config, mps
from .device_library import for_kernels
from .nvshmem import device_library_candidates, find_device_library

SHARING_EXAMPLES = (2, 4)  # the --ranks-per-gpu values `tridist info` spells out


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
            whole = find_device_library()
            lines.append(f"NVSHMEM device library: {whole}")
            linked = for_kernels(whole)
            lines.append(f"  linked into kernels: {'the cut copy ' + linked if linked != whole else 'whole'}")
            if linked == whole and config.device_library() == "cut":
                fixes.append("NVSHMEM's device library could not be cut (the warning above says why), so kernels "
                             "compile about ten times slower")
        except Exception as error:  # noqa: BLE001 - reported, not raised
            lines.append(f"NVSHMEM device library: missing; searched {', '.join(device_library_candidates())}")
            fixes.append(str(error))
        import torch.distributed._symmetric_memory as symm_mem

        if not symm_mem.is_nvshmem_available():
            fixes.append("this PyTorch build has no NVSHMEM support; install a CUDA build of PyTorch >= 2.9")
        lines += sharing_report(count, mps.status())
    else:
        lines.append("no CUDA GPU: kernels run in the CPU emulator (Triton's interpreter, one process per rank); "
                     "it runs any number of ranks (tridist run --ranks-per-gpu changes nothing there)")
        untested = emulator_triton_fix(triton.__version__)
        if untested:
            fixes.append(untested)
    lines.append("settings (docs/guide/settings.md says what each does):")
    lines += ["  " + line for line in config.describe_settings()]
    lines.append("to fix: " + ("; ".join(fixes) if fixes else "nothing"))
    return "\n".join(lines)


def emulator_triton_fix(version: str) -> str | None:
    """What to do where the emulator would run on a Triton it was not tested with, or None."""
    from .interpreter import TESTED_TRITON

    if version.startswith(TESTED_TRITON + "."):
        return None
    return (f"Triton {version} is untested in the emulator, which changes private parts of Triton "
            f"{TESTED_TRITON}'s interpreter: pip install -e '.[emulator]' (or 'triton=={TESTED_TRITON}.*')")


def sharing_report(gpus: int, found: mps.Status) -> list[str]:
    """What `tridist run --ranks-per-gpu K` would give on `gpus` GPUs, and whether CUDA MPS, which
    it needs, is there (`found`)."""
    lines = ["sharing GPUs (tridist run --ranks-per-gpu K: to check and debug multi-rank code, not to measure speed):",
             f"  CUDA MPS control daemon: {found.describe()}"]
    for k in SHARING_EXAMPLES:
        lines.append(f"  --ranks-per-gpu {k}: {k} ranks at {100 // k}% of the SMs each, up to {k * gpus} ranks on "
                     f"{gpus} GPU(s)")
    if not found.running:
        lines.append(f"  (needs CUDA MPS: {mps.missing_message(found)})")
    return lines
