"""Timing across ranks: CUDA events, warm-up, many repetitions, the median, the slowest rank.

Every repetition starts from a host barrier, then queues a busy-wait of the GPU, a one-element NCCL
all-reduce (none with gloo, where ranks share a GPU) and the start event ahead of the timed calls:
the busy-wait gives every host time to queue the calls before its GPU reaches them, and the
all-reduce lets the GPUs leave together, so a rank whose host was late does not make its peers'
first call wait inside the timing. (Without
the busy-wait, the same kernel timed twice in one run differed by up to 1.2 us at 4 KB.) Small
operations are captured `inner` times in a CUDA graph so that launch overhead is not what gets
measured.

Only torch.distributed is used here, never tridist's runtime: `tridist.bench.torch_fused` times
PyTorch's fused ops with these same functions in a process where tridist is never initialised.
"""
import re
import statistics

import torch
import torch.distributed as dist

from ..runtime.tune import HEAD_START_CYCLES  # a constant: nothing of the runtime starts

GRAPH_LIMIT_US = 1000.0  # ops quicker than this are timed again as CUDA-graph replays


def time_us(fn, inner: int = 20, repetitions: int = 15, warmup: int = 3, graph: bool = False) -> float:
    """Median microseconds per call of `fn()` on this rank (a collective: call it on every rank)."""
    for _ in range(warmup):
        fn()
    run = captured(fn, inner) if graph else fn  # one replay makes `inner` calls
    samples = []
    for _ in range(repetitions):
        _start_together()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(1 if graph else inner):
            run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / inner)
    return statistics.median(samples)


def captured(fn, calls: int = 1):
    """A CUDA graph of `calls` calls of `fn()`, as its `replay`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # a call outside the capture initialises what the capture cannot
    torch.cuda.current_stream().wait_stream(stream)
    cuda_graph = torch.cuda.CUDAGraph()
    # Captured on the stream of that call: the functions of tridist.ops keep an instance per stream
    # (built at a stream's first call, which a capture cannot do).
    with torch.cuda.graph(cuda_graph, stream=stream):
        for _ in range(calls):
            fn()
    return cuda_graph.replay


def op_us(fn, graph_limit_us: float = GRAPH_LIMIT_US) -> float:
    """The slowest rank's median microseconds per call of `fn()`, the figure the benchmarks report.
    Ops timed eagerly at less than `graph_limit_us` are timed again inside a CUDA graph, where
    launches cost nothing. An op whose host work outlasts its GPU work times eagerly at its host's
    pace: pass a higher limit for ops that are always capturable (EP's round trip did:
    benchmarks/NOTES.md, "Moved from the code's docstrings (issue 41)")."""
    us = slowest(time_us(fn, inner=5, repetitions=10, warmup=3))
    if us < graph_limit_us:  # every rank sees the same slowest value, so all of them take this branch
        us = slowest(time_us(fn, inner=20, repetitions=15, warmup=3, graph=True))
    return us


def interleaved_us(fns, rounds: int = 3, graph_limit_us: float = GRAPH_LIMIT_US) -> list[float]:
    """`op_us` of each of `fns`, taken in turns `rounds` times, and the median of each one's figures.
    A chip's clocks drift within a run (a compute-bound GEMM heats it: benchmarks/NOTES.md, "Moved
    from the code's docstrings (issue 41)"), so two ops timed one after the other can differ by more
    than they do; in turns the drift moves both alike, and their ratio holds."""
    samples = [[] for _ in fns]
    for _ in range(rounds):
        for times, fn in zip(samples, fns):
            times.append(op_us(fn, graph_limit_us))
    return [statistics.median(times) for times in samples]


def _start_together() -> None:
    """Returns once this rank's queued GPU work has finished and every rank has got here, with a
    busy-wait and an all-reduce queued that every GPU leaves at about the same time."""
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
        torch.cuda._sleep(HEAD_START_CYCLES)
        if "nccl" in dist.get_backend():  # gloo (ranks sharing a GPU) would go through the host: nothing to align
            dist.all_reduce(torch.zeros(1, device=torch.cuda.current_device()))


COPY_BYTES = 1 << 30  # the copy whose rate the benchmarks' "of copy" divides by: far larger than L2 (50 MB on an H100)


def one_gpu(benchmark: str):
    """tridist started for `benchmark`, a benchmark of one GPU (its world); SystemExit where the
    launcher started more ranks. tridist is imported here, not with this module: `torch_fused`'s
    processes time without it."""
    import tridist

    w = tridist.init()
    if w.world_size != 1:
        raise SystemExit(f"tridist bench {benchmark} runs on one GPU (-n 1); this world has {w.world_size} ranks")
    return w


def copy_rate(device) -> float:
    """Bytes read and written per microsecond by a device-to-device copy of COPY_BYTES. A copy that L2
    holds is no ceiling for a kernel that reads HBM: it runs faster than HBM can deliver
    (benchmarks/NOTES.md, "Issue 45 part B")."""
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * COPY_BYTES / op_us(lambda: target.copy_(source))


GEMM_SIZE = 8192  # the square GEMM whose rate the benchmarks' "of GEMM rate" divides by


def gemm_rate(device, size: int = GEMM_SIZE) -> float:
    """bf16 FLOPs per microsecond of cuBLAS (`torch.matmul`) on a `size` x `size` x `size` GEMM of
    random data: what a compute-bound step is measured against."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn_like(a)
    out = torch.empty_like(a)
    return 2 * size ** 3 / op_us(lambda: torch.matmul(a, b, out=out))


def all_ranks(ok: bool) -> bool:
    """Whether `ok` holds on every rank. A collective that gives every rank the same answer: a rank
    that went on to time an op while a peer skipped it would wait for that peer forever."""
    return slowest(0.0 if ok else 1.0) == 0.0


def slowest(value: float) -> float:
    """The largest value over all ranks: a collective finishes when its slowest rank does."""
    if not dist.is_initialized():
        return value
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return max(everyone)


def kernel_us(fn, calls: int = 20) -> dict[str, tuple[float, float]]:
    """Where one call of `fn()` spends its GPU time, by kernel (`short_kernel_name`), from PyTorch's
    profiler over `calls` calls (a collective: call it on every rank): {name: (microseconds per call,
    launches per call)}. `fn` may be a CUDA graph's replay (`captured`): the profiler sees the graph's
    kernels. Kernels that overlap (a side stream's beside the current one's) each count in full,
    so the times may add up to more than the call took; kernels of one name (a Triton kernel at two
    constexpr settings) add up. Eagerly, a kernel that waits for a peer counts its wait, which the
    peer's launches can make long: time communication in a graph."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    _start_together()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in trace.key_averages():
        total = getattr(event, "device_time_total", 0)
        if total:
            name = short_kernel_name(event.key)
            us, launches = times.get(name, (0.0, 0.0))
            times[name] = (us + total / calls, launches + event.count / calls)
    return dict(sorted(times.items(), key=lambda item: -item[1][0]))


# Names inside a C++ kernel's template arguments that say what an elementwise kernel does.
_KERNEL_ROLE = re.compile(r"\b(\w+(?:Functor|_kernel_cuda|_kernel_impl|Ops))\b")


def short_kernel_name(name: str) -> str:
    """A kernel's name without its C++ template arguments, but for what they say the kernel does:
    `void at::native::elementwise_kernel<128, 4, ...direct_copy_kernel_cuda...>(...)` ->
    `at::native::elementwise_kernel[direct_copy_kernel_cuda]`."""
    name = name.removeprefix("void ")
    base = re.split(r"[<(]", name, maxsplit=1)[0]
    roles = list(dict.fromkeys(_KERNEL_ROLE.findall(name[len(base):])))[:3]
    return base + (f"[{','.join(roles)}]" if roles else "")


def print_kernels(label: str, fn, rank: int, how: str = "eager") -> None:
    """`kernel_us(fn)` printed on rank 0 as one line after `label`, with the sum of its kernels'
    times; `how` says how `fn` runs ("eager", "cuda graph"). A collective: call it on every rank."""
    times = kernel_us(fn)
    if rank == 0:
        total = sum(us for us, _ in times.values())
        print(f"  {label}, rank 0's GPU time per call by kernel ({how}; {total:.1f} us in all, overlapping "
              "kernels each in full): "
              + "; ".join(f"{kernel} {us:.1f} us x {launches:g}" for kernel, (us, launches) in times.items()),
              flush=True)
