"""`tridist bench allgather|reducescatter|allreduce`: tridist against NCCL (and PyTorch's symmetric
memory all-reduce where it runs) in the same run, after checking tridist's result, and PyTorch's,
against NCCL's.

Sizes follow nccl-tests: the all-gather's output, the reduce-scatter's input, the all-reduce's
buffer. With --symmetric, tridist's all-gather writes into a symmetric output and its all-reduce
works in place on a symmetric buffer (as PyTorch's symmetric-memory ops do), so neither stages;
NCCL keeps regular tensors. Bus bandwidth: bytes * (n-1)/n / t, twice that for all-reduce. Sizes up
to 16 MB are timed as CUDA-graph replays, so launch overhead is not what gets measured.

With --group-size G the ranks split into world/G groups of consecutive ranks (tensor-parallel
groups), and every group runs the op on data of its own at the same time (`group=`), timed against
NCCL's collective on the same subgroups; n above is then G. Each rank's data is drawn from its own
seed. In the emulator every result is checked and nothing is timed.
"""
import argparse
import sys

import torch
import torch.distributed as dist

import tridist
from tridist import ops
from tridist.ops import sizing
from tridist.ops.collectives import allgather, allreduce, reducescatter
from tridist.ops.ranks import ranks_of

from ..runtime.config import parse_bytes
from . import shared_gpu
from .results import save, table, title
from .timing import all_ranks, slowest, time_us

CLASSES = {"allgather": "AllGather", "reducescatter": "ReduceScatter", "allreduce": "AllReduce"}
MODULES = {"allgather": allgather, "reducescatter": reducescatter, "allreduce": allreduce}
METHODS = {name: module.METHODS for name, module in MODULES.items()}
# Methods that reach their peers through symm_at or the copy engines: left out where a group spans nodes.
ONE_NODE = {name: {m for m, kind in module.CLASSES.items() if kind.one_node} for name, module in MODULES.items()}
# Sizes each method is timed at: LL packets double the bytes on the wire (small messages only); the
# copy-engine methods pay a barrier and a copy launch per chunk (large messages only).
LIMITS = {"ll": (0, 1 << 20), "ce": (1 << 20, 1 << 62)}
GRAPH_LIMIT = 16 << 20  # up to here a call is short enough that launching it from Python would be what gets timed


def sizes_between(spec: str) -> list[int]:
    """'4K..256M' -> powers of 4 from 4K to 256M; '4K,1M' -> those."""
    if ".." in spec:
        low, high = (parse_bytes(s) for s in spec.split(".."))
        sizes = []
        while low <= high:
            sizes.append(low)
            low *= 4
        return sizes
    return [parse_bytes(s) for s in spec.split(",")]


def _nccl(name, x, out, group):
    if name == "allgather":
        return lambda: dist.all_gather_into_tensor(out, x, group=group)
    if name == "reducescatter":
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    return lambda: dist.all_reduce(out, group=group)


def _reference(name, x, out, group) -> None:
    """The expected result into `out`, within `group` (None: the world): through NCCL, or through
    the host where ranks share a GPU (and in the emulator)."""
    if name == "allgather":
        shared_gpu.all_gather(out, x, group)
    elif name == "reducescatter":
        shared_gpu.reduce_scatter(out, x, group)
    else:
        shared_gpu.all_reduce(out, group)


def my_group(group_size: int | None):
    """With `group_size` G, the world split into world/G groups of consecutive ranks (every rank
    creates every group, as torch.distributed requires): this rank's; None (the world) without.

    Raises:
        SystemExit: G does not divide the world (on every rank alike)."""
    w = tridist.world()
    if group_size is None:
        return None
    if w.world_size % group_size:
        raise SystemExit(f"--group-size {group_size} does not divide the {w.world_size} ranks")
    groups = [dist.new_group(list(range(start, start + group_size))) for start in range(0, w.world_size, group_size)]
    return groups[w.rank // group_size]


def _right(name: str, result: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether `result` is `reference` on every rank: exact for the all-gather; for sums within 1e-2
    (a bf16 rounding of the fp32 sum)."""
    if name == "allgather":
        return all_ranks(torch.equal(result, reference))
    return all_ranks(torch.allclose(result.float(), reference, rtol=1e-2, atol=1e-2))


def _symm_mem_all_reduce(x, reference, nbytes: int, failures: list, process_group) -> dict:
    """PyTorch's one-shot/two-shot symmetric-memory all-reduce within `process_group` (None: the
    world), label -> call, each checked against `reference` before it is timed (within the rounding
    of a sum in x's dtype); those that cannot run here are left out, those that gave a wrong result
    reported and added to `failures`."""
    import torch.distributed._symmetric_memory as symm_mem

    try:
        group = (dist.group.WORLD if process_group is None else process_group).group_name
        buffer = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buffer, group)
        out = torch.empty_like(buffer)
        calls = {"torch one_shot": (lambda: torch.ops.symm_mem.one_shot_all_reduce_out(buffer, "sum", group, out), out),
                 "torch two_shot": (lambda: torch.ops.symm_mem.two_shot_all_reduce_(buffer, "sum", group), buffer)}
    except Exception as error:  # noqa: BLE001 - reported as a missing column, not a failure
        print(f"(PyTorch symmetric-memory all-reduce unavailable: {type(error).__name__}: {error})", file=sys.stderr)
        return {}
    # PyTorch sums in x's dtype, rounding at every rank's addition: n - 1 roundings of partial sums no
    # larger than the sum of the magnitudes (an fp32 sum rounded once, tridist's, is within one).
    magnitude = x.float().abs()
    dist.all_reduce(magnitude, group=process_group)
    bound = dist.get_world_size(process_group) * torch.finfo(x.dtype).eps * magnitude + 1e-2
    checked = {}
    for label, (call, result) in calls.items():
        result.fill_(float("nan"))
        buffer.copy_(x)  # the input (two_shot sums it in place, and each timed call after this adds to it)
        call()
        if all_ranks(bool(((result.float() - reference).abs() <= bound).all())):
            checked[label] = call
        else:
            print(f"WRONG RESULT: allreduce {label} at {nbytes} bytes", file=sys.stderr)
            failures.append(f"{label}@{nbytes}")
    return checked


def _tridist_buffers(name: str, x: torch.Tensor, out: torch.Tensor, symmetric: bool, group):
    """(kwargs for the op's constructor, the input and output tridist is timed on): with `symmetric`,
    a symmetric output for the all-gather and one symmetric buffer in place for the all-reduce,
    allocated within `group` (None: the world)."""
    if not symmetric:
        return {}, x, torch.full_like(out, float("nan"))
    if name == "allgather":
        result = tridist.symm_empty(tuple(out.shape), out.dtype, group, name="bench out")
        result.fill_(float("nan"))
        return {"symmetric_out": True}, x, result
    buffer = tridist.symm_empty(tuple(x.shape), x.dtype, group, name="bench buffer")
    buffer.copy_(x)
    return {"symmetric_in_place": True}, buffer, buffer


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(name: str, sizes: list[int], methods: list[str], dtype: torch.dtype, variants: list, symmetric: bool = False,
        baselines: bool = True, group_size: int | None = None, timed: bool = True):
    """One row per size: NCCL, each method in each variant (programs cap, slice bytes; None: the
    op's default), PyTorch; and the methods that gave a wrong result (left out of the rows).
    Without `baselines` (ranks sharing a GPU) NCCL and PyTorch are not timed. With `group_size`
    G, every group of G consecutive ranks runs its own op at the same time (`my_group`). Without
    `timed` (the emulator) every method is checked and no row is made."""
    w = tridist.world()
    group = my_group(group_size)
    n = tridist.group(group).size
    if ranks_of(group).nnodes > 1:
        left_out = [m for m in methods if m in ONE_NODE[name]]
        methods = [m for m in methods if m not in ONE_NODE[name]]
        if left_out and w.rank == 0:
            print(f"{name}: {', '.join(left_out)} left out: one node only, and these ranks span nodes")
    baselines = baselines and timed
    seed = torch.Generator(device=w.device).manual_seed(w.rank)  # each rank, so each group, its own data
    rows = []
    failures = []
    for nbytes in sizes:
        numel = nbytes // dtype.itemsize
        if name == "allgather":
            shard = numel // n
            x = torch.randn(shard, generator=seed, device=w.device).to(dtype)
            out = torch.empty(shard * n, dtype=dtype, device=w.device)
        elif name == "reducescatter":
            x = torch.randn(numel, generator=seed, device=w.device).to(dtype)
            out = torch.empty(numel // n, dtype=dtype, device=w.device)
        else:
            x = torch.randn(numel, generator=seed, device=w.device).to(dtype)
            out = x.clone()
        graph = nbytes <= GRAPH_LIMIT
        # Sums are checked against NCCL in fp32: NCCL in bf16 rounds at every hop, which differs from
        # our fp32 accumulation by more than any fair tolerance where the ranks' values cancel.
        reference = out.float() if name != "allgather" else out.clone()
        _reference(name, x if name == "allgather" else x.float(), reference, group)
        row = {"bytes": nbytes}
        nccl_us = slowest(time_us(_nccl(name, x, out.clone(), group), graph=graph)) if baselines else None
        if baselines:
            row["NCCL us"] = nccl_us
        best = None
        for method in methods:
            low, high = LIMITS.get(method, (0, 1 << 62))
            if not low <= nbytes <= high:
                continue
            for cap, slice_bytes in variants:
                label = column(method, cap, slice_bytes).removesuffix(" us")
                options, source, result = _tridist_buffers(name, x, out, symmetric, group)
                error = None
                try:
                    with sizing.piece_sizes(slice_bytes=slice_bytes):
                        op = getattr(ops, CLASSES[name])(x.numel(), dtype, method, programs=cap, group=group,
                                                         **options)
                    op(source, result)
                    _synchronize(w.device)
                except Exception as raised:  # noqa: BLE001 - one broken method must not hide the others' numbers
                    error = raised
                # Every rank (every group) goes on to the same next method, or none would wait for the others.
                if not all_ranks(error is None):
                    print(f"FAILED: {name} {label} at {nbytes} bytes: {error or 'on another rank'}", file=sys.stderr)
                    failures.append(f"{label}@{nbytes}")
                    if symmetric:
                        tridist.symm_free(result)
                    continue
                if not _right(name, result, reference):  # reported and left out; the other methods still run
                    print(f"WRONG RESULT: {name} {label} at {nbytes} bytes", file=sys.stderr)
                    failures.append(f"{label}@{nbytes}")
                elif timed:
                    us = slowest(time_us(lambda: op(source, result), graph=graph))
                    row[column(method, cap, slice_bytes)] = us
                    if method == "auto":
                        row["auto picks"] = op.method
                    else:
                        best = us if best is None else min(best, us)
                op.free()
                if symmetric:
                    _synchronize(w.device)
                    tridist.symm_free(result)
        if not timed:
            continue
        if name == "allreduce" and nbytes <= 16 << 20 and baselines:
            for label, fn in _symm_mem_all_reduce(x, reference, nbytes, failures, group).items():
                row[f"{label} us"] = slowest(time_us(fn, graph=graph))
        if best is not None:
            row["best us"] = best
        if baselines:
            factor = 2 if name == "allreduce" else 1
            row["NCCL busbw GB/s"] = factor * nbytes * (n - 1) / n / nccl_us / 1e3
            if "auto us" in row:
                row["auto vs NCCL"] = nccl_us / row["auto us"]
            if best is not None:
                row["speedup vs NCCL"] = nccl_us / best
                row["busbw GB/s"] = factor * nbytes * (n - 1) / n / best / 1e3
        rows.append(row)
        if w.rank == 0:
            print(f"  {name} {nbytes} bytes: best {best} us" + (f", NCCL {nccl_us:.2f} us" if baselines else ""),
                  flush=True)
    return rows, failures


def column(method: str, programs, slice_bytes) -> str:
    """'push us', 'push/16 us' (at most 16 programs), 'push@32768 us' (32 KB slices)."""
    return (method + ("" if programs is None else f"/{programs}") + ("" if slice_bytes is None else f"@{slice_bytes}")
            + " us")


def plot(name: str, rows: list[dict], path: str, group_size: int | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    sizes = [r["bytes"] for r in rows]
    figure, axis = plt.subplots(figsize=(7, 4))
    for key in [c for c in rows[0] if c.endswith(" us") and c != "best us"]:
        axis.plot(sizes, [r.get(key) for r in rows], marker="o", label=key.removesuffix(" us"))
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("bytes")
    axis.set_ylabel("us (lower is better)")
    groups = "" if group_size is None else f" in groups of {group_size}"
    axis.set_title(title(f"{name}, {tridist.world().world_size} ranks{groups}"))
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def parse_args(argv=None) -> argparse.Namespace:
    """The options; `variants` added: (programs cap, slice bytes) pairs to time each method at."""
    parser = argparse.ArgumentParser(prog="tridist bench <allgather|reducescatter|allreduce>")
    parser.add_argument("op", choices=list(CLASSES))
    parser.add_argument("--sizes", default="4K..256M",
                        help="'4K..256M' (powers of 4) or a list '4K,1M' (default %(default)s)")
    parser.add_argument("--method", default=None, help="one method (default: all of them)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="default %(default)s")
    parser.add_argument("--programs", default="default",
                        help="programs caps to time each method at, e.g. 'default,16,64' (default: the op's own)")
    parser.add_argument("--slice-bytes", default="default",
                        help="slice sizes to time the sliced methods at (push, one_shot, two_shot), e.g. "
                             "'default,32K' (default: sizing.SLICE_BYTES)")
    parser.add_argument("--symmetric", action="store_true",
                        help="all-gather into a symmetric output, all-reduce in place on a symmetric buffer")
    parser.add_argument("--group-size", type=int, default=None,
                        help="split the ranks into groups of this many consecutive ranks, each running the op on "
                             "its own data at once, against NCCL on the same subgroups (default: the world)")
    parser.add_argument("--out", default="benchmarks/results",
                        help="folder for JSON and PNG results (default %(default)s)")
    args = parser.parse_args(argv)
    if args.symmetric and args.op == "reducescatter":
        parser.error("--symmetric is for allgather and allreduce")
    if args.group_size is not None and args.group_size < 1:
        parser.error(f"--group-size takes a positive number of ranks, got {args.group_size}")
    try:
        programs = [None if p == "default" else int(p) for p in args.programs.split(",")]
    except ValueError:
        parser.error(f"--programs takes 'default' and positive ints separated by commas, got {args.programs!r}")
    try:
        slices = [None if s == "default" else parse_bytes(s) for s in args.slice_bytes.split(",")]
    except ValueError:
        parser.error(f"--slice-bytes takes 'default' and sizes separated by commas, got {args.slice_bytes!r}")
    args.variants = [(cap, slice_bytes) for cap in programs for slice_bytes in slices]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    w = tridist.init()
    shared = shared_gpu.announce(f"tridist bench {args.op}", w.rank)
    timed = w.backend == "nvshmem"
    methods = [args.method] if args.method else list(METHODS[args.op])
    rows, failures = run(args.op, sizes_between(args.sizes), methods, getattr(torch, args.dtype), args.variants,
                         args.symmetric, baselines=not shared, group_size=args.group_size, timed=timed)
    if w.rank == 0 and not timed:
        print(f"{args.op}: " + ("every check passed" if not failures else "checks failed") + "; nothing timed (no GPU)")
    elif w.rank == 0:
        columns = ["bytes", *([] if shared else ["NCCL us"]), *[column(m, *v) for m in methods for v in args.variants]]
        columns += sorted({c for r in rows for c in r if c.startswith("torch")})
        columns += ["auto picks"] + (["best us"] if shared else ["auto vs NCCL", "speedup vs NCCL", "busbw GB/s",
                                                                  "NCCL busbw GB/s"])
        print(table(rows, columns))
        # a sweep does not replace the main table, nor do groups
        name = (args.op + ("-symmetric" if args.symmetric else "") + ("" if args.programs == "default" else "-programs")
                + ("" if args.slice_bytes == "default" else "-slices")
                + ("" if args.group_size is None else f"-groups{args.group_size}"))
        path = save(name, rows, args.out, {"world_size": w.world_size, "group_size": args.group_size or w.world_size,
                                           "dtype": args.dtype, "symmetric": args.symmetric,
                                           "programs": args.programs, "slice_bytes": args.slice_bytes})
        plot(args.op, rows, path.replace(".json", ".png"), args.group_size)
        print(f"saved {path}" + (f" ({shared_gpu.SPEED}: no speed claim)" if shared else ""))
    if w.rank == 0 and failures:
        print(f"{args.op}: WRONG RESULTS (left out of the table): {', '.join(failures)}", file=sys.stderr)
    tridist.finalize()
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
