"""`tridist bench gemm_rs_epilogue -n 1 [--rounds N] [variant ...]`: where gemm_rs's time over the
GEMM alone goes, on ONE GPU.

gemm_rs takes more than the GEMM alone; variants of its kernel in one call split that into three
parts (benchmarks/NOTES.md, "Moved from the code's docstrings (issue 41)"): the flags and the
stores of the peer's tiles into the contiguous tile layout, the sums of the received tiles, and
the stores crossing NVLink. The first two need no second GPU, so this benchmark rebuilds the
kernel's tile loop on one: rank 0 of a pretend world of two computes shard 1's tiles first and
writes each into the tile layout (kept local) with its flag raised one tile late, as if sending
it, then computes shard 0 and adds the tile "received" for the same t. Switches turn the parts on
and off and try other ways of doing them:
- PEER: how shard 1's tiles are written. 0: into `out` like any GEMM tile (the baseline);
  1: `tl.store` into the tile layout (as gemm_rs_kernel does); 2: one TMA store of the tile;
  3: TMA stores of its two halves (a whole tile's 64 KB buffer does not fit beside 3 stages).
- SUMS: how the received tile is read. 0: not at all; 1: `tl.load` (as gemm_rs_kernel does);
  2: one TMA load; 3: TMA loads of two halves.
- QUIET: a closing `dl.shmem.quiet()`, which only gemm_ar's puts across nodes need: gemm_rs_kernel
  has none (its registers with and without: the same section of the notes).
gemm_rs_kernel is "layout+flags+sums". On the CPU (emulator) it checks the variants without TMA
stores at small shapes and times nothing.
"""
import argparse
import functools
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import tridist
import tridist.language as dl
from tridist.ops import sizing
from tridist.ops.protocol import call_epoch, finish_call
from tridist.ops.gemm import persistent as gemm
from tridist.runtime.jit import jit

from . import results, timing


@triton.jit
def _wait_bulk_stores():
    # A TMA store is done by the async proxy: the flag may go up only once it has completed.
    tl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@jit
def epilogue_variant_kernel(a_desc, b_desc, out_ptr, tiles_ptr, tile_desc, half_desc, flags_ptr, calls_ptr, M, N, K,
                            PEER: tl.constexpr, FLAGS: tl.constexpr, SUMS: tl.constexpr, QUIET: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    epoch = call_epoch(calls_ptr)
    rows = M // 2
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    late = tl.cast(-1, tl.int32)
    for tile in tl.range(tl.program_id(0), 2 * per_shard, tl.num_programs(0), flatten=FLATTEN):
        shard = 1 - tile // per_shard
        t = tile % per_shard
        tm, tn = gemm.tile_coords(t, tiles_m, tiles_n, GROUP_M)
        acc = gemm.tile_product(a_desc, b_desc, shard * rows + tm * BLOCK_M, tn * BLOCK_N, K, BLOCK_M, BLOCK_N,
                                BLOCK_K)
        if FLAGS:
            if late >= 0:
                if PEER >= 2:
                    _wait_bulk_stores()
                dl.notify(flags_ptr + late, 0, signal=epoch, sig_op="set")
                late = tl.cast(-1, tl.int32)
        if shard == 1:
            values = acc.to(tiles_ptr.dtype.element_ty)
            if PEER == 0:
                gemm.store_tile(out_ptr, acc, rows + tm * BLOCK_M, tn * BLOCK_N, M, N, BLOCK_M, BLOCK_N)
            elif PEER == 1:
                tl.store(tiles_ptr + tl.cast(t, tl.int64) * (BLOCK_M * BLOCK_N) + offsets, values)
            elif PEER == 2:
                tile_desc.store([t * BLOCK_M, 0], values)
            else:
                left, right = values.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
                half_desc.store([t * BLOCK_M, 0], left)
                half_desc.store([t * BLOCK_M, BLOCK_N // 2], right)
            if FLAGS:
                late = t
        elif SUMS == 0:
            gemm.store_tile(out_ptr, acc, tm * BLOCK_M, tn * BLOCK_N, M, N, BLOCK_M, BLOCK_N)
        else:
            token = dl.wait(flags_ptr + t, 1, scope="sys", semantic="acquire", waitValue=epoch)
            if SUMS == 1:
                received = dl.consume_token(tiles_ptr + tl.cast(t, tl.int64) * (BLOCK_M * BLOCK_N), token)
                acc += tl.load(received + offsets).to(tl.float32)
                gemm.store_tile(out_ptr, acc, tm * BLOCK_M, tn * BLOCK_N, M, N, BLOCK_M, BLOCK_N)
            elif SUMS == 2:
                acc += tile_desc.load([dl.consume_token(t * BLOCK_M, token), 0]).to(tl.float32)
                gemm.store_tile(out_ptr, acc, tm * BLOCK_M, tn * BLOCK_N, M, N, BLOCK_M, BLOCK_N)
            else:
                row = dl.consume_token(t * BLOCK_M, token)
                low, high = acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
                low += half_desc.load([row, 0]).to(tl.float32)
                high += half_desc.load([row, BLOCK_N // 2]).to(tl.float32)
                gemm.store_tile(out_ptr, low, tm * BLOCK_M, tn * BLOCK_N, M, N, BLOCK_M, BLOCK_N // 2)
                gemm.store_tile(out_ptr, high, tm * BLOCK_M, tn * BLOCK_N + BLOCK_N // 2, M, N, BLOCK_M, BLOCK_N // 2)
    if FLAGS:
        if late >= 0:
            if PEER >= 2:
                _wait_bulk_stores()
            dl.notify(flags_ptr + late, 0, signal=epoch, sig_op="set")
    if QUIET:
        dl.shmem.quiet()
    finish_call(calls_ptr)


# name: (switches, run with FLATTEN too)
VARIANTS = {
    "plain": (dict(PEER=0, FLAGS=False, SUMS=0, QUIET=False), True),
    "plain+quiet": (dict(PEER=0, FLAGS=False, SUMS=0, QUIET=True), True),
    "layout": (dict(PEER=1, FLAGS=False, SUMS=0, QUIET=False), True),
    "layout+flags": (dict(PEER=1, FLAGS=True, SUMS=0, QUIET=False), True),
    "layout+flags+sums": (dict(PEER=1, FLAGS=True, SUMS=1, QUIET=False), True),
    "layout+flags+sums+quiet": (dict(PEER=1, FLAGS=True, SUMS=1, QUIET=True), True),
    "layout+flags+tma sums": (dict(PEER=1, FLAGS=True, SUMS=2, QUIET=False), True),
    "layout+flags+tma half sums": (dict(PEER=1, FLAGS=True, SUMS=3, QUIET=False), True),
    "tma halves+flags": (dict(PEER=3, FLAGS=True, SUMS=0, QUIET=False), True),
    "tma halves+flags+sums": (dict(PEER=3, FLAGS=True, SUMS=1, QUIET=False), True),
    "tma halves+flags+tma half sums": (dict(PEER=3, FLAGS=True, SUMS=3, QUIET=False), True),
    "tma tile+flags+sums": (dict(PEER=2, FLAGS=True, SUMS=1, QUIET=False), False),
    "tma tile+flags+tma sums": (dict(PEER=2, FLAGS=True, SUMS=2, QUIET=False), False),
}
GPU_SHAPES = ((8192, 8192, 4096), (16384, 8192, 4096))  # a rank's GEMM in gemm_rs 8192^3 and 16384 x 8192 x 8192
EMULATOR_SHAPES = ((64, 32, 32),)


def run_variants(m: int, n: int, k: int, config: dict, only: list[str], rounds: int = 1) -> list[dict]:
    """Checks each variant against a reference, then (on GPUs) times them all `rounds` times in turn:
    one variant timed after another drifts with the clocks by more than the differences sought."""
    w = tridist.world()
    on_gpu = w.device.type == "cuda"
    torch.manual_seed(0)
    a = torch.randn(m, k, device=w.device).to(torch.bfloat16)
    b = torch.randn(k, n, device=w.device).to(torch.bfloat16)
    full = a.float() @ b.float()
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    per_shard = triton.cdiv(m // 2, block_m) * triton.cdiv(n, block_n)
    tiles = torch.zeros(per_shard * block_m, block_n, dtype=torch.bfloat16, device=w.device)
    tile_desc = TensorDescriptor.from_tensor(tiles, [block_m, block_n])
    half_desc = TensorDescriptor.from_tensor(tiles, [block_m, block_n // 2])
    flags = tridist.signals(per_shard)
    a_desc, b_desc = gemm.descriptors(a, b, config)
    programs = min(sizing.programs_for(w.device), 2 * per_shard)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=w.device)
    rows, calls = [], {}
    for name, (switches, with_flatten) in VARIANTS.items():
        if (only and name not in only) or (config["FLATTEN"] and not with_flatten):
            continue
        if not on_gpu and switches["PEER"] >= 2:
            continue  # TMA stores wait on the async proxy in PTX
        calls_done = torch.zeros(1, dtype=torch.int64, device=w.device)
        out.fill_(float("nan"))
        calls[name] = functools.partial(epilogue_variant_kernel[(programs,)], a_desc, b_desc, out, tiles, tile_desc,
                                         half_desc, flags, calls_done, m, n, k, **switches, **config)
        calls[name]()
        expected = full[: m // 2] + (full[m // 2:].to(torch.bfloat16).float() if switches["SUMS"] else 0)
        error = results.relative_error(out[: m // 2], expected)
        if not error < 2e-2:
            raise AssertionError(f"{name}: relative error {error:.1e} (bf16 output: expected below 2e-2)")
        rows.append({"shape": f"{m}x{n}x{k}", "FLATTEN": config["FLATTEN"], "variant": name, "rel err": error})
    if on_gpu:
        samples = {name: [] for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                samples[name].append(timing.op_us(call))
        for row in rows:
            row["us"] = statistics.median(samples[row["variant"]])
            row["min us"], row["max us"] = min(samples[row["variant"]]), max(samples[row["variant"]])
    for row in rows:
        print(results.table([row], list(row)).splitlines()[-1], flush=True)
    tridist.symm_free(flags)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tridist bench gemm_rs_epilogue",
                                     description="gemm_rs's tile loop on one GPU, part by part")
    parser.add_argument("--rounds", type=int, default=1, help="times every variant is timed, in turn")
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON results (default %(default)s)")
    parser.add_argument("variants", nargs="*", help="names from VARIANTS (default: all)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; name some of: {', '.join(map(repr, VARIANTS))}")
    w = timing.one_gpu("gemm_rs_epilogue")
    on_gpu = w.device.type == "cuda"
    rows = []
    for m, n, k in GPU_SHAPES if on_gpu else EMULATOR_SHAPES:
        if on_gpu:
            a = torch.randn(m, k, device=w.device).to(torch.bfloat16)
            b = torch.randn(k, n, device=w.device).to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=w.device)
            for name, fn in (("cuBLAS", lambda: torch.matmul(a, b, out=out)),
                             ("gemm.matmul", lambda: gemm.matmul(a, b, out=out))):
                rows.append({"shape": f"{m}x{n}x{k}", "variant": name, "us": timing.op_us(fn)})
                print(rows[-1], flush=True)
        big = (gemm.GPU_CONFIGS[0]["BLOCK_M"], gemm.GPU_CONFIGS[0]["BLOCK_N"])  # the default tile
        for config in gemm.configs(w.device):
            if (config["BLOCK_M"], config["BLOCK_N"]) == big or not on_gpu:
                rows += run_variants(m, n, k, config, args.variants, args.rounds)
    if on_gpu:
        print(results.table(rows, ["shape", "FLATTEN", "variant", "us", "min us", "max us", "rel err"]))
        print("saved", results.save("gemm_rs-epilogue", rows, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
