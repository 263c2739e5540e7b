"""Offloaded expert gradients reduced as in-memory training reduces them, one fused bucket per layer.

In memory, ``finish_expert_grads`` turns every expert gradient into the mean over the dp x ep ranks'
losses after the whole backward: summed over dp (the all-to-all backward already summed over ep),
then divided by dp x ep. Offloaded, a layer's gradients leave RAM as its backward ends, so each
layer is reduced then: all its expert gradients (one region of the layer file, viewed as one flat
fp32 bucket) in one asynchronous all-reduce over dp, started as the layer's backward ends and
finished when the next layer's gradients arrive (or before the clip), so that it overlaps the
backward of the layer below. Sums are element-wise, so the bucket's extent does not change the bits
where the reduction adds two values (dp = 2); the division is the in-memory one.

The layer's rows per expert (this rank's, over the step's micro-batches) ride at the bucket's end,
as fp32 (exact integers below 2**24, asserted), summed by the same all-reduce: an expert that no rank
of the dp group gave a token has an exactly-zero reduced gradient, which the engine then neither
writes nor reads back. A rank's own count is not enough: an expert idle here may have computed rows
on another rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

EXACT_COUNTS = 2**24  # every integer below it is exact in fp32


class LayerGradReduce:
    """At most one layer's reduction in flight; ``done`` runs once its bucket holds the mean, and is
    given the layer's rows per expert summed over dp."""

    def __init__(self, dp_group: dist.ProcessGroup | None, batch_ranks: int) -> None:
        self.dp_group = dp_group  # None: nothing to sum (dp = 1)
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.batch_ranks = batch_ranks  # dp x ep: the in-memory divisor (1: no division)
        self._pending: tuple[Tensor, int, dist.Work | None, Callable[[Tensor], None]] | None = None

    def start(self, bucket: Tensor, rows_E: Tensor, done: Callable[[Tensor], None]) -> None:
        """Begin reducing ``bucket``: a layer's gradients, then room for this rank's rows per expert
        ``rows_E``, which are put there (after finishing the previous layer's); ``done(rows_E summed)``
        is called at ``wait``."""
        self.wait()
        assert int(rows_E.max()) * self.dp < EXACT_COUNTS, "rows per expert summed over dp exact in fp32"
        bucket[-len(rows_E) :].copy_(rows_E)
        work = None
        if self.dp_group is not None:
            work = dist.all_reduce(bucket, group=self.dp_group, async_op=True)
        self._pending = (bucket, len(rows_E), work, done)

    def wait(self) -> None:
        """Finish the reduction in flight, if any: the sum arrives, is divided, and handed on."""
        if self._pending is None:
            return
        bucket, experts, work, done = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if self.batch_ranks > 1:
            bucket[:-experts].div_(float(self.batch_ranks))
        done(bucket[-experts:].to(torch.int64))
