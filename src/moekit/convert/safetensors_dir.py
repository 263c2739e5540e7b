"""The tensors of a Hugging Face checkpoint directory, read one tensor at a time.

Every shard's header is read and checked when the directory is opened (a missing, corrupt or
truncated shard is named before anything is written); tensor data is read on demand with plain reads
(``run.safetensors_io``), so what is resident is only what the caller still holds. ``live_bytes`` and
``peak_live_bytes`` count it (each tensor handed out until it and its views are freed): the bound that
streaming conversion promises, checked by the tests.
"""

from __future__ import annotations

import json
import weakref
from collections import Counter
from pathlib import Path

import torch
from torch import Tensor

from moekit.convert.hf_config import ConversionError
from moekit.run.layout import CheckpointError
from moekit.run.safetensors_io import Entry, read_header, read_tensor

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsDir:
    """The tensors of a Hugging Face checkpoint directory (one or many safetensors shards)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = {key: self.path / name for key, name in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ConversionError(f"{index}: unreadable shard index ({err})") from None
        elif (self.path / SINGLE).is_file():
            names = None
        else:
            raise ConversionError(f"{self.path}: no {SINGLE} or {INDEX} (only safetensors are read)")
        shards = sorted(set(names.values())) if names is not None else [self.path / SINGLE]
        headers = {}
        for shard in shards:
            if not shard.is_file():
                raise ConversionError(f"{shard}: missing (named by {index.name})")
            try:
                headers[shard] = read_header(shard)
            except CheckpointError as err:
                raise ConversionError(str(err)) from None
        self.files: dict[str, Path] = names or {key: shards[0] for key in headers[shards[0]]}
        self.entries: dict[str, Entry] = {}
        for key, shard in self.files.items():
            if key not in headers[shard]:
                raise ConversionError(f"{shard}: has no tensor {key} ({index.name} places it there)")
            self.entries[key] = headers[shard][key]
        self.shard_bytes = {s: sum(e.end - e.begin for e in h.values()) for s, h in headers.items()}
        self.live_bytes = self.peak_live_bytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def _entry(self, key: str) -> Entry:
        if key not in self.files:
            raise ConversionError(f"{self.path}: tensor {key} is missing from the checkpoint")
        return self.entries[key]

    def meta(self, key: str) -> Tensor:
        """Tensor ``key`` on the meta device: its shape and dtype, no data read."""
        entry = self._entry(key)
        return torch.empty(entry.shape, dtype=entry.dtype, device="meta")

    def read(self, key: str) -> Tensor:
        """Tensor ``key`` in its stored dtype, counted in ``live_bytes`` until it is freed."""
        entry = self._entry(key)
        try:
            tensor = read_tensor(self.files[key], entry)
        except CheckpointError as err:
            raise ConversionError(str(err)) from None
        size = entry.end - entry.begin
        self.live_bytes += size
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        weakref.finalize(tensor, self._freed, size)
        return tensor

    def _freed(self, size: int) -> None:
        self.live_bytes -= size

    def dtype(self) -> torch.dtype:
        """The floating dtype holding most of the checkpoint's bytes: the one it was saved in."""
        held = Counter[torch.dtype]()
        for entry in self.entries.values():
            if entry.dtype.is_floating_point:
                held[entry.dtype] += entry.end - entry.begin
        return held.most_common(1)[0][0] if held else torch.float32
