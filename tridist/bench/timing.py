"""Timing across ranks: CUDA events, warm-up, many repetitions, the median, the slowest rank.

Every repetition starts from a host barrier so that all ranks launch together; small operations are
captured `inner` times in a CUDA graph so that launch overhead is not what gets measured.
"""
import statistics

import torch
import torch.distributed as dist

import tridist


def time_us(fn, inner: int = 20, repetitions: int = 15, warmup: int = 3, graph: bool = False) -> float:
    """Median microseconds per call of `fn()` on this rank (a collective: call it on every rank)."""
    for _ in range(warmup):
        fn()
    run = fn
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # a call outside the capture initialises what the capture cannot
        torch.cuda.current_stream().wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            for _ in range(inner):
                fn()
        run = cuda_graph.replay
        calls_per_run, runs = inner, 1
    else:
        calls_per_run, runs = inner, inner
    samples = []
    for _ in range(repetitions):
        tridist.barrier_all()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(1 if graph else runs):
            run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / calls_per_run)
    return statistics.median(samples)


def slowest(value: float) -> float:
    """The largest value over all ranks: a collective finishes when its slowest rank does."""
    if not dist.is_initialized():
        return value
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return max(everyone)
