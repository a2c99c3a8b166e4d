"""`tridist bench flash_decode`: the split-KV decode kernel's bandwidth on one GPU, against a
device-to-device copy and PyTorch's `scaled_dot_product_attention` (SDPA) timed in the same run.

Shapes are (B, L): B sequences of L cached positions, Hq 32 query heads over Hkv 8 KV heads of D 128
by default, bf16. Each rank holds L / world positions of every sequence. Every layout's result is
checked against SDPA in fp32 on the whole cache first. Then, on one rank, per shape:
- copy: the rate of a device-to-device copy of 1 GiB (`timing.copy_rate`, `copy GB/s`), far more
  than L2 holds, timed once a run: bytes read and written (the convention of DESIGN.md's 3021 GB/s
  on an H100), the ceiling of a kernel that reads K and V from HBM. (A copy the size of a small
  cache stays in L2 and runs faster than HBM allows.)
- sdpa: SDPA on K and V laid out [B, Hkv, L, D] contiguous (the layout it reads; the cache's own
  [B, L, Hkv, D] transposed once), q [B, Hq, 1, D], enable_gqa=True; the fastest of the backends
  that accept it (the `sdpa backend` column names it); checked against fp32 SDPA first.
- kernel: `FlashDecode.split_kv`, the split-KV kernel alone (every chunk's record left unmerged), on
  the contiguous cache [B, L, Hkv, D] and on paged caches (block sizes 16 and 64, blocks in random
  order): K and V bytes over its time, as a fraction of the copy's rate (`of copy`).
- op: the whole op: the kernel, then the combine kernel that merges its records (`op / kernel`;
  `op of copy`); `vs sdpa` is SDPA's time over the whole op's.
Targets (issue 25): the kernel's contiguous >= 0.9 of the copy, paged >= 0.85; the op no slower than
SDPA and within 1.05x of the kernel. With several ranks only the op is timed (and with several ranks sharing a GPU,
TRIDIST_RANKS_PER_GPU > 1, nothing: correctness only), next to the kernel alone on the whole cache
on one GPU (`one gpu kernel us`, a lower bound of the one-GPU op) and the op's speed-up over it. The kernel alone is checked too, its records
merged with torch. `--sweep` times only the kernel alone (the op's other variants would more than
double what it compiles), with every config of `tridist.ops.attention.configs`, then the default
config at each `--programs-per-sm`.
"""
import argparse
import os

import torch
import torch.nn.functional as F

import tridist
from tridist.ops import attention

from .results import relative_error, save, table
from .timing import copy_rate, op_us, slowest

SHAPES = [(1, 8192), (1, 32768), (1, 131072), (8, 32768), (16, 16384), (64, 8192)]
PAGES = (16, 64)
TOLERANCE = 2e-2  # largest |error| / largest |expected| against fp32 SDPA, for bf16 and fp16
TARGETS = {"contiguous": 0.9, "paged": 0.85, "op / kernel": 1.05}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x131072,8x32768' -> [(1, 131072), (8, 32768)]; an argparse `type`."""
    shapes = []
    for spec in text.split(","):
        parts = spec.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"shape {spec.strip()!r}: write B x L as two positive integers, e.g. 8x32768")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def parse_config(text: str) -> dict:
    """'BLOCK_N=64,num_warps=4,num_stages=3,programs_per_sm=4' -> a config dict; an argparse `type`."""
    try:
        config = {key.strip(): int(value) for key, value in (item.split("=") for item in text.split(","))}
        attention.decode.check_config(config)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"config {text!r}: {error}") from None
    return config


def config_name(config: dict) -> str:
    splits = f"splits {config['splits']}" if "splits" in config else f"{config['programs_per_sm']}/SM"
    return f"N{config['BLOCK_N']} w{config['num_warps']} s{config['num_stages']} {splits}"


def whole_cache(batch: int, length: int, kv_heads: int, head_dim: int, dtype, device, seed: int):
    """(K, V) [B, L, Hkv, D], the same on every rank."""
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(batch, length, kv_heads, head_dim, generator=g, device=device).to(dtype)
                 for _ in range(2))


def rank_slice(cache: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's positions [rank * L / world, (rank + 1) * L / world) of every sequence, contiguous."""
    length = cache.shape[1]
    return cache[:, rank * length // world_size:(rank + 1) * length // world_size].contiguous()


def paged(k: torch.Tensor, v: torch.Tensor, page: int, seed: int):
    """(K pool, V pool, block table): the caches' blocks of `page` positions in one random order, pools
    [B * ceil(L / page), page, Hkv, D] and the table int32 [B, ceil(L / page)]; the tail of a
    sequence's last block, which no position uses, is zeros."""
    batch, length = k.shape[:2]
    blocks = -(-length // page)
    order = torch.randperm(batch * blocks, generator=torch.Generator().manual_seed(seed)).to(k.device)
    pools = []
    for cache in (k, v):
        padded = torch.zeros(batch, blocks * page, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
        padded[:, :length] = cache
        pool = torch.empty_like(padded).view(batch * blocks, page, *cache.shape[2:])
        pool[order] = padded.view(batch * blocks, page, *cache.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], order.view(batch, blocks).to(torch.int32)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """fp32 SDPA over the whole cache, a few sequences at a time (fp32 copies of the cache are large)."""
    rows = []
    for first in range(0, q.shape[0], chunk):
        part = slice(first, first + chunk)
        rows.append(F.scaled_dot_product_attention(q[part, :, None].float(), k[part].transpose(1, 2).float(),
                                                   v[part].transpose(1, 2).float(), enable_gqa=True)[:, :, 0])
    return torch.cat(rows)


def sdpa_us(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, expected: torch.Tensor) -> tuple[float, str]:
    """(microseconds, backend) of the fastest SDPA backend that takes decode on [B, Hkv, L, D] K and V,
    each checked against `expected` (fp32 SDPA) before it is timed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4, k4, v4 = q[:, :, None], k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    best = (float("inf"), "none")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        def run(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)
        try:
            out = run()
        except Exception:  # noqa: BLE001 - this backend does not take these inputs: not a column
            continue
        check(f"sdpa ({backend.name.lower()})", out[:, :, 0], expected)
        best = min(best, (op_us(run), backend.name.lower()))
    return best


def check(what: str, out: torch.Tensor, expected: torch.Tensor) -> None:
    """Raises on every rank when any rank's result is further than TOLERANCE from fp32 SDPA."""
    error = slowest(relative_error(out, expected))
    if error > TOLERANCE:
        raise AssertionError(f"flash_decode {what}: relative error {error:.2e} against fp32 SDPA")


def merge_partials(partials: torch.Tensor, batch: int, kv_heads: int, group: int, head_dim: int) -> torch.Tensor:
    """The attention [B, Hq, D] that the split-KV kernel's records ([B * Hkv, splits, record], as
    `FlashDecode.split_kv` returns them) add up to, merged here in fp32 with torch (`combine`'s rule)."""
    outputs = partials[..., :group * head_dim].unflatten(-1, (group, head_dim))
    lse = partials[..., group * head_dim:group * (head_dim + 1)]  # base 2
    top = lse.max(dim=1, keepdim=True).values
    weights = torch.exp2(lse - torch.where(torch.isinf(top), 0.0, top))
    merged = (weights[..., None] * outputs).sum(1) / weights.sum(1)[..., None]
    return merged.view(batch, kv_heads * group, head_dim)


def run(shapes, q_heads: int, kv_heads: int, head_dim: int, dtype, configs: list[dict], timed: bool,
        pages=PAGES, whole_op: bool = True) -> list[dict]:
    """A row per (shape, layout, config): the kernel alone (its records merged with torch) and, with
    `whole_op`, the op checked against fp32 SDPA, then (if `timed`) timed."""
    w = tridist.world()
    one_rank = w.world_size == 1
    group = q_heads // kv_heads
    rows = []
    copy = copy_rate(w.device) if timed and one_rank else None  # bytes read and written per microsecond
    for batch, length in shapes:
        k, v = whole_cache(batch, length, kv_heads, head_dim, dtype, w.device, seed=batch + length)
        q = torch.randn(batch, q_heads, head_dim, generator=torch.Generator(device=w.device).manual_seed(length),
                        device=w.device).to(dtype)
        expected = reference(q, k, v)
        mine = [rank_slice(cache, w.rank, w.world_size) for cache in (k, v)]
        expected_here = expected if one_rank else reference(q, *mine)  # what this rank's records add up to
        seqlens = torch.full((batch,), mine[0].shape[1], dtype=torch.int32, device=w.device)
        layouts = {"contiguous": (*mine, seqlens, None)}
        for page in pages:
            pool_k, pool_v, block_table = paged(*mine, page, seed=page)
            layouts[f"paged {page}"] = (pool_k, pool_v, seqlens, block_table)
        shape_name = f"{batch}x{length}"
        nbytes = 2 * mine[0].numel() * mine[0].element_size()  # K and V bytes a rank reads
        baselines = {}
        if timed and one_rank:
            baselines["copy rate"] = copy
            baselines["sdpa"], baselines["backend"] = sdpa_us(q, k, v, expected)
        whole = None  # several ranks timed: the whole cache, for the one-GPU baseline
        if timed and not one_rank and whole_op:
            whole = (k, v, torch.full((batch,), length, dtype=torch.int32, device=w.device), None)
        del k, v
        for config in configs:
            op = attention.FlashDecode(batch, q_heads, kv_heads, head_dim, dtype, config=config)
            for layout, args in layouts.items():
                name = f"{shape_name} {layout} {config_name(op.config)}"
                check(f"{name} kernel alone", merge_partials(op.split_kv(q, *args), batch, kv_heads, group, head_dim),
                      expected_here)
                if whole_op:
                    check(name, op(q, *args, out=torch.full_like(q, float("nan"))), expected)
                row = {"shape": shape_name, "layout": layout, "config": config_name(op.config),
                       "splits": op.splits_for(args[0], args[3])}
                if timed:
                    row.update(_timings(op, q, args, nbytes, baselines, layout, whole_op))
                    if whole is not None and layout == "contiguous":
                        row.update(_against_one_gpu(op, q, whole, row["op us"]))
                rows.append(row)
                if w.rank == 0 and timed:
                    print(f"  {name}: " + ", ".join(f"{key} {value:.2f}" for key, value in row.items()
                                                    if isinstance(value, float)), flush=True)
            tridist.barrier_all()
            op.free()
    return rows


def _timings(op, q, args, nbytes, baselines, layout, whole_op) -> dict:
    """Microseconds of the op (with `whole_op`) and, on one rank, of the kernel alone, with their
    ratios to the copy and SDPA (`baselines`) and whether the targets are met."""
    row = {}
    out = torch.empty_like(q)
    if whole_op:
        row["op us"] = op_us(lambda: op(q, *args, out=out))
    if not baselines:  # several ranks: the op's time only
        return row
    kernel = op_us(lambda: op.split_kv(q, *args))
    rate = baselines["copy rate"]  # bytes read and written per microsecond
    row.update({"kernel us": kernel, "of copy": nbytes / kernel / rate})
    met = row["of copy"] >= TARGETS["contiguous" if layout == "contiguous" else "paged"]
    if whole_op:
        row.update({"op / kernel": row["op us"] / kernel, "op of copy": nbytes / row["op us"] / rate})
        met = met and row["op / kernel"] <= TARGETS["op / kernel"]
    if layout == "contiguous":
        row.update({"sdpa us": baselines["sdpa"], "sdpa backend": baselines["backend"],
                    "sdpa of copy": nbytes / baselines["sdpa"] / rate})
        if whole_op:
            row["vs sdpa"] = baselines["sdpa"] / row["op us"]
            met = met and row["op us"] <= baselines["sdpa"]
    row["copy GB/s"] = rate / 1e3
    row["targets met"] = met
    return row


def _against_one_gpu(op, q, whole, op_us_here) -> dict:
    """Several ranks: the kernel alone on the whole cache on each GPU (every rank at once, the slowest
    taken), a lower bound of what one GPU takes for the op (its records are left unmerged), and the
    op's speed-up over it (issue 27: >= 1.8 at 2 ranks and 128k positions)."""
    one_gpu = op_us(lambda: op.split_kv(q, *whole))
    return {"one gpu kernel us": one_gpu, "vs one gpu": one_gpu / op_us_here}


def sweep_configs(device, programs_per_sm: list[int]) -> list[dict]:
    """Every config of `attention.configs`, then the default one at each of `programs_per_sm`."""
    candidates = attention.configs(device)
    return candidates + [{**candidates[0], "programs_per_sm": p} for p in programs_per_sm
                         if p != candidates[0]["programs_per_sm"]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tridist bench flash_decode")
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES,
                        help="BxL, comma separated (default: " + ",".join(f"{b}x{n}" for b, n in SHAPES) + ")")
    parser.add_argument("--heads", default="32,8", help="query heads,KV heads (default %(default)s)")
    parser.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--config", type=parse_config, action="append",
                        help="BLOCK_N=..,num_warps=..,num_stages=..,programs_per_sm=.. (or splits=..); repeatable; "
                             "default: the op's default config")
    parser.add_argument("--sweep", action="store_true",
                        help="the kernel alone (not the op) with every config of tridist.ops.attention.configs, "
                             "then the default config at each --programs-per-sm")
    parser.add_argument("--programs-per-sm", default="1,2,8,16", help="for --sweep (default %(default)s)")
    parser.add_argument("--pages", default=",".join(map(str, PAGES)),
                        help="block sizes of the paged caches, comma separated, '' for none (default %(default)s)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON results (default %(default)s)")
    args = parser.parse_args(argv)
    q_heads, kv_heads = (int(h) for h in args.heads.split(","))
    w = tridist.init()
    if w.backend != "nvshmem":
        raise SystemExit("tridist bench flash_decode times a GPU; the emulator runs its checks in tests/test_attention.py")
    configs = (sweep_configs(w.device, [int(p) for p in args.programs_per_sm.split(",")]) if args.sweep
               else args.config or [attention.configs(w.device)[0]])
    shared_gpu = int(os.environ.get("TRIDIST_RANKS_PER_GPU", "1")) > 1  # ranks split the SMs: no speed claims
    pages = [int(p) for p in args.pages.split(",") if p.strip()]
    rows = run(args.shapes, q_heads, kv_heads, args.head_dim, getattr(torch, args.dtype), configs,
               timed=not shared_gpu, pages=pages, whole_op=not args.sweep)
    if w.rank == 0:
        columns = []
        for row in rows:
            columns += [c for c in row if c not in columns]
        print(table(rows, columns))
        extra = {"world_size": w.world_size, "heads": [q_heads, kv_heads], "head_dim": args.head_dim,
                 "dtype": args.dtype, "sdpa layout": "[B, Hkv, L, D] contiguous, enable_gqa=True",
                 "targets": TARGETS, "timed": not shared_gpu}
        print(f"saved {save('flash_decode-sweep' if args.sweep else 'flash_decode', rows, args.out, extra)}")
    tridist.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
