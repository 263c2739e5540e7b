"""Models in and out of moekit: Hugging Face checkpoints (hf.py over hf_config.py, keymap.py and
safetensors_dir.py) and dense-to-MoE upcycling (upcycle.py)."""

from moekit.convert.hf import from_hf, to_hf
from moekit.convert.hf_config import ConversionError

__all__ = ["ConversionError", "from_hf", "to_hf"]
