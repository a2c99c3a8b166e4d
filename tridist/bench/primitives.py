"""`tridist bench primitives`: what the device API moves between two GPUs, in the spirit of the
NVSHMEM perftests and MSCCL++'s memory-channel tests.

Ranks pair up (0<->1, 2<->3, ...) and every pair works in both directions at once. Bandwidth, by
size, each timed inside a CUDA graph up to 1 MB so that small sizes exclude launch skew:
- put:  programs load local data and store it into the peer's buffer through `dl.symm_at`;
- get:  programs load the peer's buffer through `dl.symm_at` and store it locally;
- putmem: NVSHMEM's `putmem_nbi_block`, one chunk per program, then `quiet`;
- LL:   low-latency packets (half the bytes are flags), received and unpacked by the peer; the
  packets' flag is a call epoch counted on the device (`protocol.call_epoch`), so graph replays
  send fresh flags;
- copy engine: `cudaMemcpyAsync` into the peer's buffer (torch `copy_`), the baseline.
Latency, per operation, of one program issuing them back to back inside one kernel:
- a single-element `dl.shmem.p` followed by `quiet`, a `dl.shmem.g` (each at the index the one
  before returned, so that none overlaps the next), and a remote `dl.shmem.atomic_fetch_add`;
- `putmem_block` + `quiet` and `getmem_block` from 8 B to 1 MB, captured in a CUDA graph;
- a signal round trip: a flag bounced between the pair, per round trip.
Where the pair is on two (virtual) nodes, only NVSHMEM's own transfers run (putmem and the
latencies): loads, stores, LL packets and the copy engine need a peer on this node.
Each operation is checked before it is timed. At world 1 the rank's peer is itself: every figure
is then of the local path only (no NVLink, no network), as the output and the JSON say.
"""
import argparse

import torch
import triton.language as tl

import tridist
import tridist.language as dl

from ..ops.protocol import call_epoch, finish_call

from ..ops.sizing import programs_for, splits_for
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


@tridist.jit
def ll_kernel(src_ptr, packets_ptr, out_ptr, calls_ptr, peer, n, BLOCK: tl.constexpr):
    """Send this rank's words to the peer as packets flagged with the call epoch, then receive the
    peer's. `packets_ptr` has two halves used on alternate calls (by epoch parity), so a fast rank's
    next call never overwrites packets its peer has not read yet."""
    flag = call_epoch(calls_ptr)
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
    finish_call(calls_ptr)


@tridist.jit(do_not_specialize=["base"])
def ping_pong_kernel(flag_ptr, peer, rounds, base, initiator, COMM_SCOPE: tl.constexpr):
    for i in range(1, rounds + 1):
        if initiator:
            dl.notify(flag_ptr, peer, signal=base + i, sig_op="set", comm_scope=COMM_SCOPE)
            dl.wait(flag_ptr, 1, scope="sys", semantic="acquire", waitValue=base + i)
        else:
            dl.wait(flag_ptr, 1, scope="sys", semantic="acquire", waitValue=base + i)
            dl.notify(flag_ptr, peer, signal=base + i, sig_op="set", comm_scope=COMM_SCOPE)


@tridist.jit
def p_latency_kernel(dest_ptr, peer, rounds):
    """`rounds` single-element puts to `peer`, each completed (`quiet`) before the next; the last
    leaves `rounds` there."""
    for i in range(rounds):
        dl.shmem.p(dest_ptr, i + 1, peer)
        dl.shmem.quiet()


@tridist.jit
def g_latency_kernel(chain_ptr, out_ptr, peer, rounds):
    """`rounds` single-element gets from `peer`, each at the index the one before returned (the
    chain holds [1, 0]), so that none can be issued before the one before has returned."""
    index = tl.cast(0, tl.int64)
    for _ in range(rounds):
        index = dl.shmem.g(chain_ptr + index, peer)
    tl.store(out_ptr, index)


@tridist.jit
def fetch_add_latency_kernel(counter_ptr, out_ptr, peer, rounds):
    """`rounds` remote fetch-and-adds of 1 to `peer`'s counter, each waiting for its answer; the
    last answer goes to `out`."""
    old = tl.cast(0, tl.int64)
    for _ in range(rounds):
        old = dl.shmem.atomic_fetch_add(counter_ptr, 1, peer)
    tl.store(out_ptr, old)


@tridist.jit
def put_latency_kernel(dst_ptr, src_ptr, nbytes, peer, rounds):
    """`rounds` puts of `nbytes` by one program (`putmem_block`), each completed before the next."""
    for _ in range(rounds):
        dl.shmem.putmem_block(dst_ptr, src_ptr, nbytes, peer)
        dl.shmem.quiet()


@tridist.jit
def get_latency_kernel(dst_ptr, src_ptr, nbytes, peer, rounds):
    """`rounds` gets of `nbytes` by one program (`getmem_block`, which returns once the data is here)."""
    for _ in range(rounds):
        dl.shmem.getmem_block(dst_ptr, src_ptr, nbytes, peer)


def peer_of(w) -> int:
    """The rank this one works with: its pair (rank ^ 1), or itself in a world of one."""
    return w.rank ^ 1 if w.world_size > 1 else w.rank


def path_of(w) -> str:
    if w.world_size == 1:
        return "local: a world of 1 rank, whose peer is itself (no NVLink, no network)"
    where = "on this node" if w.same_node(peer_of(w)) else "on two nodes: NVSHMEM transfers only"
    return f"rank pairs 0<->1, 2<->3, ..., both directions at once, {where}"


def payload(rank: int, n: int) -> torch.Tensor:
    """The `n` random words rank `rank` sends, the same on every rank that asks."""
    return torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(1000 * rank + n))


def transfer_rows(sizes: list[int], programs: int, timed: bool = True) -> list[dict]:
    """Check every transfer at every size, then (if `timed`) time it. Untimed, it is the test of
    these kernels, which also runs in the emulator."""
    w = tridist.world()
    peer = peer_of(w)
    rows = []
    largest = max(sizes) // 4
    src = tridist.symm_empty((largest,), torch.int32)
    dst = tridist.symm_empty((largest,), torch.int32)
    packets = tridist.symm_zeros((2 * largest,), torch.int64)
    out = torch.empty(largest, dtype=torch.int32, device=w.device)
    for nbytes in sizes:
        n = nbytes // 4
        grid = (splits_for(n, BLOCK, programs),)
        calls = torch.zeros(1, dtype=torch.int64, device=w.device)  # the LL epochs of this grid
        # Each rank draws its data from a seed of its own, so it knows its peer's without reading it:
        # the peer may be on another (virtual) node, where no load or store reaches.
        src[:n] = payload(w.rank, n).to(w.device)
        expected = payload(peer, n).to(w.device)
        cases = {"putmem": (lambda: putmem_kernel[grid](src, dst, peer, n), dst)}
        if w.same_node(peer):  # loads, stores and the copy engine reach only the GPUs of this node
            cases.update({
                "put": (lambda: put_kernel[grid](src, dst, peer, n, BLOCK=BLOCK), dst),
                "get": (lambda: get_kernel[grid](src, dst, peer, n, BLOCK=BLOCK), dst),
                "LL": (lambda: ll_kernel[grid](src, packets, out, calls, peer, n, BLOCK=BLOCK), out),
                "copy engine": (lambda: tridist.peer_tensor(dst, peer)[:n].copy_(src[:n]), dst),
            })
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
            us = slowest(time_us(fn, inner=50 if small else 5, graph=small))
            row[f"{name} us"] = us
            row[f"{name} GB/s"] = nbytes / us / 1e3
        rows.append(row)
    for t in (packets, dst, src):
        tridist.symm_free(t)
    return rows


def latency_rows(rounds: int = 1000, timed: bool = True) -> list[dict]:
    """Per-operation latency of a single-element p, g and remote atomic_fetch_add, each checked
    first (`rounds` operations in one kernel; timed without a graph: one launch is spread over all)."""
    w = tridist.world()
    peer = peer_of(w)
    word = tridist.symm_zeros((2,), torch.int64)
    out = torch.zeros(1, dtype=torch.int64, device=w.device)
    cases = {
        "p": (lambda: p_latency_kernel[(1,)](word, peer, rounds), lambda: int(word[0].item()) == rounds),
        "g": (lambda: g_latency_kernel[(1,)](word, out, peer, rounds), lambda: int(out.item()) == rounds % 2),
        "atomic_fetch_add": (lambda: fetch_add_latency_kernel[(1,)](word, out, peer, rounds),
                             lambda: int(word[0].item()) == rounds and int(out.item()) == rounds - 1),
    }
    rows = []
    for name, (fn, correct) in cases.items():
        word.copy_(torch.tensor([1, 0] if name == "g" else [0, 0]))  # g follows the chain 0 -> 1 -> 0 ...
        tridist.barrier_all()
        fn()
        tridist.barrier_all()
        if not correct():
            raise AssertionError(f"rank {w.rank}: {name} x {rounds} left {word.tolist()}, returned {out.item()}")
        tridist.barrier_all()  # nobody runs again while a peer still checks
        if timed:
            rows.append({"operation": name, "latency us": slowest(time_us(fn, inner=1, repetitions=10)) / rounds})
    tridist.symm_free(word)
    return rows


def put_get_latency_rows(sizes: list[int], rounds: int = 10, timed: bool = True) -> list[dict]:
    """Per-operation latency of putmem_block + quiet and of getmem_block by one program, by size,
    each checked first; timed as CUDA-graph replays, so that the launches are not what is measured."""
    w = tridist.world()
    peer = peer_of(w)
    largest = max(sizes)
    src = tridist.symm_empty((largest,), torch.uint8)
    put_dst = tridist.symm_empty((largest,), torch.uint8)
    get_dst = tridist.symm_empty((largest,), torch.uint8)  # a get's local side, registered as across nodes it must be
    def pattern(rank):  # bytes that differ from rank to rank and along the buffer
        return ((torch.arange(largest) * 7 + rank * 13) % 251).to(torch.uint8).to(w.device)

    src.copy_(pattern(w.rank))
    peers_src = pattern(peer)  # computed here: a peer on another node has no address this rank can read
    rows = []
    for nbytes in sizes:
        cases = {"put": (lambda: put_latency_kernel[(1,)](put_dst, src, nbytes, peer, rounds), put_dst),
                 "get": (lambda: get_latency_kernel[(1,)](get_dst, src, nbytes, peer, rounds), get_dst)}
        row = {"bytes": nbytes}
        for name, (fn, result) in cases.items():
            result.fill_(0)
            tridist.barrier_all()
            fn()
            tridist.barrier_all()
            if not torch.equal(result[:nbytes], peers_src[:nbytes]):
                raise AssertionError(f"rank {w.rank}: {name} of {nbytes} bytes moved wrong data")
            tridist.barrier_all()
            if timed:
                row[f"{name} us"] = slowest(time_us(fn, inner=10, repetitions=10, graph=True)) / rounds
        rows.append(row)
    for t in (get_dst, put_dst, src):
        tridist.symm_free(t)
    return rows


def round_trip_rows(rounds: int = 1000, timed: bool = True) -> list[dict]:
    w = tridist.world()
    peer = peer_of(w)
    flag = tridist.signals(1)
    rows = []
    scopes = (("gpu", "st.release via symm_at"), ("inter_node", "nvshmem signal_op"))
    for scope, label in scopes if w.same_node(peer) else scopes[1:]:
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
    parser.add_argument("--latency-sizes", default="8,64,512,4K,32K,256K,1M",
                        help="sizes of the put and get latencies (default %(default)s)")
    parser.add_argument("--programs", type=int, default=None,
                        help="programs per transfer at most (default: one per SM, which a 128 MB put needs to pass "
                             "340 GB/s on H200; 64 reached 329 GB/s)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON results (default %(default)s)")
    args = parser.parse_args(argv)
    from ..runtime.config import parse_bytes

    w = tridist.init()
    if (w.world_size > 1 and w.world_size % 2) or w.backend != "nvshmem":
        raise SystemExit("tridist bench primitives runs on one GPU rank (the local path) or an even number of them: "
                         "tridist run -n 2 ...")
    shared = shared_gpu.announce("tridist bench primitives", w.rank)
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    programs = args.programs or programs_for(w.device)
    transfers = transfer_rows(sizes, programs)
    latencies = latency_rows()
    put_get = put_get_latency_rows([parse_bytes(s) for s in args.latency_sizes.split(",")])
    trips = round_trip_rows()
    if w.rank == 0:
        print(f"peers: {path_of(w)}")
        columns = ["bytes"] + [f"{name} {unit}" for name in ("put", "get", "putmem", "LL", "copy engine")
                               for unit in ("us", "GB/s")]
        print("transfers (GB/s each way, slowest rank; up to 1 MB timed as CUDA-graph replays):")
        print(table(transfers, columns))
        print("latency of one operation, issued back to back by one program:")
        print(table(latencies, ["operation", "latency us"]))
        print("putmem_block + quiet and getmem_block, one program, CUDA-graph replays:")
        print(table(put_get, ["bytes", "put us", "get us"]))
        print(table(trips, ["signal", "round trip us"]))
        path = save("primitives", transfers + latencies + put_get + trips, args.out,
                    {"world_size": w.world_size, "programs": programs, "path": path_of(w)})
        print(f"saved {path}" + (f" ({shared_gpu.SPEED}: no speed claim)" if shared else ""))
    tridist.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
