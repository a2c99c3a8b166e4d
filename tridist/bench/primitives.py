"""`tridist bench primitives`: what the device API moves between two GPUs, in the spirit of the
NVSHMEM perftests and MSCCL++'s memory-channel tests.

Ranks pair up (0<->1, 2<->3, ...) and every pair works in both directions at once:
- put:  programs load local data and store it into the peer's buffer through `dl.symm_at`;
- get:  programs load the peer's buffer through `dl.symm_at` and store it locally;
- putmem: NVSHMEM's `putmem_nbi_block`, one chunk per program, then `quiet`;
- LL:   low-latency packets (half the bytes are flags), received and unpacked by the peer;
- copy engine: `cudaMemcpyAsync` into the peer's buffer (torch `copy_`), the baseline;
- signal round trip: a flag bounced between the pair inside one kernel, per round trip.
Each transfer is checked against the source before it is timed.
"""
import argparse

import torch
import triton.language as tl

import tridist
import tridist.language as dl

from ..ops._protocol import programs_for, splits_for
from . import shared_gpu
from .results import save, table
from .timing import slowest, time_us

BLOCK = 4096  # int32 words a program moves per step: 16 KB, 32 per thread with 4 warps


@tridist.jit
def put_kernel(src_ptr, dst_ptr, peer, n, BLOCK: tl.constexpr):
    remote = dl.symm_at(dst_ptr, peer)
    offsets = tl.arange(0, BLOCK)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        mask = start + offsets < n
        tl.store(remote + start + offsets, tl.load(src_ptr + start + offsets, mask=mask), mask=mask)


@tridist.jit
def get_kernel(src_ptr, dst_ptr, peer, n, BLOCK: tl.constexpr):
    remote = dl.symm_at(src_ptr, peer)
    offsets = tl.arange(0, BLOCK)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        mask = start + offsets < n
        tl.store(dst_ptr + start + offsets, tl.load(remote + start + offsets, mask=mask), mask=mask)


@tridist.jit
def putmem_kernel(src_ptr, dst_ptr, peer, n):
    chunk = tl.cdiv(n, tl.num_programs(0))
    start = tl.program_id(0) * chunk
    count = tl.minimum(chunk, n - start)
    if count > 0:
        dl.shmem.putmem_nbi_block(dst_ptr + start, src_ptr + start, count * 4, peer)
    dl.shmem.quiet()


@tridist.jit(do_not_specialize=["flag"])
def ll_kernel(src_ptr, packets_ptr, out_ptr, peer, n, flag, BLOCK: tl.constexpr):
    """Send this rank's words to the peer as packets, then receive the peer's. `packets_ptr` has
    two halves used on alternate calls (by flag parity), so a fast rank's next call never
    overwrites packets its peer has not read yet."""
    half = (flag % 2) * n
    remote = dl.symm_at(packets_ptr + half, peer)
    local = packets_ptr + half
    offsets = tl.arange(0, BLOCK)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        mask = start + offsets < n
        dl.ll.send(remote + start + offsets, tl.load(src_ptr + start + offsets, mask=mask), flag, mask)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        mask = start + offsets < n
        tl.store(out_ptr + start + offsets, dl.ll.recv(local + start + offsets, flag, mask), mask=mask)


@tridist.jit(do_not_specialize=["base"])
def ping_pong_kernel(flag_ptr, peer, rounds, base, initiator, COMM_SCOPE: tl.constexpr):
    for i in range(1, rounds + 1):
        if initiator:
            dl.notify(flag_ptr, peer, signal=base + i, sig_op="set", comm_scope=COMM_SCOPE)
            dl.wait(flag_ptr, 1, scope="sys", semantic="acquire", waitValue=base + i)
        else:
            dl.wait(flag_ptr, 1, scope="sys", semantic="acquire", waitValue=base + i)
            dl.notify(flag_ptr, peer, signal=base + i, sig_op="set", comm_scope=COMM_SCOPE)


def transfer_rows(sizes: list[int], programs: int, timed: bool = True) -> list[dict]:
    """Check every transfer at every size, then (if `timed`) time it. Untimed, it is the test of
    these kernels, which also runs in the emulator."""
    w = tridist.world()
    peer = w.rank ^ 1
    rows = []
    largest = max(sizes) // 4
    src = tridist.symm_empty((largest,), torch.int32)
    dst = tridist.symm_empty((largest,), torch.int32)
    packets = tridist.symm_zeros((2 * largest,), torch.int64)
    out = torch.empty(largest, dtype=torch.int32, device=w.device)
    flag = [0]
    for nbytes in sizes:
        n = nbytes // 4
        grid = (splits_for(n, BLOCK, programs),)
        src[:n] = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device=w.device)
        tridist.barrier_all()
        expected = tridist.peer_tensor(src, peer)[:n].clone()
        tridist.barrier_all()

        def ll():
            flag[0] += 1
            ll_kernel[grid](src, packets, out, peer, n, flag[0], BLOCK=BLOCK)

        cases = {
            "put": (lambda: put_kernel[grid](src, dst, peer, n, BLOCK=BLOCK), dst),
            "get": (lambda: get_kernel[grid](src, dst, peer, n, BLOCK=BLOCK), dst),
            "putmem": (lambda: putmem_kernel[grid](src, dst, peer, n), dst),
            "LL": (ll, out),
            "copy engine": (lambda: tridist.peer_tensor(dst, peer)[:n].copy_(src[:n]), dst),
        }
        row = {"bytes": nbytes}
        for name, (fn, result) in cases.items():
            result[:n].fill_(-1)
            tridist.barrier_all()
            fn()
            tridist.barrier_all()
            if not torch.equal(result[:n], expected):
                raise AssertionError(f"rank {w.rank}: {name} moved wrong data at {nbytes} bytes")
            if not timed:
                continue
            small = nbytes <= 1 << 20
            us = slowest(time_us(fn, inner=50 if small else 5, graph=small and name != "LL"))
            row[f"{name} us"] = us
            row[f"{name} GB/s"] = nbytes / us / 1e3
        rows.append(row)
    for t in (packets, dst, src):
        tridist.symm_free(t)
    return rows


def round_trip_rows(rounds: int = 1000, timed: bool = True) -> list[dict]:
    w = tridist.world()
    peer = w.rank ^ 1
    flag = tridist.signals(1)
    rows = []
    for scope, label in (("gpu", "st.release via symm_at"), ("inter_node", "nvshmem signal_op")):
        base = [0]

        def bounce():
            ping_pong_kernel[(1,)](flag, peer, rounds, base[0], int(w.rank % 2 == 0), COMM_SCOPE=scope)
            base[0] += rounds

        bounce()
        tridist.barrier_all()
        observed = int(flag.item())
        tridist.barrier_all()  # the peer raises this flag again as soon as it goes on
        if observed != rounds:
            raise AssertionError(f"rank {w.rank}: after {rounds} round trips the flag reads {observed}")
        if timed:
            us = slowest(time_us(bounce, inner=1, repetitions=10, warmup=2)) / rounds
            rows.append({"signal": label, "round trip us": us})
    tridist.symm_free(flag)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tridist bench primitives")
    parser.add_argument("--sizes", default="1K,1M,128M",
                        help="comma-separated sizes (K, M, G suffixes; default %(default)s)")
    parser.add_argument("--programs", type=int, default=None,
                        help="programs per transfer at most (default: one per SM, which a 128 MB put needs to pass "
                             "340 GB/s on H200; 64 reached 329 GB/s)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON results (default %(default)s)")
    args = parser.parse_args(argv)
    from ..runtime.config import parse_bytes

    w = tridist.init()
    if w.world_size % 2 or w.backend != "nvshmem":
        raise SystemExit("tridist bench primitives runs on an even number of GPU ranks: tridist run -n 2 ...")
    shared = shared_gpu.announce("tridist bench primitives", w.rank)
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    programs = args.programs or programs_for(w.device)
    transfers = transfer_rows(sizes, programs)
    trips = round_trip_rows()
    if w.rank == 0:
        columns = ["bytes"] + [f"{name} {unit}" for name in ("put", "get", "putmem", "LL", "copy engine")
                               for unit in ("us", "GB/s")]
        print("bidirectional transfers between rank pairs (GB/s each way, slowest rank):")
        print(table(transfers, columns))
        print(table(trips, ["signal", "round trip us"]))
        path = save("primitives", transfers + trips, args.out, {"world_size": w.world_size, "programs": programs})
        print(f"saved {path}" + (f" ({shared_gpu.SPEED}: no speed claim)" if shared else ""))
    tridist.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
