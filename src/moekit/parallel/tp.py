"""Tensor parallelism for attention and dense MLPs with ``torch.distributed.tensor.parallel``.

Megatron's split: the fused qkv projection and the MLP's input projections by rows (column-wise
parallel, each rank whole key/value groups or a slice of the hidden width), the output projections by
columns (row-wise parallel, one all-reduce per sub-layer). Norms, embeddings, routers and routed
experts stay whole on every tp rank. Dropout masks would differ between tp ranks: use dropout 0.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from moekit.experts import DenseFFN
from moekit.model.transformer import Attention


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard every attention and dense MLP (incl. shared experts) of ``model`` over ``tp_mesh``."""
    if tp_mesh.size() == 1:
        return
    for module in model.modules():
        if isinstance(module, Attention):
            parallelize_module(module, tp_mesh, {"qkv": ColwiseParallel(), "out": RowwiseParallel()})
        elif isinstance(module, DenseFFN):
            plan = {"w_in": ColwiseParallel(), "w_out": RowwiseParallel()}
            if module.w_gate is not None:
                plan["w_gate"] = ColwiseParallel()
            parallelize_module(module, tp_mesh, plan)
