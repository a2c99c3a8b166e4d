"""Several ranks on one GPU (`tridist run --ranks-per-gpu K`, or TRIDIST_RANKS_PER_GPU=K).

For correctness and debugging on a machine with fewer GPUs than ranks (docs/guide/one-gpu.md):
K ranks share each GPU, rank r of a host on GPU r // K. Three things make that work:
- NVSHMEM gives several PEs on one GPU full support only under CUDA MPS, and only when the MPS
  thread percentages of the ranks sharing a GPU add up to at most 100: each rank gets
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 // (ranks on its GPU), set before CUDA starts (the
  driver reads it when the process first initialises CUDA);
- NCCL refuses two ranks on one GPU, so the host process group is gloo wherever ranks share one;
- the GPU comes from the host rank and K, not from LOCAL_RANK alone.

Every decision here is a pure function of the host's rank count and K, so that the launcher, the
runtime, the test harness, the benchmarks and `tridist info` agree. Ranks started by hand (torchrun
with TRIDIST_RANKS_PER_GPU=K in the environment) get the same: `prepare_process` sets the MPS
percentage when tridist is imported, if CUDA has not started by then.
"""
import os

from . import config

MPS_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def ranks_on_a_gpu(host_ranks: int, ranks_per_gpu: int) -> int:
    """Ranks on the fullest GPU: K, or fewer when the host runs fewer ranks than K."""
    return max(1, min(ranks_per_gpu, host_ranks))


def shares_gpu(host_ranks: int, ranks_per_gpu: int) -> bool:
    """Whether some GPU of the host holds more than one rank."""
    return ranks_on_a_gpu(host_ranks, ranks_per_gpu) > 1


def gpu_of(host_rank: int, ranks_per_gpu: int) -> int:
    """The GPU of the host's rank `host_rank` (LOCAL_RANK)."""
    return host_rank // ranks_per_gpu


def gpus_needed(host_ranks: int, ranks_per_gpu: int) -> int:
    return -(-host_ranks // ranks_per_gpu)


def mps_percentage(host_ranks: int, ranks_per_gpu: int) -> int:
    """Each rank's share of the SMs, in percent, so that the ranks of one GPU add up to at most 100."""
    return 100 // ranks_on_a_gpu(host_ranks, ranks_per_gpu)


def process_group_backend(host_ranks: int, ranks_per_gpu: int) -> str:
    """torch.distributed's backend for the host group: NCCL refuses two ranks on one GPU."""
    return "gloo" if shares_gpu(host_ranks, ranks_per_gpu) else "nccl"


def rank_environment(host_ranks: int, ranks_per_gpu: int) -> dict:
    """What the launcher adds to every rank's environment (the same for all of them)."""
    if not shares_gpu(host_ranks, ranks_per_gpu):
        return {}
    return {"TRIDIST_RANKS_PER_GPU": str(ranks_per_gpu), MPS_PERCENTAGE: str(mps_percentage(host_ranks, ranks_per_gpu))}


def host_ranks() -> int:
    """The ranks of this host, as the launcher says (LOCAL_WORLD_SIZE, else WORLD_SIZE, else 1)."""
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def ranks_per_gpu_here() -> int:
    """The ranks that share this rank's GPU (1: a GPU of its own), from the environment."""
    return ranks_on_a_gpu(host_ranks(), config.ranks_per_gpu())


def prepare_process() -> None:
    """Give this process its MPS percentage when its ranks share a GPU and nobody set one. Called when
    tridist is imported: the CUDA driver reads the percentage when the process starts CUDA, so a
    script that touched CUDA before importing tridist must be started with it set (as
    `tridist run --ranks-per-gpu` does)."""
    ranks, per_gpu = host_ranks(), config.ranks_per_gpu()
    if shares_gpu(ranks, per_gpu) and not os.environ.get(MPS_PERCENTAGE):
        os.environ[MPS_PERCENTAGE] = str(mps_percentage(ranks, per_gpu))
