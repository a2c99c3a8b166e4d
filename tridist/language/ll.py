"""Low-latency (LL) packets (`dl.ll`): each 32-bit data word travels with a 32-bit flag.

A packet is one 64-bit word, flag in the high half and data in the low half, written by a single
8-byte store, which lands whole. The reader polls the words themselves until every flag equals the
value it expects, so no separate signal, fence or second round trip is needed: the cost is half of
the bandwidth. Contiguous packets are stored 16 bytes at a time (two packets per vector store, the
16-byte LL line of NCCL); each 8-byte half still validates itself.

Flags must change between uses of a buffer (pass an epoch that grows each call), so that packets
left from the previous call never look fresh. A flag travels as its low 32 bits, and both sides
compare those: an int64 epoch past 2^31 still matches (a reader that compared it whole would wait
forever), and epochs 2^32 apart, which never share a buffer in flight, look alike. Data of other
types is bitcast to int32 words first.
"""
import triton
import triton.language as tl

from ..runtime.backend import is_emulator

if is_emulator():
    from . import _emulated as _lowering
else:
    from . import _gpu as _lowering


@triton.jit
def pack(data, flag):
    """int32 `data` and `flag` (its low 32 bits) -> int64 packets, the flag in the high half."""
    return (tl.cast(flag, tl.int64) << 32) | (data.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def unpack(packets):
    """int64 packets -> their int32 data."""
    return (packets & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def send(dest, data, flag, mask):
    """Store `data` with `flag` as packets at `dest`.

    Args:
        dest: int64 pointers, one per word: a local buffer or a peer's (through `dl.symm_at`),
            symmetric so that the reader finds it.
        data: int32 words (bitcast other types first: `x.to(tl.int32, bitcast=True)`).
        flag: this use's flag, usually the call's epoch; readers compare its low 32 bits.
        mask: which of the words to send.
    """
    tl.store(dest, pack(data, flag), mask=mask)


@triton.jit
def recv(source, flag, mask):
    """Wait until the packets at `source` (where `mask`) all carry `flag`; return their int32 data.

    Every thread of the program polls the packets themselves: no separate signal. Each thread's
    copy of the data is the arrived one, also where the block's layout gives a packet to several
    threads (each loads its own copy; `_gpu.wait_packets` says how that is made safe). Bounded and
    reporting like [`dl.wait`][tridist.language.wait] (in the emulator, and on GPUs with
    TRIDIST_DEBUG=1): the report names one packet still missing and the flag found there.

    Args:
        source: int64 pointers to this rank's packet buffer.
        flag: the flag the sender used.
        mask: which packets to wait for (masked-off words come back as 0).
    """
    return unpack(_lowering.wait_packets(source, mask, tl.cast(flag, tl.int32)))
