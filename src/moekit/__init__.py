"""moekit: train and serve Mixture-of-Experts language models with PyTorch.

The public names load on first use (PEP 562), so ``import moekit`` and ``moekit --help`` do not pay
for torch: ``from moekit import MoE`` imports the layer, and torch with it, when asked.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_PUBLIC = {"MoE": "moekit.layer", "MoEConfig": "moekit.config", "MoEStats": "moekit.stats"}

__all__ = ["MoE", "MoEConfig", "MoEStats", "__version__"]

if TYPE_CHECKING:
    from moekit.config import MoEConfig
    from moekit.layer import MoE
    from moekit.stats import MoEStats


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'moekit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
