"""Ctrl-C during training: stop at the end of the step, on every rank at the same step."""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist


class StopOnInterrupt:
    """Turns the first Ctrl-C into a request to stop at the end of the current step (which is then
    checkpointed), so no half-applied step is ever saved; a second Ctrl-C stops at once. ``agreed``
    makes the ranks of ``mesh`` stop together."""

    def __init__(self, mesh=None) -> None:
        self.requested = False
        self.mesh = mesh
        self._previous = None

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (one collective: every rank gets the same answer)."""
        return agree(self.requested, self.mesh)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def agree(flag: bool, mesh) -> bool:
    """True on every rank if it is true on any (a Ctrl-C reaches ranks at different steps)."""
    if mesh is None:
        return flag
    value = torch.tensor(float(flag))
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
