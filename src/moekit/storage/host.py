"""The host tier: some keys' bytes held in RAM instead of the slower tier below, each read from it once.

Offloaded inference on a GPU holds every expert here, in page-locked memory (``pin``), which is what
lets the device copy from it asynchronously (DMA; pageable memory would make each copy synchronous
and staged by the driver). Offloaded training holds the (layer, kind) regions it moves most per step
here (``train.host_budget``), so their transfers are memory copies instead of disk I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence

from torch import Tensor

from moekit.storage.aligned import aligned_empty


class HostTier:
    """``keys``, ``nbytes`` each, in one 4 KiB-aligned block of RAM; ``fill(key, buf)`` reads a key from
    the tier below into its place, once, here."""

    def __init__(
        self, keys: Sequence[Hashable], nbytes: int, fill: Callable[[Hashable, Tensor], object], pin: bool = False
    ) -> None:
        self.index = {key: i for i, key in enumerate(keys)}
        self.nbytes = nbytes
        self.block = aligned_empty(len(self.index) * nbytes, pin=pin).view(len(self.index), nbytes)
        for key, i in self.index.items():
            fill(key, self.block[i])

    def get(self, key: Hashable) -> Tensor | None:
        """The key's bytes, or None where the tier does not hold it."""
        i = self.index.get(key)
        return None if i is None else self.block[i]

    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.index)
