"""The naive offload ``benchmarks/offload.py`` compares against (Accelerate's way): every call of a layer
brings all of its experts in, from the file or from pinned host memory, computes, and forgets them."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moekit.experts.grouped import Activation, apply_activation
from moekit.infer.expert_store import ExpertStore
from moekit.infer.quant import matmul
from moekit.storage.host import HostTier


class NaiveLayerExperts(nn.Module):
    """Accelerate-style offload: every call reads all of its layer's experts, computes, forgets them."""

    def __init__(self, store: ExpertStore, block: int, buffer_ES: Tensor, activation: Activation) -> None:
        super().__init__()
        self.store, self.block, self.activation = store, block, activation
        self.buffer = buffer_ES  # room for every expert of the layer, one store.slot_bytes row each
        self.bytes_read = 0

    def fetch(self) -> int:
        """Bring every expert of the layer into the buffer: here, read from the store's file."""
        return sum(self.store.read_into((self.block, e), self.buffer[e]) for e in range(self.buffer.shape[0]))

    def forward(self, x_RD: Tensor, tokens_per_expert: Tensor) -> Tensor:
        counts = tokens_per_expert.tolist()  # first: on a GPU, waiting for it does not wait for the fetch
        self.bytes_read += self.fetch()
        y_RD, start = torch.empty_like(x_RD), 0
        for e, n in enumerate(counts):
            if n:
                views = self.store.views((self.block, e), self.buffer[e])
                h = apply_activation(matmul("fp", views, "w_in", x_RD[start : start + n]), self.activation)
                y_RD[start : start + n] = matmul("fp", views, "w_out", h)
            start += n
        return y_RD


class NaiveCopiedLayerExperts(NaiveLayerExperts):
    """The same on a GPU: every call copies all of its layer's experts from pinned host memory, as one
    copy of their contiguous block, queued on the compute stream so the layer's matmuls wait for it
    (and the next layer's copy into the shared buffer waits for them)."""

    def __init__(self, store: ExpertStore, block: int, host_ES: Tensor, buffer_ES: Tensor, activation: Activation):
        super().__init__(store, block, buffer_ES, activation)
        self.host = host_ES

    def fetch(self) -> int:
        self.buffer.copy_(self.host, non_blocking=True)
        return self.host.shape[0] * self.store.bytes_per_expert  # the bytes of the tensors, as a read counts


def pinned_layer(pinned: HostTier, block: int, num_experts: int) -> Tensor:
    """The layer's experts in the pinned host copy: rows stored one after another, [E, slot_bytes]."""
    first = pinned.index[(block, 0)]
    assert [pinned.index[(block, e)] for e in range(num_experts)] == list(range(first, first + num_experts))
    return pinned.block[first : first + num_experts]
