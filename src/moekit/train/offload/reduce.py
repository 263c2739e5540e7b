"""Offloaded expert gradients reduced as in-memory training reduces them, one fused bucket per layer.

In memory, ``finish_expert_grads`` turns every expert gradient into the mean over the dp x ep ranks'
losses after the whole backward: summed over dp (the all-to-all backward already summed over ep),
then divided by dp x ep. Offloaded, a layer's gradients leave RAM as its backward ends, so each
layer is reduced then: all its expert gradients (one region of the layer file, viewed as one flat
fp32 bucket) in one asynchronous all-reduce over dp, started as the layer's backward ends and
finished when the next layer's gradients arrive (or before the clip), so that it overlaps the
backward of the layer below. Sums are element-wise, so the bucket's extent does not change the bits
where the reduction adds two values (dp = 2); the division is the in-memory one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor


class LayerGradReduce:
    """At most one layer's reduction in flight; ``done`` runs once its bucket holds the mean."""

    def __init__(self, dp_group: dist.ProcessGroup | None, batch_ranks: int) -> None:
        self.dp_group = dp_group  # None: nothing to sum (dp = 1)
        self.batch_ranks = batch_ranks  # dp x ep: the in-memory divisor (1: no division)
        self._pending: tuple[Tensor, dist.Work | None, Callable[[], None]] | None = None

    def start(self, bucket: Tensor, done: Callable[[], None]) -> None:
        """Begin reducing ``bucket`` (after finishing the previous layer's); ``done`` is called at ``wait``."""
        self.wait()
        work = dist.all_reduce(bucket, group=self.dp_group, async_op=True) if self.dp_group is not None else None
        self._pending = (bucket, work, done)

    def wait(self) -> None:
        """Finish the reduction in flight, if any: the sum arrives, is divided, and handed on."""
        if self._pending is None:
            return
        bucket, work, done = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if self.batch_ranks > 1:
            bucket.div_(float(self.batch_ranks))
        done()
