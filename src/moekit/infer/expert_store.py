"""The slow tier: expert weights read one expert at a time, by byte range, from a safetensors file.

A checkpoint stores each MoE block's experts stacked (``blocks.{i}.ffn.experts.w_in [E, D, W]``), so
expert e of a stacked tensor is one contiguous byte range: ``offset + e * bytes_per_expert``. The
store reads exactly the ranges of the experts asked for (``os.preadv`` into the destination's own
memory, no intermediate copy), never a whole layer. Quantized stores (``moekit.infer.quant``) use the
same stacked layout with other tensor names, so one reader serves both.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

Key = tuple[int, int]  # (block index, expert index)

SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "U8": torch.uint8,
}
_ALIGN = 64  # slot offsets of each piece: aligned for any dtype view and for SIMD loads


class ExpertStoreError(RuntimeError):
    """An expert file is unreadable, truncated or does not match the model; the message names it."""


@dataclass(frozen=True)
class Piece:
    """One tensor of one expert: where it is in the file and where it goes in a cache slot."""

    name: str  # role inside the expert: "w_in", "w_out", "w_in.q", "w_in.scale", ...
    file_offset: int  # absolute byte offset in the file
    slot_offset: int  # byte offset inside the expert's cache slot
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the byte offset where its data begins."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExpertStoreError(f"{path}: not a readable safetensors file ({err})") from None
    return header, 8 + length


def expert_tensor_prefix(block: int) -> str:
    return f"blocks.{block}.ffn.experts."


class ExpertStore:
    """Experts of every MoE block in one safetensors file, each readable on its own.

    ``roles`` names the stacked tensors of a block (``w_in``, ``w_out`` for full precision; the
    quantized forms add ``.q`` / ``.scale``). Every expert occupies ``slot_bytes`` in the fast tier.
    ``drop_pages`` evicts each range from the OS page cache right after reading it, so the page
    cache cannot act as a hidden fast tier (benchmarks measure the disk, not RAM).
    """

    def __init__(self, path: Path, blocks: dict[int, int], roles: tuple[str, ...], drop_pages: bool = False) -> None:
        self.path = Path(path)
        self.roles = roles
        self.drop_pages = drop_pages
        header, data_start = read_safetensors_header(self.path)
        size = self.path.stat().st_size
        self.pieces: dict[Key, list[Piece]] = {}
        slot_layout: list[tuple[int, int, torch.dtype, tuple[int, ...]]] | None = None
        for block, num_experts in blocks.items():
            stacked = []
            for role in roles:
                name = expert_tensor_prefix(block) + role
                if name not in header:
                    raise ExpertStoreError(f"{self.path}: has no tensor {name!r}")
                info = header[name]
                shape = tuple(info["shape"])
                if info["dtype"] not in SAFETENSORS_DTYPES or not shape or shape[0] != num_experts:
                    raise ExpertStoreError(
                        f"{self.path}: {name} is {info['dtype']}{list(shape)}, not [{num_experts}, ...]"
                    )
                stacked.append((role, data_start + info["data_offsets"][0], SAFETENSORS_DTYPES[info["dtype"]], shape))
            layout = _slot_layout([(dtype, shape[1:]) for _, _, dtype, shape in stacked])
            if slot_layout is None:
                slot_layout = layout
            elif layout != slot_layout:
                raise ExpertStoreError(f"{self.path}: experts of block {block} differ in size from earlier blocks")
            for e in range(num_experts):
                pieces = []
                for (role, start, dtype, shape), (slot_offset, nbytes, _, _) in zip(stacked, layout, strict=True):
                    pieces.append(Piece(role, start + e * nbytes, slot_offset, nbytes, dtype, shape[1:]))
                if max(p.file_offset + p.nbytes for p in pieces) > size:
                    raise ExpertStoreError(
                        f"{self.path}: truncated: expert {e} of block {block} ends past the file's {size} bytes"
                    )
                self.pieces[(block, e)] = pieces
        if slot_layout is None:
            raise ExpertStoreError(f"{self.path}: the model has no MoE blocks to offload")
        last = slot_layout[-1]
        self.slot_bytes = _round_up(last[0] + last[1], _ALIGN)
        self.bytes_per_expert = sum(nbytes for _, nbytes, _, _ in slot_layout)  # bytes read per load
        self._slot_pieces = next(iter(self.pieces.values()))  # the slot layout, shared by every expert
        self._fd = os.open(self.path, os.O_RDONLY)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_into(self, key: Key, slot_U8: Tensor) -> int:
        """Read expert ``key`` into ``slot_U8`` (a CPU uint8 tensor of ``slot_bytes``); bytes read."""
        total = 0
        for p in self.pieces[key]:
            view = memoryview(slot_U8[p.slot_offset : p.slot_offset + p.nbytes].numpy())
            got = os.preadv(self._fd, [view], p.file_offset)
            if got != p.nbytes:
                block, expert = key
                raise ExpertStoreError(
                    f"{self.path}: truncated: expert {expert} of block {block} ({p.name}): "
                    f"read {got} of {p.nbytes} bytes"
                )
            if self.drop_pages:
                os.posix_fadvise(self._fd, p.file_offset, p.nbytes, os.POSIX_FADV_DONTNEED)
            total += got
        return total

    def drop_page_cache(self) -> None:
        """Evict the whole file from the OS page cache (a cold start for the next reads)."""
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def views(self, slot_U8: Tensor) -> dict[str, Tensor]:
        """The tensors of one expert inside its slot, by role (views, no copy)."""
        return {
            p.name: slot_U8[p.slot_offset : p.slot_offset + p.nbytes].view(p.dtype).view(p.shape)
            for p in self._slot_pieces
        }


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _slot_layout(
    parts: list[tuple[torch.dtype, tuple[int, ...]]],
) -> list[tuple[int, int, torch.dtype, tuple[int, ...]]]:
    """(slot offset, bytes, dtype, shape) of each piece of one expert, each aligned to ``_ALIGN``."""
    layout, offset = [], 0
    for dtype, shape in parts:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        layout.append((offset, nbytes, dtype, shape))
        offset = _round_up(offset + nbytes, _ALIGN)
    return layout
