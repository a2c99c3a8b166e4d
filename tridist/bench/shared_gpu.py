"""Benchmarks when ranks share a GPU (`tridist run --ranks-per-gpu K`, `runtime/sharing.py`).

Then no NVLink is crossed and each rank has a share of the SMs, so no time measured says anything
about speed; and NCCL refuses two ranks on one GPU, so the NCCL and torch.distributed baselines
cannot run. Every benchmark still checks its results (against references computed on the host
through the gloo group where NCCL cannot run: `all_gather`, `reduce_scatter`, `all_reduce` here),
skips its baselines, says so on rank 0, and records in its JSON that no speed claim is made
(`results.save` adds `fields()`).

Only the environment is read here (no tridist runtime): `torch_fused` uses it too.
"""
import torch
import torch.distributed as dist

from ..runtime import sharing

SPEED = "not comparable: ranks share one GPU"


def ranks_per_gpu() -> int:
    """The ranks that share this rank's GPU (1: a GPU of its own)."""
    return sharing.ranks_per_gpu_here()


def shared() -> bool:
    return ranks_per_gpu() > 1


def fields() -> dict:
    """What a benchmark's JSON records about sharing: nothing on GPUs of their own."""
    return {"ranks_per_gpu": ranks_per_gpu(), "speed": SPEED} if shared() else {}


def announce(benchmark: str, rank: int) -> bool:
    """Whether ranks share a GPU; if they do, rank 0 says what the benchmark then does."""
    if shared() and rank == 0:
        print(f"{benchmark}: {ranks_per_gpu()} ranks share each GPU (--ranks-per-gpu): results are checked, the "
              "NCCL and PyTorch baselines are skipped (NCCL refuses two ranks on one GPU), and no speed claim is "
              "made: no NVLink is crossed and each rank has a share of the SMs", flush=True)
    return shared()


def _on_the_host() -> bool:
    """Whether the group cannot take CUDA tensors (gloo, where ranks share a GPU)."""
    return "nccl" not in dist.get_backend()


def all_gather(out: torch.Tensor, x: torch.Tensor, group=None) -> None:
    """`dist.all_gather_into_tensor(out, x, group=group)`; through the host where the group is gloo
    (as bytes, so that any dtype goes)."""
    if not _on_the_host():
        dist.all_gather_into_tensor(out, x, group=group)
        return
    mine = x.contiguous().view(-1).view(torch.uint8).cpu()
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    out.copy_(torch.cat(parts).view(out.dtype).view(out.shape))


def _host_sum(x: torch.Tensor, group) -> torch.Tensor:
    # fp32: gloo need not take 16-bit floats, and the sum is a reference. A copy always: an fp32 CPU
    # `x` would otherwise be summed in place, and the op under test then reduce the sum.
    total = x.to("cpu", torch.float32, copy=True)
    dist.all_reduce(total, group=group)
    return total


def all_reduce(t: torch.Tensor, group=None) -> None:
    """`dist.all_reduce(t, group=group)` (sum); through the host, in fp32, where the group is gloo."""
    if not _on_the_host():
        dist.all_reduce(t, group=group)
        return
    t.copy_(_host_sum(t, group))


def reduce_scatter(out: torch.Tensor, x: torch.Tensor, group=None) -> None:
    """`dist.reduce_scatter_tensor(out, x, group=group)` (sum); through the host, in fp32, where the
    group is gloo."""
    if not _on_the_host():
        dist.reduce_scatter_tensor(out, x, group=group)
        return
    out.copy_(_host_sum(x, group).view(dist.get_world_size(group), *out.shape)[dist.get_rank(group)])
