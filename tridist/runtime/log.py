"""tridist's messages: the `tridist` logger (`logging.getLogger("tridist")`), and warnings through
`warnings.warn`, so that a user can silence either as for any other library
(`logging.getLogger("tridist").setLevel(logging.WARNING)`, `warnings.filterwarnings`).

The logger says INFO and above. Until the application configures logging (a handler on the root
logger), tridist writes its own messages to stderr as `tridist: ...`; from then on they only
propagate to the application's handlers. A message about the whole job (the device library, a job
that is compiling) is said by the first rank only, `first_rank()`, so that a job of N ranks says
it once, not N times.
"""
import logging
import os
import sys

logger = logging.getLogger("tridist")


class _UntilConfigured(logging.Handler):
    """Writes to this process's stderr of the moment (tests and the launcher replace it) while the
    root logger has no handler of its own."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the application's handlers get the record through propagation
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass  # stderr is gone (a closed pipe): a message is not worth a traceback


_handler = _UntilConfigured()
_handler.setFormatter(logging.Formatter("tridist: %(message)s"))
logger.addHandler(_handler)
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)


def first_rank() -> bool:
    """Whether this process says the job's messages: rank 0 of a job (RANK, as torchrun and `tridist
    run` set it), or a process that is not a rank of a job."""
    return os.environ.get("RANK", "0") == "0"
