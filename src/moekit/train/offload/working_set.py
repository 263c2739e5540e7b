"""The RAM tier of offloaded training: a budgeted set of slots, each holding one layer's expert weights.

A layer is read into a slot by a reader thread (``READERS`` of them, as offloaded inference uses),
ahead of the pass that needs it: ``fetch`` starts a read if a slot can be had, ``get`` waits for it.
A slot that the pass in progress uses is pinned; any other may be evicted, the one needed last in
the direction the pass walks the layers (forward, and the optimizer's updates that run in it: the
lowest layer, whose backward comes last; backward: the highest, whose next forward comes last).
A backward pass needs only the experts that computed rows in the forward it differentiates: each
layer's training forward names them (``route``), and a backward read of a layer that is not resident
reads only theirs (the others' bytes in the slot left as they were, unused: an expert without rows
takes part in no product, so its weights enter no forward output and no gradient).
Such a slot is held partly; any other use of the layer (a forward, its AdamW step) first reads the
rest into it. Forward reads stay whole: they start before the layer's router has run.
Every region written to disk goes through ``write`` on one writer thread; a read of that region, and
any reuse of the buffer, waits for the write first, so the disk is always the truth once ``flush``
returns.

``overlap=False`` is the naive schedule (benchmarks compare against it): no prefetch, and every
read and write waits for its transfer, so no transfer overlaps compute.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from torch import Tensor

from moekit.directio import READERS
from moekit.train.offload.store import Experts, LayerFile, Rest, union


class WorkingSet:
    """``num_slots`` RAM slots of layer weights over a ``LayerFile``, and the reads and writes between them."""

    def __init__(self, file: LayerFile, num_slots: int, overlap: bool = True) -> None:
        assert num_slots >= 2, "one slot computes while the next is read"
        self.file = file
        self.slots = [file.buffer() for _ in range(num_slots)]
        self.layer_in: list[int | None] = [None] * num_slots  # slot -> the layer it holds (or is reading)
        self.loaded: dict[int, tuple[int, Future[None], Experts]] = {}  # layer -> (slot, its read, experts held)
        self.routed: dict[int, Experts] = {}  # layer -> the experts its next backward needs
        self.pins = [0] * num_slots
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="moekit-offload-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="moekit-offload-write")
        self._writes: dict[tuple[int, str], Future[None]] = {}  # (layer, kind) -> its last write
        self._buffer_writes: dict[int, Future[None]] = {}  # id of a buffer -> its last write
        self._reads: list[Future[None]] = []  # reads submitted and perhaps not landed
        self.overlap = overlap

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
        if layer in self.loaded:
            slot, read, held = self.loaded[layer]
            wanted = union(held, need)
            if held is not None and wanted != held:
                everyone = (True,) * len(held)
                lacking = tuple(w and not h for h, w in zip(held, wanted or everyone, strict=True))
                more = self._readers.submit(self._read_more, layer, self.slots[slot], read, lacking)
                self.loaded[layer] = (slot, self._track(more), wanted)
            return True
        free = [s for s, held in enumerate(self.layer_in) if held is None]
        if not free:
            unpinned = [s for s, held in enumerate(self.layer_in) if held is not None and not self.pins[s]]
            if not unpinned:
                return False
            pick = min if direction > 0 else max
            victim = pick(unpinned, key=lambda s: self.layer_in[s])
            _, read, _ = self.loaded.pop(self.layer_in[victim])
            read.result()  # a read still landing in the slot would overwrite the new one
            free = [victim]
        slot = free[0]
        self.layer_in[slot] = layer
        read = self._track(self._readers.submit(self._read, layer, self.slots[slot], need))
        self.loaded[layer] = (slot, read, need if need is not None and not all(need) else None)
        return True

    def get(self, layer: int, direction: int) -> Tensor:
        """``layer``'s weights in their slot (in backward, at least the routed experts'), pinned until
        ``release``."""
        if not self.fetch(layer, direction):
            raise AssertionError(f"no slot for layer {layer}: every slot is pinned")
        slot, read, _ = self.loaded[layer]
        read.result()
        self.pins[slot] += 1
        return self.slots[slot]

    def release(self, layer: int) -> None:
        slot, _, _ = self.loaded[layer]
        assert self.pins[slot] > 0
        self.pins[slot] -= 1

    def read(self, layer: int, kind: str, buf: Tensor, experts: Experts = None) -> Future[None]:
        """Read region (layer, kind) into ``buf`` (only ``experts``'s: ``LayerFile.read``) on a reader
        thread, after its pending writes."""
        self.wait_buffer(buf)
        future = self._track(self._readers.submit(self._read_region, layer, kind, buf, experts))
        if not self.overlap:
            future.result()
        return future

    def write(self, layer: int, kind: str, buf: Tensor, experts: Experts = None) -> None:
        """Write ``buf`` (only ``experts``'s) to region (layer, kind) on the writer thread (in submission order)."""
        self.wait_buffer(buf)
        future = self._writer.submit(self.file.write, layer, kind, buf, experts)
        self._writes[(layer, kind)] = self._buffer_writes[id(buf)] = future
        if not self.overlap:
            future.result()

    def wait_buffer(self, buf: Tensor) -> None:
        """Before ``buf`` is overwritten: its last write has left it."""
        pending = self._buffer_writes.pop(id(buf), None)
        if pending is not None:
            pending.result()

    def _track(self, read: Future[None]) -> Future[None]:
        self._reads = [f for f in self._reads if not f.done()] + [read]
        return read

    def flush(self) -> None:
        """Every read submitted has landed and every write has reached the file."""
        for future in [*self._reads, *self._writes.values()]:
            future.result()
        self._reads.clear()
        self._writes.clear()
        self._buffer_writes.clear()

    def forget(self) -> None:
        """Drop every resident layer (the file was rewritten under them); nothing may be pinned."""
        assert not any(self.pins)
        for _, read, _ in self.loaded.values():
            read.result()
        self.loaded.clear()
        self.layer_in = [None] * len(self.slots)

    def close(self) -> None:
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)

    def _read(self, layer: int, buf: Tensor, experts: Experts) -> None:
        self.wait_buffer(buf)
        self._read_region(layer, "weight", buf, experts, Rest.UNUSED)

    def _read_more(self, layer: int, buf: Tensor, before: Future[None], lacking: tuple[bool, ...]) -> None:
        """The ``lacking`` experts' weights into a slot partly read by ``before``, the rest kept."""
        before.result()
        self.file.read(layer, "weight", buf, lacking, Rest.HELD)

    def _read_region(self, layer: int, kind: str, buf: Tensor, experts: Experts, rest: Rest = Rest.ZERO) -> None:
        pending = self._writes.get((layer, kind))
        if pending is not None:
            pending.result()
        self.file.read(layer, kind, buf, experts, rest)
