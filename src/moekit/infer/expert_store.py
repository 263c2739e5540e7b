"""The slow tier: expert weights read one expert at a time, by byte range, from a safetensors file.

A checkpoint stores each MoE block's experts stacked (``blocks.{i}.ffn.experts.w_in [E, D, W]``), so
expert e of a stacked tensor is one contiguous byte range: ``offset + e * bytes_per_expert``. The
store reads exactly the ranges of the experts asked for (``os.preadv`` into the destination's own
memory, no intermediate copy), never a whole layer. Quantized stores (``moekit.infer.quant``) use the
same stacked layout with other tensor names, so one reader serves both.

Reads go through ``storage.files.StorageFile``: direct (``O_DIRECT``) where the filesystem allows,
so the disk writes into the slot by DMA, with no copy through the OS page cache (which costs CPU that
the experts' matmuls need) and no cached pages beside the memory budget. Direct reads start and end
on 4 KiB boundaries, so each piece of an expert gets a 4 KiB-aligned region in its slot and sits in
it at its file offset's skew; ``views`` knows where.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moekit.errors import MoekitError
from moekit.storage.aligned import DIRECT_ALIGN, round_up
from moekit.storage.files import StorageFile

Key = tuple[int, int]  # (block index, expert index)

SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "U8": torch.uint8,
}
_ALIGN = 64  # slot offsets of each piece: aligned for any dtype view and for SIMD loads


class ExpertStoreError(MoekitError):
    """An expert file is unreadable, truncated or does not match the model; the message names it."""


@dataclass(frozen=True)
class Piece:
    """One tensor of one expert: where it is in the file and where it goes in a cache slot."""

    name: str  # role inside the expert: "w_in", "w_out", "w_in.q", "w_in.scale", ...
    file_offset: int  # absolute byte offset in the file
    slot_offset: int  # byte offset of the tensor inside the expert's cache slot
    nbytes: int
    skew: int  # direct reads: bytes read before the tensor (file_offset % 4096), else 0
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
    ``direct`` reads with ``O_DIRECT`` where the filesystem supports it (``self.direct`` says whether it
    does). Buffered reads go through the page cache; ``drop_pages`` then evicts each range right after
    reading it, so the page cache cannot act as a hidden fast tier (benchmarks measure the disk, not RAM).
    """

    def __init__(
        self,
        path: Path,
        blocks: dict[int, int],
        roles: tuple[str, ...],
        drop_pages: bool = False,
        direct: bool = True,
    ) -> None:
        self.path = Path(path)
        self.roles = roles
        self.drop_pages = drop_pages
        header, data_start = read_safetensors_header(self.path)
        self.file = StorageFile.open(self.path, direct, drop_pages)
        self.direct = self.file.direct
        try:
            layout = self._index(header, data_start, blocks)
        except BaseException:
            self.close()
            raise
        last = layout[-1]
        self.slot_bytes = round_up(last[0] + _region_bytes(last[1], self.direct), _ALIGN)
        self.bytes_per_expert = sum(nbytes for _, nbytes, _, _ in layout)  # bytes of the tensors per load

    def _index(self, header: dict, data_start: int, blocks: dict[int, int]) -> list[tuple]:
        """Fill ``self.pieces`` (every expert's tensors: file range and slot place); the slot layout."""
        size = self.path.stat().st_size
        self.pieces: dict[Key, list[Piece]] = {}
        slot_layout: list[tuple[int, int, torch.dtype, tuple[int, ...]]] | None = None
        for block, num_experts in blocks.items():
            stacked = []
            for role in self.roles:
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
            layout = _slot_layout([(dtype, shape[1:]) for _, _, dtype, shape in stacked], self.direct)
            if slot_layout is None:
                slot_layout = layout
            elif layout != slot_layout:
                raise ExpertStoreError(f"{self.path}: experts of block {block} differ in size from earlier blocks")
            for e in range(num_experts):
                pieces = []
                for (role, start, dtype, shape), (region, nbytes, _, _) in zip(stacked, layout, strict=True):
                    offset = start + e * nbytes
                    skew = offset % DIRECT_ALIGN if self.direct else 0
                    pieces.append(Piece(role, offset, region + skew, nbytes, skew, dtype, shape[1:]))
                if max(p.file_offset + p.nbytes for p in pieces) > size:
                    raise ExpertStoreError(
                        f"{self.path}: truncated: expert {e} of block {block} ends past the file's {size} bytes"
                    )
                self.pieces[(block, e)] = pieces
        if slot_layout is None:
            raise ExpertStoreError(f"{self.path}: the model has no MoE blocks to offload")
        return slot_layout

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_into(self, key: Key, slot_U8: Tensor) -> int:
        """Read expert ``key`` into ``slot_U8`` (a CPU uint8 tensor of ``slot_bytes``); bytes of its tensors.

        Direct when the store is and the slot starts on a 4 KiB boundary (``aligned_empty``), else buffered.
        """
        direct = self.direct and slot_U8.data_ptr() % DIRECT_ALIGN == 0
        total = 0
        for p in self.pieces[key]:
            if direct:  # whole 4 KiB blocks around the tensor, which lands at its skew
                start = p.slot_offset - p.skew
                length = round_up(p.skew + p.nbytes, DIRECT_ALIGN)
                got = min(self.file.read(slot_U8[start : start + length], p.file_offset - p.skew) - p.skew, p.nbytes)
            else:
                got = self.file.read(slot_U8[p.slot_offset : p.slot_offset + p.nbytes], p.file_offset)
            if got != p.nbytes:
                block, expert = key
                raise ExpertStoreError(
                    f"{self.path}: truncated: expert {expert} of block {block} ({p.name}): "
                    f"read {max(got, 0)} of {p.nbytes} bytes"
                )
            total += got
        return total

    def drop_page_cache(self) -> None:
        """Evict the whole file from the OS page cache (a cold start for the next reads)."""
        self.file.evict()

    def views(self, key: Key, slot_U8: Tensor) -> dict[str, Tensor]:
        """The tensors of expert ``key`` inside its slot, by role (views, no copy)."""
        return {
            p.name: slot_U8[p.slot_offset : p.slot_offset + p.nbytes].view(p.dtype).view(p.shape)
            for p in self.pieces[key]
        }


def _region_bytes(nbytes: int, direct: bool) -> int:
    """Room for one tensor in a slot; direct reads need its skew and whole 4 KiB blocks around it."""
    return round_up(nbytes, DIRECT_ALIGN) + DIRECT_ALIGN if direct else nbytes


def _slot_layout(
    parts: list[tuple[torch.dtype, tuple[int, ...]]], direct: bool
) -> list[tuple[int, int, torch.dtype, tuple[int, ...]]]:
    """(region offset, bytes, dtype, shape) of each tensor of one expert in its slot."""
    layout, offset = [], 0
    align = DIRECT_ALIGN if direct else _ALIGN
    for dtype, shape in parts:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        layout.append((offset, nbytes, dtype, shape))
        offset = round_up(offset + _region_bytes(nbytes, direct), align)
    return layout
