"""Safetensors files read and written one tensor at a time, so that a checkpoint of any size passes
through a bounded amount of memory.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape
and ``[begin, end)`` byte range in the data that follows), then the data. ``read_header`` checks every
entry against the file's size (a truncated shard is named before any data is read); ``read_tensor``
reads one tensor with ``os.pread`` into a fresh tensor (or into place); ``copy_tensor`` copies one into
any tensor. NOTE: never a map of the whole file: the pages of a mapped file that were
touched stay in the process's resident set until it is unmapped, so reading a whole checkpoint through
``safe_open`` holds all of it resident; ``copy_tensor`` maps one tensor's range and unmaps it at once.
``StreamWriter`` writes the header first, from the names, dtypes and shapes alone, then each tensor's
bytes in order (a tensor may arrive in pieces, one expert at a time), hashing them as they pass: the
manifest's SHA-256 without a second read.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moekit.fileio import fsync_file
from moekit.run.layout import CheckpointError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # what the safetensors library itself accepts
_READ_CHUNK = 1 << 30  # one pread moves at most ~2 GiB on Linux


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: absolute byte range ``[begin, end)``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def read_header(path: Path, check_size: bool = True) -> dict[str, Entry]:
    """Every tensor of a safetensors file, its range checked against the file's size (unless
    ``check_size`` is False: a reader that checks each range itself names what a cut loses)."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a readable safetensors file ({why})")

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, shorter than its header")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, size - 8):
                raise bad(f"header length {length} exceeds the file's {size} bytes")
            header = json.loads(f.read(length))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad(str(err)) from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    start = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has no valid dtype, shape and data_offsets: {info!r:.120}") from None
        if end - begin != nbytes(dtype, shape):
            needs = nbytes(dtype, shape)
            raise bad(f"tensor {name!r} spans {end - begin} bytes, its shape {list(shape)} needs {needs}")
        if check_size and start + end > size:
            raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {start + end}, the file has {size}")
        entries[name] = Entry(name, dtype, shape, start + begin, start + end)
    return entries


def rows(entry: Entry, start: int, stop: int) -> Entry:
    """Rows ``[start, stop)`` of ``entry``'s leading dim (contiguous bytes) as an entry of their own: one
    rank's experts of a stacked weight, read without the rest."""
    assert 0 <= start <= stop <= entry.shape[0], (entry.name, start, stop, entry.shape)
    row = nbytes(entry.dtype, entry.shape[1:])
    return Entry(
        entry.name, entry.dtype, (stop - start, *entry.shape[1:]), entry.begin + start * row, entry.begin + stop * row
    )


def read_tensor(path: Path, entry: Entry, out: Tensor | None = None) -> Tensor:
    """Tensor ``entry`` of the file at ``path``, read into memory of its own (no map of the file), or into
    ``out`` (a contiguous CPU tensor of its dtype and shape)."""
    if out is None:
        out = torch.empty(entry.shape, dtype=entry.dtype)
    assert out.dtype == entry.dtype and out.is_contiguous() and tuple(out.shape) == tuple(entry.shape)
    buffer = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(buffer):
            got = os.preadv(f.fileno(), [buffer[done : done + _READ_CHUNK]], entry.begin + done)
            if got <= 0:
                raise CheckpointError(f"{path}: truncated: tensor {entry.name!r} ends past the file's end")
            done += got
    return out


def copy_tensor(path: Path, entry: Entry, target: Tensor) -> None:
    """``target.copy_`` of tensor ``entry`` of the file at ``path`` (any layout, dtype or device), in one
    pass over the file's pages: read straight into a contiguous CPU target of its dtype, else through a
    map of its range alone, unmapped before returning (a read into a fresh tensor, then a copy, is two
    passes: a d1024 checkpoint's experts, laid out anew, loaded 0.3 s slower that way). A range the map
    cannot view in its dtype (an offset not a multiple of the element size, which the format allows) or
    a file that cannot be mapped is read, then copied."""
    if target.dtype == entry.dtype and target.is_contiguous() and target.device.type == "cpu":
        read_tensor(path, entry, out=target.detach())
        return
    if entry.end > os.path.getsize(path):
        raise CheckpointError(f"{path}: truncated: tensor {entry.name!r} ends past the file's end")
    if entry.end == entry.begin:
        return
    start = entry.begin - entry.begin % mmap.ALLOCATIONGRANULARITY
    if (entry.begin - start) % torch.empty((), dtype=entry.dtype).element_size():
        target.copy_(read_tensor(path, entry))
        return
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), entry.end - start, access=mmap.ACCESS_COPY, offset=start)
    except OSError:
        target.copy_(read_tensor(path, entry))
        return
    with mapped:
        raw = torch.frombuffer(mapped, dtype=torch.uint8)
        try:
            with torch.no_grad():
                target.copy_(raw[entry.begin - start :].view(entry.dtype).view(entry.shape))
        finally:
            del raw  # no view of the map may outlive it, not even in a traceback's frame


class StreamWriter:
    """A safetensors file written tensor by tensor, in the order its entries were declared.

    ``entries`` (name, dtype, shape) fix the header, so nothing needs to be in memory but the piece
    being written; ``write`` takes a tensor whole or in leading pieces (rows, or experts of a stacked
    tensor) and ``close`` returns the file's (size, SHA-256) after an fsync.
    """

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        self._todo: list[tuple[str, torch.dtype, int]] = []
        offset = 0
        for name, dtype, shape in entries:
            size = nbytes(dtype, shape)
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._todo.append((name, dtype, size))
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the library writes it
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed in close())
        self._sha = hashlib.sha256()
        self._next = 0
        self._left = self._todo[0][2] if self._todo else 0
        self._put(struct.pack("<Q", len(text)) + text)

    def _put(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._sha.update(data)

    def write(self, name: str, piece: Tensor) -> None:
        """The next bytes of tensor ``name`` (the one due): ``piece`` in its declared dtype."""
        due, dtype, _ = self._todo[self._next]
        assert name == due and piece.dtype == dtype, f"writing {name} {piece.dtype}, due {due} {dtype}"
        data = memoryview(piece.contiguous().view(-1).view(torch.uint8).numpy()) if piece.numel() else b""
        assert len(data) <= self._left, f"{name}: {len(data)} bytes, {self._left} left"
        self._put(data)
        self._left -= len(data)
        if self._left == 0:  # tensor done (an empty one by its empty write): the next is due
            self._next += 1
            self._left = self._todo[self._next][2] if self._next < len(self._todo) else 0

    def close(self) -> tuple[int, str]:
        """Finish the file: (bytes, SHA-256), flushed to disk."""
        assert self._next == len(self._todo), f"{self._todo[self._next][0]} was never written"
        self._file.close()
        fsync_file(self.path)
        return self.path.stat().st_size, self._sha.hexdigest()

    def abort(self) -> None:
        self._file.close()
