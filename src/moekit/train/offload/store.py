"""Offloaded training's expert state laid out in regions (``storage.regions``): every MoE layer's expert
tensors, by kind, in one file, and which experts' pages a transfer moves.

Each (layer, kind) is one region: the layer's stacked expert tensors (``w_in [E, D, W]``,
``w_out [E, F, D]``, biases) one after another, in the layout a RAM buffer of ``unit`` bytes holds
them. Kinds are the weights, their gradient and AdamW's two moments.

An expert's tensors are one contiguous run of bytes per role (the stacked dim leads), so a
transfer may move only some experts (``Experts``: a flag per expert): the direct-I/O pages that hold
a moved expert's bytes, run by run, and no page that holds only other experts'. Where an expert's
bytes are not a whole number of pages, the pages it shares with a neighbour (or every expert's small
bias tensors, in one page) move with it, the neighbour's bytes too: counted as moved, and the
neighbour is not counted in ``experts_skipped``. A read of some experts does one of three things
with the rest of the buffer (``Rest``): zeroes the bytes outside the pages read, which is what a
gradient region needs (an expert that received no token has an exactly-zero gradient, and the
neighbour's bytes inside a page read are what the write of the same experts left there: zeros);
leaves them as they are (a backward's weights: an expert without rows takes part in no product);
or keeps them as read before (completing a partly read buffer).

The host tier (``train.host_budget``, ``RegionFile.move_to_host``) holds some regions in RAM instead;
``host_regions`` says which.
"""

from __future__ import annotations

import enum
import threading

import torch
from torch import Tensor

from moekit.storage.aligned import DIRECT_ALIGN, round_up
from moekit.storage.files import StorageFile
from moekit.storage.regions import RegionFile

KINDS = ("weight", "grad", "exp_avg", "exp_avg_sq")
Experts = tuple[bool, ...] | None  # the experts a transfer moves, a flag each (None: the whole region)
_ALIGN = 64  # offset of each tensor inside a region: aligned for any dtype view and SIMD loads


class Rest(enum.Enum):
    """What a read of some experts leaves in the buffer's bytes outside the pages it reads."""

    ZERO = "zero"  # zeros: the experts left out are idle (a gradient); counted in ``experts_skipped``
    UNUSED = "unused"  # whatever was there: the experts left out are idle and never read; counted
    HELD = "held"  # kept: read before into this buffer (a read completing it); not counted


class LayerFile(RegionFile):
    """(layer, kind) regions of expert tensors (``RegionFile``), each read or written whole or as some
    experts' pages; counts the bytes moved and the experts left out.

    ``file``: claimed (``StorageFile.claim``), given its room here. ``shapes``: each role's stacked shape
    (the same in every layer), in the order of the module's parameters. Thread-safe: reader and writer
    threads call ``read`` and ``write`` concurrently on different regions.
    """

    def __init__(self, file: StorageFile, num_layers: int, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__(file, [(layer, kind) for layer in range(num_layers) for kind in KINDS], region_bytes(shapes))
        self.shapes = shapes
        self.offsets, end = _layout(shapes)
        self.tensor_bytes = sum(torch.Size(s).numel() * 4 for s in shapes.values())  # one layer, one kind
        self.tensors_end = end  # bytes from a region's first tensor to the end of its last one
        self._skipped_lock = threading.Lock()
        # by kind: experts left out of transfers as idle none of whose bytes moved (a read or a write,
        # either tier; a read completing a buffer, ``Rest.HELD``, counts none)
        self.experts_skipped = dict.fromkeys(KINDS, 0)

    def views(self, buf_U8: Tensor) -> dict[str, Tensor]:
        """The fp32 tensors inside a region's buffer, by role (views, no copy)."""
        return {
            role: buf_U8[off : off + torch.Size(shape).numel() * 4].view(torch.float32).view(shape)
            for (role, shape), off in zip(self.shapes.items(), self.offsets.values(), strict=True)
        }

    def read(self, layer: int, kind: str, buf_U8: Tensor, experts: Experts = None, rest: Rest = Rest.ZERO) -> None:
        """Region (layer, kind) into ``buf_U8``; with ``experts``, only the pages of theirs, the other
        experts' bytes outside those pages as ``rest`` says."""
        assert isinstance(rest, Rest), f"rest={rest!r}: a Rest"
        spans = self.spans(experts)
        self.transfer((layer, kind), buf_U8, spans, write=False)
        if rest is Rest.ZERO:
            for start, end in _gaps(spans, self.tensors_end):
                buf_U8[start:end].zero_()
        self._count_skipped(kind, 0 if rest is Rest.HELD else self._untouched(experts, spans))

    def write(self, layer: int, kind: str, buf_U8: Tensor, experts: Experts = None) -> None:
        """``buf_U8`` to region (layer, kind); with ``experts``, only the pages holding theirs, which may
        hold other experts' bytes too: ``buf_U8`` holds every expert's (a gradient: zero if idle)."""
        spans = self.spans(experts)
        self.transfer((layer, kind), buf_U8, spans, write=True)
        self._count_skipped(kind, self._untouched(experts, spans))

    def spans(self, experts: Experts) -> list[tuple[int, int]]:
        """The byte spans ``[start, end)`` of a region that a transfer of ``experts`` moves: the whole
        region when every expert moves; else each moved expert's run of bytes per role, widened to
        whole direct-I/O pages, the overlapping and touching ones merged."""
        if experts is None or all(experts):
            return [(0, self.unit)]
        pages = [
            (start - start % DIRECT_ALIGN, round_up(end, DIRECT_ALIGN))
            for e in (e for e, moves in enumerate(experts) if moves)
            for start, end in self._runs(e)
        ]
        merged: list[tuple[int, int]] = []
        for start, end in sorted(pages):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged

    def _runs(self, expert: int) -> list[tuple[int, int]]:
        """The byte runs ``[start, end)`` of ``expert``'s tensors in a region, one per role."""
        runs = []
        for shape, offset in zip(self.shapes.values(), self.offsets.values(), strict=True):
            per_expert = torch.Size(shape[1:]).numel() * 4
            runs.append((offset + expert * per_expert, offset + (expert + 1) * per_expert))
        return runs

    def _untouched(self, experts: Experts, spans: list[tuple[int, int]]) -> int:
        """How many of the experts left out of a transfer have no byte in ``spans``."""

        def moved(start: int, end: int) -> bool:
            return any(start < span_end and span_start < end for span_start, span_end in spans)

        left_out = (e for e, moves in enumerate(experts or ()) if not moves)
        return sum(not any(moved(*run) for run in self._runs(e)) for e in left_out)

    def _count_skipped(self, kind: str, skipped: int) -> None:
        with self._skipped_lock:
            self.experts_skipped[kind] += skipped


def _layout(shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, int], int]:
    """Each role's byte offset in a region, and where the last tensor ends."""
    offsets, end = {}, 0
    for role, shape in shapes.items():
        offsets[role] = end
        end = round_up(end + torch.Size(shape).numel() * 4, _ALIGN)
    return offsets, end


def region_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """Bytes of one region of fp32 tensors of ``shapes``: whole 4 KiB blocks."""
    return round_up(_layout(shapes)[1], DIRECT_ALIGN)


def _gaps(spans: list[tuple[int, int]], end: int) -> list[tuple[int, int]]:
    """The byte spans of ``[0, end)`` outside the sorted, disjoint ``spans``."""
    gaps, at = [], 0
    for start, stop in spans:
        if start > at:
            gaps.append((at, min(start, end)))
        at = max(at, stop)
    if at < end:
        gaps.append((at, end))
    return [(a, b) for a, b in gaps if a < b]


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
    step of ``grad_accum`` (A) micro-batches, a layer's regions move (validation passes aside; the
    counts are of transfers, each whole or of some experts' pages: an idle expert's gradient pages
    and a backward's unrouted experts' weight pages stay, so a region's bytes per transfer depend on
    the routing, which is not known ahead; the ranking takes every transfer as whole):

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
