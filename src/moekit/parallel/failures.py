"""A failed collective (a dead or hung rank) as one clear error, and how a rank ends after one.

Apart from ``parallel.runtime`` so that every command line can catch ``RankFailure`` without importing
the parallelisms (DTensor, FSDP, pipelining, torch.compile: about a second of each start-up).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn

import torch.distributed as dist


class RankFailure(RuntimeError):
    """A collective failed: another rank died, or hung past ``parallel.timeout_s``.

    End the process with ``exit_after_rank_failure`` once the error is reported, not by returning.
    """


def exit_after_rank_failure(code: int) -> NoReturn:
    """End this process now, skipping the interpreter's shutdown.

    NOTE: after a failed collective, gloo's worker thread still holds the collective's tensors and frees
    them a moment after the caller has seen the error; freeing a tensor takes the GIL. If the
    interpreter is finalizing by then, Python ends that thread inside a C++ destructor and the process
    aborts (SIGABRT, "terminate called without an active exception") instead of exiting with the
    error: measured on a loaded machine about one time in ten. The run's files were closed on the way
    out of ``train``; a background checkpoint save still in flight is cut off, and its staging
    directory is never read and is removed when the run next starts.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def collective_errors(timeout_s: float):
    """Turn a failed collective (a dead or hung peer) into one clear ``RankFailure`` on this rank."""
    try:
        yield
    except RuntimeError as err:
        text = str(err).strip()
        # gloo raises a plain RuntimeError (or a DistError); any other error keeps its message, even one
        # that quotes an OS error such as "Connection refused".
        backend = isinstance(err, dist.DistError) or (
            type(err) is RuntimeError and any(w in text for w in ("gloo", "NCCL", "Connection", "Timed out"))
        )
        if not (dist.is_initialized() and backend):
            raise
        first = text.splitlines()[0] if text else type(err).__name__
        raise RankFailure(
            f"rank {dist.get_rank()}: a collective failed, so another rank died or hung longer than "
            f"parallel.timeout_s={timeout_s:g}s ({first[:200]})"
        ) from None
