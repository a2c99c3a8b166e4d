"""`tridist bench grouped_gemm|ag_moe|moe_rs`: the grouped GEMM and the tensor-parallel MoE ops,
each checked against a float32 reference first, then timed next to PyTorch in the same run (every
baseline checked against the same reference before it is timed).

Layers (`--layers`, LAYERS): experts x rows per expert, K (hidden), N (the experts' inner size),
topk. The routing is balanced, pair p of the layer's tokens to expert p % experts, so every expert
gets its rows (the layer has experts * rows / topk tokens, split over the ranks):
- mixtral: 8 experts x 1024 rows, K 4096, N 14336, top-2;
- deepseek: 32 x 128 rows, K 7168, N 2048, top-8;
- decode: 32 x 16 rows, K 7168, N 2048, top-8.

grouped_gemm: x (experts * rows) x K times w (experts x K x N) on one rank, against
torch._grouped_mm (fp8: torch._scaled_grouped_mm, row and column scales), and against a
device-to-device copy of as many bytes as the weights in the same run, whose rate counts bytes read
plus written (as DESIGN.md's 3021 GB/s): "weights / copy" is the rate the weights were read at over
the copy's. Targets on one H100: TFLOP/s at least torch's at mixtral and deepseek; at decode the
weights read at 0.9 of the copy rate or more.
ag_moe: the layer's up projection (tokens and N split over the ranks), against the grouped GEMM
alone on this rank's share (tridist's and torch._grouped_mm, on the gathered tokens already sorted:
no routing, no communication) and the sequential path (NCCL all-gather of tokens and routing, sort,
gather, torch._grouped_mm). moe_rs: the down projection (h x N/world, w experts x N/world x K),
against the grouped GEMM alone and the sequential path (torch._grouped_mm, the top-k weighted sum,
NCCL reduce-scatter). Target on one GPU at one rank: within 1.05x of the grouped GEMM alone. The op
and the grouped GEMM alone are timed in turns (`timing.interleaved_us`), so that a drift of the
clocks within the run moves both alike.
`--tile-orders source,expert` times both walks of the MoE ops' tiles (`tensor_parallel.routing`) in one run.
With TRIDIST_RANKS_PER_GPU > 1 (ranks sharing a GPU) only the checks run.
"""
import argparse
import os

import torch
import torch.distributed as dist

import tridist
from tridist import ops
from tridist.ops.gemm import grouped
from tridist.ops.moe import policy

from .results import relative_error, save, table
from .timing import interleaved_us, op_us, print_kernels, slowest

LAYERS = {"mixtral": (8, 1024, 4096, 14336, 2), "deepseek": (32, 128, 7168, 2048, 8),
          "decode": (32, 16, 7168, 2048, 8)}
TOLERANCE = 3e-2  # relative to the largest value: bf16 outputs, and moe_rs's bf16 partial sums


def parse_layers(text: str) -> list[tuple]:
    """'mixtral,EXRxKxNxTOPK' -> layers; an argparse `type`."""
    layers = []
    for spec in text.split(","):
        spec = spec.strip().lower()
        if spec in LAYERS:
            layers.append((spec, *LAYERS[spec]))
            continue
        parts = spec.split("x")
        if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"layer {spec!r}: one of {', '.join(LAYERS)}, or experts x rows x K x N x "
                                             "topk as five positive integers, e.g. 8x1024x4096x14336x2")
        layers.append((spec, *(int(p) for p in parts)))
    return layers


def shared_gpu() -> bool:
    """Ranks share a GPU (TRIDIST_RANKS_PER_GPU > 1): correctness only, no timings, no NCCL."""
    return int(os.environ.get("TRIDIST_RANKS_PER_GPU", "1")) > 1


def _random(shape, seed: int, device, dtype=torch.bfloat16, scale: float = 1.0):
    """The same tensor on every rank (seeded), of values near `scale`."""
    g = torch.Generator(device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)


def balanced_routing(tokens: int, topk: int, experts: int, device) -> torch.Tensor:
    return (torch.arange(tokens * topk, device=device) % experts).view(tokens, topk)


def _offs(idx: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.bincount(idx.reshape(-1), minlength=experts).cumsum(0).to(torch.int32)


def _reference_grouped(x, w, offs, scale_a=None, scale_b=None):
    """float32 products group by group (rows past offs[-1] zero)."""
    out = torch.zeros(x.shape[0], w.shape[2], device=x.device)
    start = 0
    for expert, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].float() @ w[expert].float()
        if scale_a is not None:
            out[start:end] *= scale_a[start:end, None] * scale_b[expert]
        start = end
    return out


def _check(what: str, result, expected) -> None:
    error = slowest(relative_error(result, expected))
    if error > TOLERANCE:
        raise AssertionError(f"{what}: relative error {error:.2e} against the float32 reference")


def _has(op: str) -> bool:
    return hasattr(torch, op) and torch.cuda.is_available()


def grouped_rows(layers, dtype, timed: bool = True, configs: bool = False) -> list[dict]:
    """Each layer: tridist's grouped GEMM (its default config; with `configs`, every config too),
    torch's, and a copy of the weights' bytes."""
    device = tridist.world().device
    rows = []
    for name, experts, per_expert, k, n, _ in layers:
        fp8 = dtype == grouped.FP8
        x = _random((experts * per_expert, k), 1, device, scale=k ** -0.25).to(dtype)
        offs = torch.full((experts,), per_expert, dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
        if fp8:
            w = _random((experts, n, k), 2, device, scale=k ** -0.25).to(dtype).transpose(1, 2)
            scales = (torch.rand(x.shape[0], device=device) + 0.5, torch.rand(experts, n, device=device) + 0.5)
        else:
            w = _random((experts, k, n), 2, device, scale=k ** -0.25)
            scales = ()
        expected = _reference_grouped(x, w, offs, *scales)
        out = ops.grouped_gemm(x, w, offs, None, None, *scales)
        _check(f"grouped_gemm {name}", out, expected)
        candidates = {"default": None}
        if configs:
            candidates.update({_config_name(c): c for c in grouped.configs(device, dtype)})
        for label, config in candidates.items():
            _check(f"grouped_gemm {name} {label}", ops.grouped_gemm(x, w, offs, out, config, *scales), expected)
        if not timed:
            continue
        flops = 2 * x.shape[0] * k * n
        weight_bytes = w.numel() * w.element_size()
        copy = torch.empty_like(w)
        copy_us = op_us(lambda: copy.copy_(w))
        torch_us = torch_call = None
        if fp8 and _has("_scaled_grouped_mm"):
            def torch_call():
                return torch._scaled_grouped_mm(x, w, *scales, offs=offs, out_dtype=torch.bfloat16)
        elif not fp8 and _has("_grouped_mm"):
            def torch_call():
                return torch._grouped_mm(x, w, offs=offs)
        if torch_call is not None:  # checked, as tridist's is, before it is timed
            _check(f"grouped_gemm {name}: torch", torch_call(), expected)
            torch_us = op_us(torch_call)
        for label, config in candidates.items():
            us = op_us(lambda: ops.grouped_gemm(x, w, offs, out, config, *scales))
            row = {"layer": name, "config": label if config else _config_name(grouped.default_config(
                device, x.shape[0], experts, n, dtype)), "tridist us": us, "TFLOP/s": flops / us / 1e6}
            if torch_us is not None:
                row.update({"torch us": torch_us, "torch TFLOP/s": flops / torch_us / 1e6, "vs torch": torch_us / us})
            row.update({"weights GB/s": weight_bytes / us / 1e3, "copy GB/s": 2 * weight_bytes / copy_us / 1e3,
                        "weights / copy": (weight_bytes / us) / (2 * weight_bytes / copy_us)})
            rows.append(row)
    return rows


def _config_name(config: dict) -> str:
    return (f"{config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']} s{config['num_stages']} "
            f"w{config['num_warps']}{' flat' if config['FLATTEN'] else ''}")


class _Layer:
    """This rank's inputs of a layer split over the ranks, and what it needs to check them: every
    rank draws the whole layer from the same seeds and keeps its part."""

    def __init__(self, experts, per_expert, k, n, topk, world, device):
        self.experts, self.k, self.topk = experts, k, topk
        self.world_size, self.rank = world.world_size, world.rank
        tokens = experts * per_expert // topk
        if tokens % world.world_size or n % (8 * world.world_size):
            raise ValueError(f"{tokens} tokens and N = {n} must split over {world.world_size} ranks (N into multiples "
                             "of 8)")
        self.tokens, self.n = tokens // world.world_size, n // world.world_size
        mine = slice(self.rank * self.tokens, (self.rank + 1) * self.tokens)
        self.x = _random((tokens, k), 3, device, scale=k ** -0.25)
        self.idx = balanced_routing(tokens, topk, experts, device)
        self.weights = torch.rand(tokens, topk, generator=torch.Generator(device).manual_seed(4), device=device)
        self.x_shard, self.idx_shard, self.weights_shard = (t[mine].contiguous()
                                                            for t in (self.x, self.idx, self.weights))
        self.order = torch.sort(self.idx.reshape(-1), stable=True).indices  # pair of each row of h
        self.offs = _offs(self.idx, experts)
        self.pairs = tokens * topk

    def up(self, rank):
        return _random((self.experts, self.k, self.n), 10 + rank, self.x.device, scale=self.k ** -0.25)

    def down(self, rank):
        return _random((self.experts, self.n, self.k), 20 + rank, self.x.device, scale=self.n ** -0.25)

    def h(self, rank):
        return _random((self.pairs, self.n), 30 + rank, self.x.device)

    def sorted_tokens(self):
        return self.x[self.order // self.topk].contiguous()

    def expected_y(self):
        """This rank's tokens' outputs: every rank's products, weighted and summed."""
        total = sum(_reference_grouped(self.h(r), self.down(r), self.offs) for r in range(self.world_size))
        by_pair = torch.empty_like(total)
        by_pair[self.order] = total
        mine = by_pair.view(-1, self.topk, self.k)[self.rank * self.tokens:(self.rank + 1) * self.tokens]
        return (mine * self.weights_shard[:, :, None]).sum(1)


def parse_comm_programs(text: str) -> list[int | None]:
    """'default,16,33' -> [None, 16, 33]; an argparse `type`."""
    values = []
    for spec in text.split(","):
        spec = spec.strip()
        if spec == "default":
            values.append(None)
        elif spec.isdigit() and int(spec) > 0:
            values.append(int(spec))
        else:
            raise argparse.ArgumentTypeError(f"--comm-programs {spec!r}: a positive int or 'default', e.g. default,16,33")
    return values


def parse_tile_orders(text: str) -> list[str]:
    orders = [order.strip() for order in text.split(",")]
    for order in orders:
        if order not in policy.TILE_ORDERS:
            raise argparse.ArgumentTypeError(f"--tile-orders {order!r}: one of {', '.join(policy.TILE_ORDERS)}")
    return orders


def moe_rows(op_name: str, layers, timed: bool = True, comm_programs=(None,), kernels: bool = False,
             tile_orders=("auto",)) -> list[dict]:
    """A row per layer and tile order (moe_rs: and each of `comm_programs`, None for the op's default)."""
    rows = []
    for layer_spec in layers:
        for order in tile_orders:
            for programs in comm_programs if op_name == "moe_rs" else (None,):
                row = _moe_layer(op_name, *layer_spec, timed, programs, kernels, order)
                rows += [row] if row else []
    return rows


def _moe_layer(op_name, name, experts, per_expert, k, n, topk, timed, comm_programs, kernels,
               tile_order) -> dict | None:
    """One layer checked and (if `timed`) timed: its row; with `kernels`, the op's GPU time per
    kernel printed as well."""
    w = tridist.world()
    row = None
    layer = _Layer(experts, per_expert, k, n, topk, w, w.device)
    up = layer.up(w.rank)
    ag = ops.AllGatherMoE(layer.tokens, k, layer.n, experts, topk, torch.bfloat16, tile_order=tile_order)
    h, handle = ag(layer.x_shard, layer.idx_shard, up)
    if op_name == "ag_moe":
        alone = (layer.sorted_tokens(), up)
        expected = products = _reference_grouped(*alone, layer.offs)
        _check(f"ag_moe {name}", h, expected)
        op, args = ag, (layer.x_shard, layer.idx_shard, up, h)
    else:
        down, h = layer.down(w.rank), layer.h(w.rank)
        op = ops.MoEReduceScatter(layer.tokens, layer.n, k, experts, topk, torch.bfloat16, comm_programs,
                                  tile_order=tile_order)
        args = (h, down, handle, layer.weights_shard)
        expected = layer.expected_y()
        _check(f"moe_rs {name}", op(*args), expected)
        alone = (h, down)
        products = _reference_grouped(*alone, layer.offs)
    if timed:
        row = {"layer": name, "config": _config_name(op.config), "tiles by": "expert" if op.by_expert else "source"}
        if op_name == "moe_rs":
            row["comm programs"] = op.comm_programs
        gemm_out = torch.empty(alone[0].shape[0], alone[1].shape[2], dtype=torch.bfloat16, device=w.device)
        # Every baseline is checked, as the op was, before it is timed.
        _check(f"{op_name} {name}: grouped GEMM alone", ops.grouped_gemm(*alone, layer.offs, gemm_out), products)
        row[f"{op_name} us"], row["grouped GEMM alone us"] = interleaved_us(
            [lambda: op(*args), lambda: ops.grouped_gemm(*alone, layer.offs, gemm_out)])
        if _has("_grouped_mm"):
            _check(f"{op_name} {name}: torch._grouped_mm", torch._grouped_mm(*alone, offs=layer.offs), products)
            row["torch._grouped_mm us"] = op_us(lambda: torch._grouped_mm(*alone, offs=layer.offs))
            sequential = _sequential(op_name, layer, *alone)
            _check(f"{op_name} {name}: sequential NCCL + torch", sequential(), expected)
            row["sequential us"] = op_us(sequential)
        row["/ GEMM alone"] = row[f"{op_name} us"] / row["grouped GEMM alone us"]
        if w.rank == 0:
            print(f"  {op_name} {name}: {row[f'{op_name} us']:.1f} us, grouped GEMM alone "
                  f"{row['grouped GEMM alone us']:.1f} us", flush=True)
        if kernels:
            print_kernels(f"{op_name} {name}", lambda: op(*args), w.rank)
    tridist.barrier_all()
    op.free()
    if op is not ag:
        ag.free()
    return row


def _sequential(op_name: str, layer: _Layer, a, b):
    """The same step as NCCL and PyTorch one after the other."""
    world_size = layer.world_size
    if op_name == "ag_moe":
        x = torch.empty(world_size * layer.tokens, layer.k, dtype=torch.bfloat16, device=a.device)
        idx = torch.empty(world_size * layer.tokens, layer.topk, dtype=torch.int64, device=a.device)
        # Counted with index_add_ into a buffer of their own: torch.bincount on a GPU reads the
        # largest id back to the host, which a CUDA graph cannot capture.
        counts = torch.zeros(layer.experts, dtype=torch.int64, device=a.device)
        ones = torch.ones(idx.numel(), dtype=torch.int64, device=a.device)

        def run():
            dist.all_gather_into_tensor(x, layer.x_shard)
            dist.all_gather_into_tensor(idx, layer.idx_shard)
            order = torch.sort(idx.reshape(-1), stable=True).indices
            counts.zero_()
            offs = counts.index_add_(0, idx.reshape(-1), ones).cumsum(0).to(torch.int32)
            return torch._grouped_mm(x[order // layer.topk], b, offs=offs)
        return run
    y = torch.empty(layer.tokens, layer.k, dtype=torch.bfloat16, device=a.device)
    weights = layer.weights.to(torch.bfloat16)[:, :, None]

    def run():
        products = torch._grouped_mm(a, b, offs=layer.offs)
        by_pair = torch.empty_like(products)
        by_pair[layer.order] = products
        partial = (by_pair.view(-1, layer.topk, layer.k) * weights).sum(1)
        dist.reduce_scatter_tensor(y, partial)
        return y
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tridist bench <grouped_gemm|ag_moe|moe_rs>")
    parser.add_argument("op", choices=["grouped_gemm", "ag_moe", "moe_rs"])
    parser.add_argument("--layers", type=parse_layers, default=parse_layers(",".join(LAYERS)),
                        help=f"comma separated: {', '.join(LAYERS)} (default all) or EXRxKxNxTOPK")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"],
                        help="grouped_gemm only (default %(default)s; fp8 with row and column scales, bf16 out)")
    parser.add_argument("--configs", action="store_true", help="grouped_gemm: time every config as well")
    parser.add_argument("--kernels", action="store_true",
                        help="ag_moe, moe_rs: also print where a call's GPU time goes, by kernel (PyTorch's profiler)")
    parser.add_argument("--comm-programs", type=parse_comm_programs, default=[None],
                        help="moe_rs: the programs of the peers' combine, comma separated, 'default' for the op's "
                             "(default: default)")
    parser.add_argument("--tile-orders", type=parse_tile_orders, default=["auto"],
                        help="ag_moe, moe_rs: tile orders to time, comma separated: auto, source, expert "
                             "(default: auto)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON results (default %(default)s)")
    args = parser.parse_args(argv)
    w = tridist.init()
    if w.backend != "nvshmem":
        raise SystemExit("the MoE benchmarks time GPUs against PyTorch and NCCL; run them on a GPU box")
    timed = not shared_gpu()
    if args.op == "grouped_gemm":
        rows = grouped_rows(args.layers, getattr(torch, args.dtype), timed, args.configs)
    else:
        if args.dtype != "bfloat16":
            raise SystemExit("ag_moe and moe_rs take bf16 and fp16; --dtype is for grouped_gemm")
        rows = moe_rows(args.op, args.layers, timed, args.comm_programs, args.kernels, args.tile_orders)
    if w.rank == 0:
        if not timed:
            print(f"{args.op}: every layer checked (ranks share a GPU: TRIDIST_RANKS_PER_GPU > 1, nothing timed)")
        else:
            columns = []
            for row in rows:
                columns += [c for c in row if c not in columns]
            print(table(rows, columns))
            name = args.op if args.dtype == "bfloat16" else f"{args.op}-{args.dtype}"
            print(f"saved {save(name, rows, args.out, {'world_size': w.world_size, 'dtype': args.dtype})}")
    tridist.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
