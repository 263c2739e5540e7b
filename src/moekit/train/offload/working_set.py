"""The RAM tier of offloaded training: a budgeted ``SlotCache`` whose slots each hold one layer's expert
weights, filled and emptied through ``Transfers`` (the reader threads offloaded inference reads with,
and one writer thread). What is training's own here is what to read, and when.

A layer is read into a slot ahead of the pass that needs it: ``fetch`` starts a read if a slot can be
had, ``get`` waits for it. A slot that the pass in progress uses is pinned; any other may be evicted,
the one needed last in the direction the pass walks the layers (``PassOrder``: forward, and the
optimizer's updates that run in it: the lowest layer, whose backward comes last; backward: the
highest, whose next forward comes last).
A backward pass needs only the experts that computed rows in the forward it differentiates: each
layer's training forward names them (``route``), and a backward read of a layer that is not resident
reads only theirs (the others' bytes in the slot left as they were, unused: an expert without rows
takes part in no product, so its weights enter no forward output and no gradient).
Such a slot is held partly; any other use of the layer (a forward, its AdamW step) first reads the
rest into it. Forward reads stay whole: they start before the layer's router has run.
Every region written goes through ``write`` (``Transfers``: a read of that region, and any reuse of
the buffer, waits for the write first), so the file is the truth once ``flush`` returns.

``overlap=False`` is the naive schedule (benchmarks compare against it): no prefetch, and every
read and write waits for its transfer, so no transfer overlaps compute.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
from torch import Tensor

from moekit.storage.slots import PassOrder, SlotCache
from moekit.storage.transfers import Transfers
from moekit.train.offload.store import Experts, LayerFile, Rest, union


class WorkingSet:
    """``num_slots`` RAM slots of layer weights over a ``LayerFile``, and the reads and writes between them."""

    def __init__(self, file: LayerFile, num_slots: int, overlap: bool = True) -> None:
        assert num_slots >= 2, "one slot computes while the next is read"
        self.file = file
        self.order = PassOrder()
        self.cache = SlotCache(num_slots, file.unit, torch.device("cpu"), self.order)
        self.held: dict[int, Experts] = {}  # layer -> the experts its slot holds (None: all), while resident
        self.routed: dict[int, Experts] = {}  # layer -> the experts its next backward needs
        self.io = Transfers(overlap, name="moekit-offload")

    @property
    def overlap(self) -> bool:
        """False: the naive schedule (no prefetch, every transfer waited for)."""
        return self.io.overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self.io.overlap = value

    def prefetch(self, layer: int, direction: int) -> None:
        """Start reading ``layer``'s weights ahead of their use, if a slot can be had."""
        if self.overlap:
            self.fetch(layer, direction)

    def route(self, layer: int, experts: Experts) -> None:
        """The experts that computed rows in ``layer``'s training forward: all its backward reads."""
        self.routed[layer] = experts

    def fetch(self, layer: int, direction: int) -> bool:
        """Start reading ``layer``'s weights unless resident; False when every slot is pinned. Backward
        (``direction`` < 0) reads only the routed experts; a partly held layer gets what it lacks."""
        need = self.routed.get(layer) if direction < 0 else None
        entry = self.cache.entries.get(layer)
        if entry is not None:
            held = self.held[layer]
            wanted = union(held, need)
            if held is not None and wanted != held:
                everyone = (True,) * len(held)
                lacking = tuple(w and not h for h, w in zip(held, wanted or everyone, strict=True))
                buf = self.cache.slot(entry)
                more = lambda: self.file.read(layer, "weight", buf, lacking, Rest.HELD)  # noqa: E731
                entry.loading = self.io.read((layer, "weight"), buf, more, after=entry.loading)
                self.held[layer] = wanted
            return True
        self.order.direction = direction
        entry = self.cache.reserve(layer, pins=0)
        if entry is None:
            return False
        buf = self.cache.slot(entry)
        read = lambda: self.file.read(layer, "weight", buf, need, Rest.UNUSED)  # noqa: E731
        entry.loading = self.io.read((layer, "weight"), buf, read)
        self.held[layer] = need if need is not None and not all(need) else None
        return True

    def get(self, layer: int, direction: int) -> Tensor:
        """``layer``'s weights in their slot (in backward, at least the routed experts'), pinned until
        ``release``."""
        if not self.fetch(layer, direction):
            raise AssertionError(f"no slot for layer {layer}: every slot is pinned")
        entry = self.cache.entries[layer]
        assert entry.loading is not None
        entry.loading.result()
        self.cache.pin(entry)
        return self.cache.slot(entry)

    def release(self, layer: int) -> None:
        self.cache.unpin(self.cache.entries[layer])

    def read(self, layer: int, kind: str, buf: Tensor, experts: Experts = None) -> Future[None]:
        """Read region (layer, kind) into ``buf`` (only ``experts``'s: ``LayerFile.read``) on a reader
        thread, after its pending writes; the read's future."""
        return self.io.read((layer, kind), buf, lambda: self.file.read(layer, kind, buf, experts))

    def write(self, layer: int, kind: str, buf: Tensor, experts: Experts = None) -> None:
        """Write ``buf`` (only ``experts``'s) to region (layer, kind) on the writer thread (in submission order)."""
        self.io.write((layer, kind), buf, lambda: self.file.write(layer, kind, buf, experts))

    def wait_buffer(self, buf: Tensor) -> None:
        """Before ``buf`` is overwritten: its last write has left it."""
        self.io.wait_buffer(buf)

    def flush(self) -> None:
        """Every read submitted has landed and every write has reached the file."""
        self.io.flush()

    def forget(self) -> None:
        """Drop every resident layer (the file was rewritten under them); nothing may be pinned."""
        self.cache.clear()
        self.held.clear()

    def close(self) -> None:
        self.io.close()
