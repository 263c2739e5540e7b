"""Live expert re-placement and shadow experts on a running expert-parallel group.

The expert weights keep their DTensor layout (``Shard(0)`` over ``ep``), but row ``s`` of the stacked
tensors now means *slot* ``s``, and each layer's dispatcher holds the ``ExpertPlacement`` saying
which expert runs in which slot. Checkpoints stay canonical (row e = expert e) without moving
anything: ``moved_layers`` tells the checkpoint writer which rows hold which experts, and it writes
(and reads) each expert at its canonical offset (``run/sharded.py``). Every rank sees the same
per-expert loads (summed over the batch ranks), so every rank reaches the same decision from
``parallel/placement.py`` without a message of its own.

Re-placing moves each moved expert's weights and AdamW moments (``exp_avg``, ``exp_avg_sq``) to its new
slot in one all-to-all per layer, between steps; what each expert computes is unchanged. Shadow
experts are copies of the owner's weights broadcast after every optimizer step; the rows routed to
them are computed where they are, and their gradients are summed over the ep group into the owner's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moekit.config import ParallelConfig
from moekit.dispatch.all_to_all import AllToAllDispatcher, ExpertPlacement
from moekit.dispatch.dedup import DedupDispatcher
from moekit.experts.grouped import expert_ffn, local_tensor
from moekit.layer import MoE
from moekit.parallel.placement import choose_shadows, imbalance, migration, place_experts, rank_loads

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state that follows an expert


@dataclass
class _Layer:
    moe: MoE
    window: Tensor | None = None  # loads summed since the last check
    shadow_weights: list[Tensor] = field(default_factory=list)  # [S, ...] copies of w_in and w_out

    @property
    def dispatcher(self) -> AllToAllDispatcher:
        """The re-placeable dispatcher (the layout refuses ``placement_every`` with the deduplicated one)."""
        assert isinstance(self.moe.dispatcher, AllToAllDispatcher)
        return self.moe.dispatcher

    @property
    def placement(self) -> ExpertPlacement:
        assert isinstance(self.moe.dispatcher, AllToAllDispatcher | DedupDispatcher)
        return self.moe.dispatcher.placement

    @property
    def slots(self) -> tuple[int, ...]:
        return self.placement.expert_to_slot

    @property
    def shadows(self) -> tuple[int, ...]:
        return self.placement.shadows


class Rebalancer:
    """Keeps each MoE layer's experts where the measured load says they should run."""

    def __init__(self, moe_layers: list[MoE], group: dist.ProcessGroup, cfg: ParallelConfig):
        self.layers = [_Layer(moe) for moe in moe_layers]
        self.group, self.cfg = group, cfg
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.steps_in_window = 0

    # --- what the training step calls ---------------------------------------------------------------

    @torch.no_grad()
    def after_step(self, step: int, loads: list[Tensor], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """After the optimizer step: metrics of the step just run, then (every ``placement_every``
        steps) re-place and choose shadows from the window's loads, then refresh the shadows."""
        started = time.perf_counter()
        per_rank = [0.0] * self.world
        factors = []
        for layer in self.layers:
            load = loads[layer.moe.index].double()
            layer.window = load if layer.window is None else layer.window + load
            rows = rank_loads(load.tolist(), layer.slots, self.world, layer.shadows)
            per_rank = [a + b for a, b in zip(per_rank, rows, strict=True)]
            factors.append(imbalance(rows))
        self.steps_in_window += 1
        moved_bytes, moves = 0, 0
        every = self.cfg.placement_every
        if every and (step + 1) % every == 0:
            for layer in self.layers:
                n, nbytes = self._check(layer, optimizer)
                moves, moved_bytes = moves + n, moved_bytes + nbytes
            self.steps_in_window = 0
        moved_bytes += self.refresh_shadows()
        return {
            "rank_load": per_rank,
            "rank_imbalance": sum(factors) / len(factors),
            "placement_moves": moves,
            "placement_bytes": moved_bytes,
            "placement_s": time.perf_counter() - started,
            "shadow_experts": sum(len(layer.shadows) for layer in self.layers),
        }

    def _check(self, layer: _Layer, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
        """Re-place one layer if the predicted gain is worth it; then choose its shadows."""
        assert layer.window is not None
        window = layer.window.tolist()
        layer.window = None
        moves, nbytes = 0, 0
        proposal = place_experts(window, self.world, layer.slots, self.cfg.placement_max_moves)
        if proposal.moves and proposal.gain >= self.cfg.placement_min_gain:
            nbytes = self.move(layer.moe, proposal.expert_to_slot, optimizer)
            moves = proposal.moves
        if self.cfg.shadow_experts:
            per_step = [x / max(1, self.steps_in_window) for x in window]
            experts = layer.moe.experts
            token_bytes = experts.w_in.shape[1] * experts.w_in.element_size()
            expert_bytes = sum(local_tensor(p)[0].numel() * p.element_size() for p in experts.parameters())
            choice = choose_shadows(
                per_step, layer.slots, self.world, token_bytes, expert_bytes, self.cfg.shadow_experts
            )
            self.set_shadows(layer.moe, choice.experts)
        return moves, nbytes

    @torch.no_grad()
    def move(self, moe: MoE, new_slots: tuple[int, ...], optimizer: torch.optim.Optimizer | None) -> int:
        """Move one layer's experts (weights and AdamW moments) to ``new_slots``; returns bytes sent to
        other ranks by the whole group. A collective: every rank of the ep group calls it with the same slots."""
        layer = self._layer(moe)
        old = layer.slots
        tensors = []
        for p in moe.experts.parameters():
            tensors.append(local_tensor(p))
            state = optimizer.state.get(p, {}) if optimizer is not None else {}
            tensors += [local_tensor(state[k]) for k in MOMENTS if k in state]
        El = tensors[0].shape[0]
        rows, send, recv, land = migration(old, new_slots, self.world, self.rank)
        flat = torch.cat([t.reshape(El, -1) for t in tensors], dim=1)
        out = flat.new_empty(sum(recv), flat.shape[1])
        dist.all_to_all_single(out, flat[rows].contiguous(), recv, send, group=self.group)
        flat[land] = out
        for t, part in zip(tensors, flat.split([t[0].numel() for t in tensors], dim=1), strict=True):
            t.copy_(part.view_as(t))
        layer.dispatcher.place(ExpertPlacement(new_slots, layer.shadows, self._shadow_fn(layer)))
        moved = sum(a // El != b // El for a, b in zip(old, new_slots, strict=True))
        return moved * flat.shape[1] * flat.element_size()

    def set_shadows(self, moe: MoE, experts: tuple[int, ...]) -> None:
        """Replicate ``experts`` on every rank from the next forward on (refreshed by ``refresh_shadows``)."""
        layer = self._layer(moe)
        layer.shadow_weights = [
            torch.zeros(len(experts), *local_tensor(p).shape[1:], dtype=p.dtype, device=p.device, requires_grad=True)
            for p in moe.experts.parameters()
            if experts
        ]
        layer.dispatcher.place(ExpertPlacement(layer.slots, experts, self._shadow_fn(layer)))

    @torch.no_grad()
    def refresh_shadows(self) -> int:
        """Every shadow copy <- its owner's current weights (a broadcast each); returns bytes received by
        the whole group."""
        nbytes = 0
        for layer in self.layers:
            El = local_tensor(layer.moe.experts.w_in).shape[0]
            for i, e in enumerate(layer.shadows):
                slot = layer.slots[e]
                owner = slot // El
                for p, copy in zip(layer.moe.experts.parameters(), layer.shadow_weights, strict=True):
                    buf = local_tensor(p)[slot - owner * El].clone() if owner == self.rank else copy[i].detach()
                    dist.broadcast(buf, group_src=owner, group=self.group)
                    copy[i].copy_(buf)
                    nbytes += (self.world - 1) * buf.numel() * buf.element_size()
        return nbytes

    @torch.no_grad()
    def finish_shadow_grads(self) -> None:
        """Sum the shadows' gradients over the ep group into their owners' expert gradients."""
        for layer in self.layers:
            if not layer.shadows:
                continue
            El = local_tensor(layer.moe.experts.w_in).shape[0]
            grads = [torch.zeros_like(w) if w.grad is None else w.grad for w in layer.shadow_weights]
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat, group=self.group)
            for p, g in zip(layer.moe.experts.parameters(), flat.split([g.numel() for g in grads]), strict=True):
                assert p.grad is not None, "the exchange path gives every local expert a gradient"
                g = g.view(len(layer.shadows), *p.shape[1:])
                for i, e in enumerate(layer.shadows):
                    slot = layer.slots[e]
                    if slot // El == self.rank:
                        local_tensor(p.grad)[slot - self.rank * El] += g[i]
            for w in layer.shadow_weights:
                w.grad = None

    def moved_layers(self) -> dict[MoE, tuple[int, ...]]:
        """The layers whose experts are not in their own rows, with their ``expert_to_slot``."""
        return {layer.moe: layer.slots for layer in self.layers if layer.slots != tuple(range(len(layer.slots)))}

    # --- helpers ------------------------------------------------------------------------------------

    def _layer(self, moe: MoE) -> _Layer:
        return next(layer for layer in self.layers if layer.moe is moe)

    @staticmethod
    def _shadow_fn(layer: _Layer):
        if not layer.shadow_weights:
            return None
        experts = layer.moe.experts
        w_in, w_out = layer.shadow_weights

        def compute(x_RD: Tensor, counts: Tensor) -> Tensor:
            return expert_ffn(x_RD, w_in, w_out, counts, experts.activation, experts.gemm)

        return compute
