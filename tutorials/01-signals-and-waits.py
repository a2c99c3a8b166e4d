"""# 01. Signals and waits: a queue between two ranks

Two ranks, two kernels running at the same time on two GPUs (or two processes of the emulator),
and nothing in between but memory. Rank 0 produces items and writes them straight into a ring of
slots in rank 1's memory; rank 1 consumes them as they arrive and hands each slot back when it is
done with it. No host takes part: the kernels tell each other what they did through *signals*,
64-bit words in symmetric memory, and *wait* for each other's.

You will learn:

- how a kernel writes into a peer's memory (`dl.symm_at`) and raises a peer's signal
  (`dl.notify`), and why the data written before a notify is visible to whoever sees the signal;
- how a kernel waits for a signal (`dl.wait`), and why the loads after it take a token
  (`dl.consume_token`);
- why signals are never reset: each use waits for a value that only grows, an *epoch*.

Run: `tridist run -n 2 tutorials/01-signals-and-waits.py`

With more ranks, ranks 0 and 1 run the queue and the others watch.
"""
import sys

import torch
import triton.language as tl

import tridist
import tridist.language as dl

# %%
# ## The queue
#
# The queue has `SLOTS` slots of `ITEM` elements, in symmetric memory: every rank allocates the
# same buffers in the same order, so a buffer sits at the same offset of every rank's heap, and a
# kernel that holds its own pointer can compute the peer's (`dl.symm_at`). Two arrays of signal
# words go with it:
#
# - `full[slot]`, on the consumer: the producer raises it once it has written an item into the
#   slot;
# - `free[slot]`, on the producer: the consumer raises it once it has read the item out.
#
# Item `i` goes into slot `i % SLOTS` on *lap* `i // SLOTS + 1` of the ring. The signals carry the
# lap: `full[slot] == lap` means "the item of this lap is in the slot", and `free[slot] == lap`
# means "the consumer is done with this lap's item". The values only grow, so a signal left over
# from an earlier lap can never be mistaken for the current one, and nobody ever resets one.
SLOTS = 4  # items the queue holds at once
ITEM = 64  # elements per item
ITEMS = 10  # items per run: more than SLOTS, so the producer has to wait for slots to come back


def payload(i: int) -> torch.Tensor:
    """What item i holds: its number and the element's index, so that a misplaced item shows."""
    return 1000.0 * i + torch.arange(ITEM, dtype=torch.float32)


# %%
# ## The producer
#
# Before it reuses a slot, the producer waits until the consumer has freed it: `free[slot]` must
# equal the previous lap (0 on the first lap, which is what `tridist.signals` starts at). The
# flags are raised by another GPU, so the wait acquires at system scope (`scope="sys"`).
#
# `dl.wait` returns a *token*. The stores below do not depend on the wait's result, and Triton
# would be free to move loads and address computations above the spin loop; passing the pointer
# through `dl.consume_token(pointer, token)` makes everything computed from it wait for the
# token. (Here it guards stores; in the consumer it guards the loads that really need it.)
#
# `dl.symm_at(queue_ptr, consumer)` is the consumer's address of the queue: stores through it go
# straight into the consumer's memory (NVLink on GPUs). Then `dl.notify` raises the consumer's
# `full[slot]`: it first waits until every thread of the program has issued its stores, then
# releases, so a reader that sees the new lap also sees the item.
@tridist.jit
def produce(queue_ptr, full_ptr, free_ptr, first, items, consumer, SLOTS: tl.constexpr, ITEM: tl.constexpr):
    offsets = tl.arange(0, ITEM)
    remote_queue = dl.symm_at(queue_ptr, consumer)  # translate the base once, add offsets after
    for i in range(first, first + items):
        slot = i % SLOTS
        lap = i // SLOTS + 1
        token = dl.wait(free_ptr + slot, 1, scope="sys", waitValue=lap - 1)
        item = (1000 * i + offsets).to(tl.float32)
        tl.store(dl.consume_token(remote_queue + slot * ITEM, token) + offsets, item)
        dl.notify(full_ptr + slot, consumer, signal=lap)


# %%
# ## The consumer
#
# The mirror image: wait until `full[slot]` shows this item's lap, read the item (through the
# token, so the loads cannot start before the wait is over), do some work with it, and hand the
# slot back by raising the producer's `free[slot]` to the lap. The notify's barrier also means
# every thread has finished reading the slot before the producer may overwrite it.
@tridist.jit
def consume(queue_ptr, full_ptr, free_ptr, out_ptr, first, items, producer, SLOTS: tl.constexpr,
            ITEM: tl.constexpr):
    offsets = tl.arange(0, ITEM)
    for i in range(first, first + items):
        slot = i % SLOTS
        lap = i // SLOTS + 1
        token = dl.wait(full_ptr + slot, 1, scope="sys", waitValue=lap)
        item = tl.load(dl.consume_token(queue_ptr + slot * ITEM, token) + offsets)
        tl.store(out_ptr + (i - first) * ITEM + offsets, 2 * item)  # the "work": double it
        dl.notify(free_ptr + slot, producer, signal=lap)


# %%
# ## Running it, twice
#
# Every rank allocates the same symmetric buffers; rank 0 launches the producer and rank 1 the
# consumer, and the two kernels run side by side. The second run continues where the first
# stopped (`first = ITEMS`): its items are on later laps, so the signals left by the first run
# are simply the "previous lap" values the second one expects. Nothing is reset between runs, and
# no host synchronisation is needed between them either.
#
# If the protocol were wrong (say the consumer waited for `lap + 1`), the wait would never end.
# In the emulator every wait is bounded: after `TRIDIST_WAIT_TIMEOUT` seconds (60 by default) it
# raises `WaitTimeoutError` naming the rank, the kernel, the signal and the values it expected
# and saw, and `tridist run` stops the other ranks. On GPUs, `TRIDIST_DEBUG=1` bounds waits the
# same way.
def main():
    w = tridist.init()
    if w.world_size < 2 or w.node_of(0) != w.node_of(1):
        sys.exit("this tutorial needs 2 ranks on one node: tridist run -n 2 tutorials/01-signals-and-waits.py")
    queue = tridist.symm_zeros((SLOTS, ITEM), torch.float32)
    full = tridist.signals(SLOTS)
    free = tridist.signals(SLOTS)
    received = torch.full((ITEMS, ITEM), float("nan"), device=w.device)
    for run in range(2):
        first = run * ITEMS
        if w.rank == 0:
            produce[(1,)](queue, full, free, first, ITEMS, 1, SLOTS=SLOTS, ITEM=ITEM)
        elif w.rank == 1:
            consume[(1,)](queue, full, free, received, first, ITEMS, 0, SLOTS=SLOTS, ITEM=ITEM)
            expected = torch.stack([2 * payload(i) for i in range(first, first + ITEMS)])
            if not torch.equal(received.cpu(), expected):
                sys.exit(f"rank 1, run {run}: the items that arrived are not the items sent")
    tridist.barrier_all()
    if w.rank == 1:
        print(f"rank 1: {2 * ITEMS} items passed through a queue of {SLOTS} slots, in order and intact")
    tridist.finalize()


if __name__ == "__main__":
    main()
