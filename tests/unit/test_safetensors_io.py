"""Reading one tensor of a safetensors file into another layout (``copy_tensor``) against the safetensors
library's own reader, where the map can view the range in place and where it cannot (an offset that is
not a multiple of the element size, which the format allows)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moekit.run.layout import CheckpointError
from moekit.run.safetensors_io import copy_tensor, read_header


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file with the tensors packed back to back, no padding between them."""
    header, data, offset = {}, b"", 0
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.uint8: "U8"}
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the header padded, the tensors not
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


@pytest.mark.parametrize("lead", [0, 3])
def test_a_tensor_copied_into_another_layout_equals_the_librarys(tmp_path: Path, lead: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(4, 6, 8)
    file = tmp_path / "t.safetensors"
    _write(file, {"a_lead": torch.arange(lead, dtype=torch.uint8), "w": w, "wb": w.bfloat16()})
    entries = read_header(file)
    assert entries["w"].begin % 4 == lead % 4, "the second case's float32 range is not 4-byte aligned"
    stored = load_file(str(file))
    for name in ("w", "wb"):
        target = torch.empty(4, 8, 6, dtype=torch.float32).transpose(1, 2)  # another layout and dtype
        copy_tensor(file, entries[name], target)
        assert torch.equal(target, stored[name].float()), name


def test_a_cut_file_names_the_tensor(tmp_path: Path) -> None:
    file = tmp_path / "t.safetensors"
    _write(file, {"w": torch.randn(64)})
    entry = read_header(file)["w"]
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated: tensor 'w' ends past the file's end"):
        copy_tensor(file, entry, torch.empty(64))
