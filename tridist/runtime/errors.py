"""The exceptions tridist raises. Each message says what went wrong and what to change."""


class TridistError(RuntimeError):
    """Base class of tridist's own errors."""


class NotInitializedError(TridistError):
    """A tridist function that needs the world ran before `tridist.init()`."""


class WaitTimeoutError(TridistError):
    """A bounded wait expired: it names the rank, the kernel, the signal and the values."""


class PeerFailedError(TridistError):
    """A peer rank died or failed while this rank was waiting on it."""


class SymmetricAllocationError(TridistError):
    """Symmetric allocations disagree between ranks, or the heap is exhausted."""
