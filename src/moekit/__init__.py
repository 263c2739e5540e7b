"""moekit: train and serve Mixture-of-Experts language models with PyTorch."""

from moekit.config import MoEConfig
from moekit.layer import MoE
from moekit.stats import MoEStats

__version__ = "0.1.0"

__all__ = ["MoE", "MoEConfig", "MoEStats", "__version__"]
