"""Training beyond memory: the experts' weights and AdamW state on disk, a budgeted working set in RAM.

Per optimizer step (on CPU, in each process: its own ep shard of every layer's experts, in its own file):

1. forward: each MoE layer reads its weights from its slot while the next layer's are read;
2. backward, in reverse: each layer's weights are read again (or still resident), the lower layer's
   meanwhile, only the experts that computed rows in the forward (``WorkingSet.route``: the rest
   is read when a forward next needs the layer whole, if it is still resident then); as soon as a
   layer's backward is done, its gradients (summed over the step's micro-batches) are reduced over
   the ranks as in-memory training reduces them (``reduce.py``: one fused all-reduce per layer,
   overlapping the backward of the layer below), then go to disk and their norms are kept. The
   routing already computed says which experts can skip that: an expert that received no token in
   any of the step's micro-batches on any rank of its dp group has an exactly-zero gradient, so its
   gradient's pages are neither written nor read back (those it shares with a busy expert move; the
   rows per expert are summed over dp at the end of the bucket: idle here is not idle everywhere);
   between micro-batches, the running sum of an expert idle so far on this rank is likewise kept off
   the disk. The AdamW step reads such a gradient as
   zeros and still updates the expert (its moments decay, its weights move), and its zero adds
   nothing to the norm;
3. the global gradient norm combines those norms with the rest of the model's, by replica group, in
   the parameter order and precision of ``clip_grad_norm``, so the clipping factor is the in-memory
   one, bit for bit;
4. the AdamW step of the experts is recorded, not run (``adamw.py``): the clipping factor, each
   parameter group's hyperparameters and the step counts as the step has them, so that a learning
   rate set for the next step changes nothing. The first layer's gradient and moments are read;
5. the next forward (or an evaluation, or anything that runs the experts) updates each layer as it
   reaches it, on the slot it computes from: the layer's weights are read once for both, the new
   weights and moments are written behind, and the next layer's gradient, moments and weights are read
   while this one computes. A forward reads a layer's weights whole: they are read ahead, before
   the layer's router has run, so no routing is known to narrow the read (and the AdamW step that
   runs on them moves every expert's weights, idle or not). The arithmetic is ``torch.optim``'s
   fused AdamW on the same whole stacked tensors with the same step counts and hyperparameters, so
   the bits equal in-memory training's.
   Whatever needs the whole state (a checkpoint) first runs every pending update, in layer order.

The file starts with every layer's weights and zero moments, written as the model was built, a layer
at a time (``build.py``): the experts are never whole in RAM. Non-expert weights stay in the model and
take the ordinary optimizer step. The expert parameters are in the model and the optimizer with
their type and shape (a DTensor sharded over ep, under expert parallelism) but no storage; a
checkpoint streams them from and to the file a region at a time (``checkpoint.py``), so checkpoints,
sharded or not, are exactly those of in-memory training, load at any layout, and keep to the budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn

from moekit.experts.grouped import local_tensor
from moekit.parallel.grads import clip_scale, combine_norms, replicas
from moekit.parallel.runtime import ParallelModel
from moekit.storage.aligned import aligned_empty
from moekit.train.offload.adamw import MOMENTS, DeferredAdamW
from moekit.train.offload.experts import OffloadedExperts, install
from moekit.train.offload.reduce import LayerGradReduce
from moekit.train.offload.store import Experts, LayerFile, experts_with_rows
from moekit.train.offload.working_set import WorkingSet
from moekit.units import format_bytes, parse_bytes

SCRATCH = 2 * len(MOMENTS)  # RAM regions for gradients in backward, then the AdamW step double-buffered
MIN_REGIONS = SCRATCH + 2  # and two weight slots: one computes while the next is read


def regions_in_budget(budget: str, unit: int) -> int:
    """How many regions of ``unit`` bytes ``budget`` (``train.memory_budget``) holds; too few to train is refused."""
    regions = parse_bytes(budget, "train.memory_budget") // unit
    if regions < MIN_REGIONS:
        raise ValueError(
            f"train.memory_budget={budget!r}: offloaded training needs at least {format_bytes(MIN_REGIONS * unit)} "
            f"(two layers' expert weights and {SCRATCH} of gradients and AdamW moments, {format_bytes(unit)} each)"
        )
    return regions


class ExpertOffload:
    """This rank's expert state of ``model``'s MoE layers, offloaded under ``budget`` bytes of RAM.

    ``reduce``: how each layer's gradients become in-memory training's; ``stage_ranks`` and
    ``distributed``: how the gradient norm is combined across ranks (as ``clip_grad_norm`` takes them).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        budget: str,
        file: LayerFile,
        reduce: LayerGradReduce,
        stage_ranks: int = 1,
        distributed: bool = False,
    ) -> None:
        """``file``: holds every layer's weights and zero moments (``build.ExpertWriter``); the expert
        parameters have no storage."""
        layers = model.moe_layers()
        shapes = file.shapes
        for moe in layers:
            for name, p in moe.experts.named_parameters(recurse=False):
                local = local_tensor(p)
                assert p.dtype == torch.float32 and tuple(local.shape) == shapes[name], "experts alike, in fp32"
                assert local.device.type == "cpu" and local.untyped_storage().nbytes() == 0, "no storage"
        self.file = file
        regions = regions_in_budget(budget, file.unit)
        self.ws = WorkingSet(self.file, regions - SCRATCH)
        # each a region's buffer, with room after the tensors for the rows per expert that travel with
        # the gradient in its reduction (past the region's page padding: a few bytes beside the budget)
        experts = next(iter(shapes.values()))[0]
        bucket_bytes = self.file.tensors_end + 4 * experts
        held = [aligned_empty(max(self.file.unit, bucket_bytes)) for _ in range(SCRATCH)]
        self.scratch = [b[: self.file.unit] for b in held]
        self._buckets = [b[:bucket_bytes].view(torch.float32) for b in held]  # by scratch index
        self.reduce, self.stage_ranks, self.distributed = reduce, stage_ranks, distributed
        self.optimizer = optimizer
        self.params = [[p for _, p in moe.experts.named_parameters(recurse=False)] for moe in layers]
        self.roles = list(shapes)
        self.updates = DeferredAdamW(self.ws, self.file, self.scratch, self.params, self.roles, optimizer)
        self._expert = {id(p): (layer, i) for layer, ps in enumerate(self.params) for i, p in enumerate(ps)}
        self._next_scratch, self.scale = 0, 1.0
        self.grads = _StepGrads(1, len(layers), len(self.roles))
        self.experts: list[OffloadedExperts] = install(model, self.ws, self.file, self)

    # -- backward ----------------------------------------------------------------------------------
    def begin_step(self, grad_accum: int) -> None:
        """A new optimizer step of ``grad_accum`` micro-batches: its gradients start from zero."""
        self.grads = _StepGrads(grad_accum, len(self.params), len(self.roles))

    def out(self, layer: int, grads: dict[str, Tensor], rows_E: Tensor) -> None:
        """A layer's gradients of one micro-batch, as its backward ends: added to the step's and written
        out; the last micro-batch's sums are reduced over the ranks first (in the background). ``rows_E``:
        the rows each expert computed; an expert with none so far has a zero sum whose pages are neither
        written nor read back (``LayerFile``: its bytes outside the pages read are zeroed)."""
        assert not self.updates.pending, "every update runs in forward, before a gradient is written over"
        step = self.grads
        micro, step.seen[layer] = step.seen[layer], step.seen[layer] + 1
        before = step.rows[layer]
        step.rows[layer] = rows = rows_E if before is None else before + rows_E
        index, self._next_scratch = self._next_scratch, (self._next_scratch + 1) % SCRATCH
        buf = self.scratch[index]
        sums = self.file.views(buf)
        if micro == 0:
            self.ws.wait_buffer(buf)
            for role in self.roles:
                sums[role].copy_(grads[role])
        else:  # NOTE: old + new, as autograd accumulates into .grad: the same bits
            assert before is not None
            self.ws.read(layer, "grad", buf, experts_with_rows(before)).result()
            for role in self.roles:
                sums[role].add_(grads[role])
        if micro + 1 == step.grad_accum:  # the step's gradient: reduced, then its norms kept and written
            self.reduce.start(self._buckets[index], rows, partial(self._reduced, layer, buf))
        else:
            self.ws.write(layer, "grad", buf, experts_with_rows(rows))

    def _reduced(self, layer: int, buf: Tensor, rows_E: Tensor) -> None:
        """``rows_E``: summed over dp. An expert without a row on any rank has a zero gradient: its norm
        adds zero, and it stays off the disk (the AdamW step reads it as zeros)."""
        sums = self.file.views(buf)
        self.grads.norms[layer] = list(torch._foreach_norm([sums[r] for r in self.roles], 2.0))
        self.grads.routed[layer] = experts_with_rows(rows_E)
        self.ws.write(layer, "grad", buf, self.grads.routed[layer])

    @torch.no_grad()
    def clip_gradients(self, pm: ParallelModel, max_norm: float) -> Tensor:
        """``clip_grad_norm`` over the whole model ``pm``: the same norm, the same factor.

        Per-tensor norms, grouped by how many ranks hold the same piece, stacked in parameter order
        and reduced by one ``vector_norm`` per group, as ``torch.nn.utils.get_total_norm`` does; the
        experts' norms were taken as their reduced gradients left. The experts' gradients are scaled
        in their AdamW step (``self.scale``).
        """
        self.reduce.wait()
        params = list(pm.parameters())
        grads = [p.grad for p in params if id(p) not in self._expert and p.grad is not None]
        plain = [local_tensor(g) for g in grads]
        plain_norms = iter(torch._foreach_norm(plain, 2.0) if plain else [])
        by_replicas: dict[float, list[Tensor]] = {}
        for p in params:
            if id(p) in self._expert:  # the parameter is placed as its gradient would be
                layer, i = self._expert[id(p)]
                norm = self.grads.norms[layer][i]
                assert norm is not None, f"no gradient of MoE layer {layer}'s experts this step"
                by_replicas.setdefault(replicas(p, self.stage_ranks), []).append(norm)
            elif p.grad is not None:
                by_replicas.setdefault(replicas(p.grad, self.stage_ranks), []).append(next(plain_norms))
        group_norms = ((n, torch.linalg.vector_norm(torch.stack(norms), 2.0)) for n, norms in by_replicas.items())
        norm = combine_norms(group_norms, self.distributed)
        self.scale = clip_scale(norm, max_norm)
        if self.scale < 1.0:
            torch._foreach_mul_(plain, self.scale)
        return norm

    # -- the AdamW step ----------------------------------------------------------------------------
    def step(self) -> None:
        """AdamW over every layer's experts with the optimizer's hyperparameters (after ``optimizer.step()``):
        recorded now, run layer by layer as the next forward reaches each (``DeferredAdamW``)."""
        self.updates.record(self.scale, self.grads.routed)

    def settle(self, upto: int | None = None) -> None:
        """Run the pending AdamW updates of layers up to ``upto`` (every layer: None), before their weights
        are read: by a forward reaching layer ``upto``, or by whatever needs the whole state."""
        self.updates.settle(len(self.params) - 1 if upto is None else upto)

    def close(self) -> None:
        """Remove the offloaded state, also after a failure; updates still pending go with it (a run's
        last checkpoint ran them)."""
        try:
            self.reduce.wait()
            self.ws.flush()
        finally:
            self.ws.close()
            self.file.remove()

    @property
    def bytes_read(self) -> int:
        return self.file.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.file.bytes_written


@dataclass
class _StepGrads:
    """An optimizer step's expert gradients so far, by layer (``begin_step`` starts one)."""

    grad_accum: int  # micro-batches in the step
    layers: int
    roles: int
    seen: list[int] = field(init=False)  # micro-batches whose gradient is in
    rows: list[Tensor | None] = field(init=False)  # this rank's rows per expert so far
    norms: list[list[Tensor | None]] = field(init=False)  # of the reduced gradients, by role
    routed: list[Experts] = field(init=False)  # experts with a token on any dp rank

    def __post_init__(self) -> None:
        self.seen = [0] * self.layers
        self.rows = [None] * self.layers
        self.norms = [[None] * self.roles for _ in range(self.layers)]
        self.routed = [None] * self.layers
