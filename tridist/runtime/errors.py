"""The exceptions tridist raises. Each message says what went wrong and what to change."""


class TridistError(RuntimeError):
    """Base class of tridist's own errors."""


class NotInitializedError(TridistError):
    """A tridist function that needs the world ran before `tridist.init()`."""


class WaitTimeoutError(TridistError):
    """A bounded wait expired (in the emulator after TRIDIST_WAIT_TIMEOUT seconds): the message
    names the rank, the kernel, the signal (its heap offset) and the expected and observed values."""


class PeerFailedError(TridistError):
    """A peer rank died or failed while this rank was waiting on it."""


class SymmetricAllocationError(TridistError):
    """Symmetric allocations disagree between ranks (the message lists what each asked for), or
    the heap is exhausted."""


class DeviceCheckError(TridistError):
    """A check inside a kernel (`dl.check`) failed, in the emulator: the message names the rank, the
    kernel, what was checked, and the observed value and its limit."""
