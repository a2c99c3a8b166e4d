"""Rank 1 dies abruptly while rank 0 waits for it in a barrier: the launcher must end the job."""
import os

import tridist

w = tridist.init()
if w.rank == 1:
    os._exit(3)
tridist.barrier_all()
