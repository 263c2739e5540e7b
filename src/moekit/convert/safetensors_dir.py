"""The tensors of a Hugging Face checkpoint directory, read lazily shard by shard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import Tensor

from moekit.convert.hf_config import ConversionError


class SafetensorsDir:
    """The tensors of a Hugging Face checkpoint directory (one or many safetensors shards), read lazily."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._handles: dict[Path, Any] = {}
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as err:
                raise ConversionError(f"{index}: unreadable shard index ({err})") from None
            self.files = {key: self.path / name for key, name in weight_map.items()}
        elif (self.path / "model.safetensors").is_file():
            single = self.path / "model.safetensors"
            self.files = {key: single for key in self._handle(single).keys()}  # noqa: SIM118 (not a dict)
        else:
            raise ConversionError(
                f"{self.path}: no model.safetensors or model.safetensors.index.json (only safetensors are read)"
            )

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except Exception as err:  # safetensors raises its own error types for a damaged header
                raise ConversionError(f"{file}: unreadable safetensors file ({err})") from None
        return self._handles[file]

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def read(self, key: str) -> Tensor:
        if key not in self.files:
            raise ConversionError(f"{self.path}: tensor {key} is missing from the checkpoint")
        return self._handle(self.files[key]).get_tensor(key).float()
