"""The exceptions tridist raises. Each message says what went wrong and what to change."""


class TridistError(RuntimeError):
    """Base class of tridist's own errors."""


class NotInitializedError(TridistError):
    """A tridist function that needs the world ran before `tridist.init()`."""


class WaitTimeoutError(TridistError):
    """A bounded wait expired (after TRIDIST_WAIT_TIMEOUT seconds: always in the emulator, on GPUs
    with TRIDIST_DEBUG=1): the message is one line naming the rank, the kernel, the program, the
    word waited on (its symmetric allocation and index) and the expected and observed values
    (`tridist.runtime.wait_report`); host waits of the emulator (barriers, gathers) say which."""


class PeerFailedError(TridistError):
    """A peer rank died or failed while this rank was waiting on it."""


class SymmetricAllocationError(TridistError):
    """Symmetric allocations disagree between ranks (the message lists what each asked for), or
    the heap is exhausted."""


class DeviceCheckError(TridistError):
    """A check inside a kernel (`dl.check`) failed, in the emulator: the message names the rank, the
    kernel, what was checked, and the observed value and its limit."""
