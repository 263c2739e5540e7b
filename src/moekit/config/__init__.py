"""Configuration dataclasses: one per component, each field with its one-line reason and its valid values
in the field's metadata (``fields.option``).

Validation happens in ``__post_init__`` so a bad value fails with a ``ValueError`` that names the
field, before any tensor is built.
"""

from moekit.config.model import ModelConfig
from moekit.config.moe import GEMM_BACKENDS, ROUTERS, TOKEN_CHOICE_ROUTERS, MoEConfig
from moekit.config.parallel import ParallelConfig
from moekit.config.train import DataConfig, TrainConfig

__all__ = [
    "GEMM_BACKENDS",
    "ROUTERS",
    "TOKEN_CHOICE_ROUTERS",
    "DataConfig",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "TrainConfig",
]
