"""One safetensors file from a sharded checkpoint, written as it is read: one block's weights in
memory at a time, so a model larger than memory can still be consolidated on one process.

The file is what ``safetensors`` writes (a JSON header of names, dtypes, shapes and byte offsets, then
the raw tensors), so inference, the offloaded experts' byte-range reads and ``train --init`` use it
as they use any checkpoint's ``model.safetensors``.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import IO

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moekit.fileio import write_atomic
from moekit.run.sharded import MODEL_PREFIX, model_groups, read_metadata, read_weights

DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _header(metadata, keys: list[str]) -> bytes:
    """The safetensors header for ``keys`` in this order, padded to 8 bytes as the format asks."""
    entries: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in keys:
        meta = metadata.state_dict_metadata[MODEL_PREFIX + key]
        assert isinstance(meta, TensorStorageMetadata)
        size = math.prod(meta.size) * meta.properties.dtype.itemsize
        entries[key] = {
            "dtype": DTYPES[meta.properties.dtype],
            "shape": list(meta.size),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def consolidate(sharded_dir: Path, out_file: Path) -> None:
    """Write the weights of the DCP checkpoint ``sharded_dir`` into ``out_file`` (atomically)."""
    metadata = read_metadata(sharded_dir)
    groups = model_groups(metadata)
    header = _header(metadata, [key for group in groups for key in group])

    def write(f: IO[bytes]) -> None:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for group in groups:
            weights = read_weights(sharded_dir, metadata, group)
            for key in group:
                f.write(weights[key].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    write_atomic(out_file, write)
