"""Expert FFNs and the grouped GEMM they run on."""

from moekit.experts.gemm import grouped_matmul
from moekit.experts.grouped import DenseFFN, GroupedExperts

__all__ = ["DenseFFN", "GroupedExperts", "grouped_matmul"]
