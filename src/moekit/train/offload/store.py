"""The disk and host tiers of offloaded training: every MoE layer's expert tensors, by kind, in one file.

Each (layer, kind) is one region of the file: the layer's stacked expert tensors (``w_in [E, D, W]``,
``w_out [E, F, D]``, biases) one after another, in the layout a RAM buffer of ``unit`` bytes holds
them. Kinds are the weights, their gradient and AdamW's two moments. A region starts and ends on a
4 KiB boundary, so a whole region is read or written with one direct (``O_DIRECT``) call into an
aligned buffer (``aligned_empty``): no copy through the OS page cache and no cached pages beside the
memory budget. Where the filesystem refuses direct I/O, plain ``preadv``/``pwritev`` are used.

An expert's tensors are one contiguous run of bytes per role (the stacked dim leads), so a
transfer may move only some experts (``Experts``: a flag per expert): the direct-I/O pages that hold
a moved expert's bytes, run by run, and no page that holds only other experts'. Reading that way
sets every other expert's tensors in the buffer to zero, which is what a gradient region needs: an
expert that received no token has an exactly-zero gradient (a backward's weights need only the
experts with rows; ``rest="keep"`` completes such a buffer later). Where an expert's bytes are not a whole
number of pages, the pages it shares with a neighbour move with it (bytes counted as moved).

The host tier (``train.host_budget``) holds some regions in RAM instead: reading or writing one is a
memory copy, counted apart from the disk's bytes. ``host_regions`` says which regions it holds. The
file keeps room for every region (those of the host tier are never read or written there).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
from torch import Tensor

from moekit.directio import DIRECT_ALIGN, aligned_empty, open_direct, round_up

KINDS = ("weight", "grad", "exp_avg", "exp_avg_sq")
Experts = tuple[bool, ...] | None  # the experts a transfer moves, a flag each (None: the whole region)
_ALIGN = 64  # offset of each tensor inside a region: aligned for any dtype view and SIMD loads


class LayerFile:
    """Read and write whole (layer, kind) regions of expert tensors; counts the bytes moved.

    ``shapes``: each role's stacked shape (the same in every layer), in the order of the module's
    parameters. Thread-safe: reader and writer threads call ``read`` and ``write`` concurrently on
    different regions.
    """

    def __init__(self, path: Path, num_layers: int, shapes: dict[str, tuple[int, ...]]) -> None:
        self.path = Path(path)
        self.shapes = shapes
        self.offsets: dict[str, int] = {}
        end = 0
        for role, shape in shapes.items():
            self.offsets[role] = end
            end = round_up(end + torch.Size(shape).numel() * 4, _ALIGN)
        self.tensor_bytes = sum(torch.Size(s).numel() * 4 for s in shapes.values())  # one layer, one kind
        self.tensors_end = end  # bytes from a region's first tensor to the end of its last one
        self.unit = round_up(end, DIRECT_ALIGN)  # bytes of one region and of one RAM buffer
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, num_layers * len(KINDS) * self.unit)
        self._direct_fd = open_direct(self.path, os.O_RDWR)
        self.direct = self._direct_fd >= 0
        self._lock = threading.Lock()
        self.bytes_read = self.bytes_written = 0  # disk bytes
        self.host: dict[tuple[int, str], Tensor] = {}  # (layer, kind) -> the region, in the host tier
        self.host_bytes_read = self.host_bytes_written = 0
        # by kind: experts left out of transfers as idle (a read that zeroes them, a write), either tier
        self.experts_skipped = dict.fromkeys(KINDS, 0)

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._direct_fd = -1
        self.host.clear()

    def buffer(self) -> Tensor:
        """A RAM buffer for one region, on a 4 KiB boundary (where direct I/O may land)."""
        return aligned_empty(self.unit)

    def views(self, buf_U8: Tensor) -> dict[str, Tensor]:
        """The fp32 tensors inside a region's buffer, by role (views, no copy)."""
        return {
            role: buf_U8[off : off + torch.Size(shape).numel() * 4].view(torch.float32).view(shape)
            for (role, shape), off in zip(self.shapes.items(), self.offsets.values(), strict=True)
        }

    def flat(self, buf_U8: Tensor) -> Tensor:
        """Every tensor of a region's buffer as one fp32 vector (the alignment gaps between them ride along, unread)."""
        return buf_U8[: self.tensors_end].view(torch.float32)

    def move_to_host(self, regions: list[tuple[int, str]]) -> None:
        """From now on hold ``regions`` in RAM (each read once from the file), not on disk."""
        for layer, kind in regions:
            region = self.buffer()  # aligned: read directly, not through the page cache
            self.read(layer, kind, region)
            self.host[(layer, kind)] = region

    def read(self, layer: int, kind: str, buf_U8: Tensor, experts: Experts = None, rest: str = "zero") -> None:
        """Region (layer, kind) into ``buf_U8``; with ``experts``, only theirs, every other expert's
        tensors in ``buf_U8`` set to zero (``rest="zero"``: counted as skipped) or left as they are
        (``rest="keep"``: the rest of a partly read buffer, read before; a shared page is read again)."""
        held = self.host.get((layer, kind))
        moved = 0
        for start, end in self.spans(experts):
            span = buf_U8[start:end]
            if held is not None:
                span.copy_(held[start:end])
            else:
                got = os.preadv(self._fd_for(buf_U8), [memoryview(span.numpy())], self._offset(layer, kind) + start)
                if got != end - start:
                    raise OSError(f"{self.path}: short read of layer {layer} {kind}: {got} of {end - start} bytes")
            moved += end - start
        idle = [e for e, moves in enumerate(experts or ()) if not moves] if rest == "zero" else []
        if idle:
            for t in self.views(buf_U8).values():
                t.index_fill_(0, torch.tensor(idle), 0.0)
        if held is not None:
            self._count(kind, len(idle), host_read=moved)
        else:
            self._count(kind, len(idle), read=moved)

    def write(self, layer: int, kind: str, buf_U8: Tensor, experts: Experts = None) -> None:
        """``buf_U8`` to region (layer, kind); with ``experts``, only the pages holding theirs, which may
        hold other experts' bytes too: ``buf_U8`` holds every expert's (a gradient: zero if idle)."""
        held = self.host.get((layer, kind))
        moved = 0
        for start, end in self.spans(experts):
            span = buf_U8[start:end]
            if held is not None:
                held[start:end].copy_(span)
            else:
                put = os.pwritev(self._fd_for(buf_U8), [memoryview(span.numpy())], self._offset(layer, kind) + start)
                if put != end - start:
                    raise OSError(f"{self.path}: short write of layer {layer} {kind}: {put} of {end - start} bytes")
            moved += end - start
        skipped = 0 if experts is None else experts.count(False)
        if held is not None:
            self._count(kind, skipped, host_written=moved)
        else:
            self._count(kind, skipped, written=moved)

    def spans(self, experts: Experts) -> list[tuple[int, int]]:
        """The byte spans ``[start, end)`` of a region that a transfer of ``experts`` moves: the whole
        region when every expert moves; else each moved expert's run of bytes per role, widened to
        whole direct-I/O pages, the overlapping and touching ones merged."""
        if experts is None or all(experts):
            return [(0, self.unit)]
        pages = []
        for shape, offset in zip(self.shapes.values(), self.offsets.values(), strict=True):
            per_expert = torch.Size(shape[1:]).numel() * 4
            for e in (e for e, moves in enumerate(experts) if moves):
                start, end = offset + e * per_expert, offset + (e + 1) * per_expert
                pages.append((start - start % DIRECT_ALIGN, round_up(end, DIRECT_ALIGN)))
        merged: list[tuple[int, int]] = []
        for start, end in sorted(pages):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged

    def _fd_for(self, buf_U8: Tensor) -> int:
        assert buf_U8.numel() == self.unit and buf_U8.is_contiguous()
        direct = self.direct and buf_U8.data_ptr() % DIRECT_ALIGN == 0
        return self._direct_fd if direct else self._fd

    def _offset(self, layer: int, kind: str) -> int:
        return (layer * len(KINDS) + KINDS.index(kind)) * self.unit

    def _count(
        self, kind: str, skipped: int, read: int = 0, written: int = 0, host_read: int = 0, host_written: int = 0
    ) -> None:
        with self._lock:
            self.experts_skipped[kind] += skipped
            self.bytes_read += read
            self.bytes_written += written
            self.host_bytes_read += host_read
            self.host_bytes_written += host_written


def experts_with_rows(rows_E: Tensor) -> Experts:
    """The experts that computed a row (``rows_E``: rows per expert), as a transfer names them."""
    return tuple(bool(n) for n in rows_E.tolist())


def union(a: Experts, b: Experts) -> Experts:
    """The experts either transfer moves (None: every expert)."""
    if a is None or b is None:
        return None
    both = tuple(x or y for x, y in zip(a, b, strict=True))
    return None if all(both) else both


def host_regions(num_layers: int, weight_slots: int, grad_accum: int, capacity: int) -> list[tuple[int, str]]:
    """The ``capacity`` regions the host tier holds: those that move the most disk bytes per step.

    Every region is ``unit`` bytes, so RAM is best spent on the regions moved most often. Per optimizer
    step of ``grad_accum`` (A) micro-batches, a layer's regions move (validation passes aside):

    - gradient: 2A times (written by each micro-batch's backward, read back by the next one to add
      to it and by the AdamW step), whatever the working set holds;
    - each AdamW moment: twice (read and written by the AdamW step);
    - weights: once written by the AdamW step, and read by each of the 2A passes (A forwards, the
      first of which runs the AdamW step on the weights it reads, and A backwards) that finds the
      layer gone from the working set: none when its ``weight_slots`` hold every layer; otherwise
      about (L - slots) / L of those passes (the exact count differs by layer with the eviction
      order, so the estimate is taken for the whole kind).

    The kinds are taken by most transfers per step first (a tie in the order gradient, weights,
    moments), each kind from the last layer down: a gradient's or moment's traffic is the same in
    every layer, and the weights' estimate is one figure for the whole kind.
    """
    missed = max(0, num_layers - weight_slots) / num_layers
    transfers = {"grad": 2 * grad_accum, "weight": 1 + 2 * grad_accum * missed, "exp_avg": 2, "exp_avg_sq": 2}
    kinds = sorted(transfers, key=lambda kind: -transfers[kind])  # stable: ties keep the order above
    ranked = [(layer, kind) for kind in kinds for layer in reversed(range(num_layers))]
    return ranked[:capacity]
