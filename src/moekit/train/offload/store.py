"""The disk tier of offloaded training: every MoE layer's expert tensors, by kind, in one file.

Each (layer, kind) is one region of the file: the layer's stacked expert tensors (``w_in [E, D, W]``,
``w_out [E, F, D]``, biases) one after another, in the layout a RAM buffer of ``unit`` bytes holds
them. Kinds are the weights, their gradient and AdamW's two moments. A region starts and ends on a
4 KiB boundary, so a whole region is read or written with one direct (``O_DIRECT``) call into an
aligned buffer (``aligned_empty``): no copy through the OS page cache and no cached pages beside the
memory budget. Where the filesystem refuses direct I/O, plain ``preadv``/``pwritev`` are used.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
from torch import Tensor

from moekit.directio import DIRECT_ALIGN, aligned_empty, open_direct, round_up

KINDS = ("weight", "grad", "exp_avg", "exp_avg_sq")
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
        self.bytes_read = self.bytes_written = 0

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._direct_fd = -1

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

    def read(self, layer: int, kind: str, buf_U8: Tensor) -> None:
        got = os.preadv(self._fd_for(buf_U8), [memoryview(buf_U8.numpy())], self._offset(layer, kind))
        if got != self.unit:
            raise OSError(f"{self.path}: short read of layer {layer} {kind}: {got} of {self.unit} bytes")
        self._count(read=got)

    def write(self, layer: int, kind: str, buf_U8: Tensor) -> None:
        put = os.pwritev(self._fd_for(buf_U8), [memoryview(buf_U8.numpy())], self._offset(layer, kind))
        if put != self.unit:
            raise OSError(f"{self.path}: short write of layer {layer} {kind}: {put} of {self.unit} bytes")
        self._count(written=put)

    def _fd_for(self, buf_U8: Tensor) -> int:
        assert buf_U8.numel() == self.unit and buf_U8.is_contiguous()
        direct = self.direct and buf_U8.data_ptr() % DIRECT_ALIGN == 0
        return self._direct_fd if direct else self._fd

    def _offset(self, layer: int, kind: str) -> int:
        return (layer * len(KINDS) + KINDS.index(kind)) * self.unit

    def _count(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.bytes_read += read
            self.bytes_written += written
