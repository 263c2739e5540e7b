"""The slow tier read in place: each expert's tensors are byte ranges scattered over the files of another
checkpoint (a Hugging Face directory's per-expert matrices, over its shards), no converted copy made.

A role (``w_in``, ``w_out``) is one or more matrices stored ``[out, in]`` (for ``w_in``: gate, then
up): their ranges are read next to each other into the slot, which then holds ``[2F, D]``, and the role
is its transpose ``[D, 2F]``: a view, so there is no transform after the read, and the matmul is the
converted store's ``x @ w``. The ranges start anywhere in the files (after a JSON header of any
length), so reads are plain ``pread`` of exactly the tensor's bytes, not direct: a direct read of the
4 KiB-aligned superset would land each matrix at its own skew and need a copy to put gate and up side
by side (the reads row of ``benchmarks/convert.py`` measures both: plain pread was the faster).
``drop_pages`` evicts each range from the OS page cache after reading it (``storage.files.StorageFile``),
as ``ExpertStore`` does; the offloaded model sets it when direct reads were asked for, so no cached
expert pages sit beside the budget.

Legend: D model dim, F expert hidden dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moekit.infer.expert_store import ExpertStoreError, Key
from moekit.run.safetensors_io import Entry
from moekit.storage.files import StorageFile

_ALIGN = 64  # each role's place in a slot: aligned for any dtype view and for SIMD loads

Ranges = dict[str, list[tuple[Path, Entry]]]  # role -> its matrices' (file, entry), concatenated along rows


@dataclass(frozen=True)
class Range:
    """One matrix of one expert: where it is in which file and where it goes in the slot."""

    name: str  # the role it is part of
    path: Path
    file_offset: int
    slot_offset: int
    nbytes: int


@dataclass(frozen=True)
class _Role:
    slot_offset: int
    dtype: torch.dtype
    shape: tuple[int, int]  # as stored: [rows (out), in]


class RangeStore:
    """Experts read by byte range from the files that hold them, each expert a list of ranges.

    The same reading interface as ``ExpertStore`` (``pieces``, ``slot_bytes``, ``read_into``, ``views``),
    so the offloader, its loaders and its cache serve it unchanged.
    """

    direct = False  # see the module docstring

    def __init__(self, experts: dict[Key, Ranges], drop_pages: bool = False) -> None:
        if not experts:
            raise ExpertStoreError("the model has no MoE blocks to offload")
        self.drop_pages = drop_pages
        files = sorted({path for ranges in experts.values() for parts in ranges.values() for path, _ in parts})
        self.path = files[0].parent
        self._files: dict[Path, StorageFile] = {}
        try:
            for path in files:
                self._files[path] = StorageFile.open(path, direct=False, drop_pages=drop_pages)
            self._index(experts)
        except BaseException:
            self.close()
            raise

    def _index(self, experts: dict[Key, Ranges]) -> None:
        self.pieces: dict[Key, list[Range]] = {}
        self.roles: dict[str, _Role] | None = None
        sizes = {path: file.size for path, file in self._files.items()}
        for key, ranges in sorted(experts.items()):
            roles, pieces, offset = {}, [], 0
            for role, parts in ranges.items():
                dtypes = {entry.dtype for _, entry in parts}
                widths = {entry.shape[1:] for _, entry in parts}
                if len(dtypes) != 1 or len(widths) != 1 or len(next(iter(widths))) != 1:
                    raise ExpertStoreError(f"{self.path}: expert {key} {role}: matrices of one dtype and width needed")
                rows = sum(entry.shape[0] for _, entry in parts)
                roles[role] = _Role(offset, dtypes.pop(), (rows, widths.pop()[0]))
                for path, entry in parts:
                    if entry.end > sizes[path]:
                        raise ExpertStoreError(f"{path}: truncated: {entry.name} ends past its {sizes[path]} bytes")
                    pieces.append(Range(role, path, entry.begin, offset, entry.end - entry.begin))
                    offset += entry.end - entry.begin
                offset = -(-offset // _ALIGN) * _ALIGN
            if self.roles is None:
                self.roles, self.slot_bytes = roles, offset
            elif roles != self.roles:
                raise ExpertStoreError(f"{self.path}: expert {key} differs in shape or dtype from the first")
            self.pieces[key] = pieces
        self.bytes_per_expert = sum(p.nbytes for p in next(iter(self.pieces.values())))

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files = {}

    def __enter__(self) -> RangeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_into(self, key: Key, slot_U8: Tensor) -> int:
        """Read expert ``key``'s ranges into ``slot_U8`` (a CPU uint8 tensor of ``slot_bytes``); bytes read."""
        total = 0
        for p in self.pieces[key]:
            got = self._files[p.path].read(slot_U8[p.slot_offset : p.slot_offset + p.nbytes], p.file_offset)
            if got != p.nbytes:
                block, expert = key
                raise ExpertStoreError(
                    f"{p.path}: truncated: expert {expert} of block {block} ({p.name}): read {got} of {p.nbytes} bytes"
                )
            total += got
        return total

    def drop_page_cache(self) -> None:
        """Evict the files from the OS page cache (a cold start for the next reads)."""
        for file in self._files.values():
            file.evict()

    def views(self, key: Key, slot_U8: Tensor) -> dict[str, Tensor]:
        """The tensors of an expert inside its slot, by role, ``[in, out]`` (transposed views, no copy)."""
        assert self.roles is not None
        out = {}
        for role, r in self.roles.items():
            nbytes = r.shape[0] * r.shape[1] * r.dtype.itemsize
            out[role] = slot_U8[r.slot_offset : r.slot_offset + nbytes].view(r.dtype).view(r.shape).t()
        return out
