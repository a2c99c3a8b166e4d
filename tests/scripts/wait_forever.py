"""A kernel waits on a flag nobody raises; with a bounded wait the job fails and says where."""
import tridist
import tridist.language as dl


@tridist.jit
def never_signalled_kernel(flag_ptr):
    dl.wait(flag_ptr, 1, scope="sys", waitValue=1)


w = tridist.init()
flags = tridist.signals(1, name="flags")
never_signalled_kernel[(1,)](flags)
tridist.barrier_all()
