"""Inference beyond memory: experts in a slow tier, a budgeted fast-tier cache, prefetch in the background.

The model stays the single-device ``Transformer``; each MoE layer's ``experts`` module is swapped
for an ``OffloadedExperts`` that asks the ``Offloader`` for the weights of the experts its tokens
picked. Non-expert weights stay resident. The offloader keeps the books (which expert is in which
slot, what to load, what to prefetch, what was read); a loader (``moekit.storage.loaders``, picked
once for the cache's device) moves the bytes. Per layer and step:

1. experts prefetched for this layer are waited for (needed) or let go (mispredicted);
2. every needed expert already resident is pinned (a hit); misses are loaded on demand, each at most
   once per step for the whole batch, in the background (on the CPU: a pool of reader threads, a
   deeper disk queue than one) while the resident experts compute;
3. the next MoE layer's experts are predicted by applying its router to this layer's input
   (``prefetch="router"``; Eliseev & Mazur 2023) or taken whole (``prefetch="all"``: throughput
   mode, layers streamed round-robin through the slots with FIFO eviction, MoESys/MoE-Lightning)
   and loaded the same way while this layer computes (the predicted experts already resident are
   pinned first, so those loads cannot evict them); a router prediction is only
   fetched while the prefetcher's recent precision holds up (a mispredicted read costs a whole
   expert's bytes, a right one saves only the overlap), and keeps being scored while it is not;
4. each expert's rows are computed with the resident model's kernel for them (plain matmuls, or
   oneDNN's prepacked experts' kernel over the slot's weight: 16-bit ones reordered on each call, fp32
   ones once per read and kept beside the slot, ``use_packed_kernels``; or the row layout's,
   ``use_row_kernels``), the same arithmetic, so greedy tokens match resident inference exactly in full
   precision.

When the budget holds fewer experts than a layer needs, the layer runs in chunks: resident
experts first, then each missing one loaded into an evicted slot and computed at once.

Legend: R rows sorted by expert, D model dim, E experts.
"""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from moekit.config import MoEConfig
from moekit.errors import OptionError
from moekit.experts.grouped import Activation, ExpertCompute, compute_dtype
from moekit.experts.matmul import inference_layout, packed_linear, prepack
from moekit.infer.expert_store import ExpertStore, Key
from moekit.infer.quant import matmul
from moekit.layer import MoE
from moekit.routing import HashRouter
from moekit.storage.loaders import make_loader
from moekit.storage.slots import Entry, SlotCache

PREFETCH_MODES = ("router", "all", "off")
_PRECISION_DECAY = 0.75  # of the moving precision per scored prediction: a prefill does not mask decode


@dataclass
class OffloadStats:
    """Running totals of an offloaded run: fixed size however long it serves (no per-step records)."""

    steps: int = 0
    hits: int = 0  # needed experts found resident (loaded earlier or prefetched)
    misses: int = 0  # needed experts read on demand
    bytes_read: int = 0
    reads: int = 0
    prefetch_reads: int = 0
    max_reads_per_step: int = 0  # most reads of one expert for one step: 1 proves none is read twice
    predicted: int = 0  # experts the prefetcher predicted (in layers that had a prediction)
    predicted_needed: int = 0  # of those needed experts, how many were predicted
    needed_with_prediction: int = 0  # needed experts in layers that had a prediction
    recent_precision: float = 1.0  # moving average of each prediction's precision (gates prefetch)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)

    @property
    def mean_reads_per_step(self) -> float:
        """Mean expert reads per step (prefill and each decode step are one step each)."""
        return self.reads / max(1, self.steps)

    @property
    def prediction_recall(self) -> float:
        """Share of needed experts the prefetcher had predicted."""
        return self.predicted_needed / max(1, self.needed_with_prediction)

    @property
    def prediction_precision(self) -> float:
        return self.predicted_needed / max(1, self.predicted)


@dataclass(frozen=True)
class LayerRequest:
    """The experts one MoE layer needed in one step, and which of them were resident."""

    step: int
    block: int
    needed: tuple[int, ...]
    hits: tuple[int, ...]


@dataclass(frozen=True)
class ExpertRead:
    step: int  # the step the expert was read for (a prefetch may read for the next one)
    key: Key
    prefetch: bool


class OffloadTrace:
    """The last ``maxlen`` layer requests and expert reads of a run, kept only when asked for
    (``OffloadOptions.record_trace``): the input of the offline policy replay, and a check of the totals."""

    def __init__(self, maxlen: int) -> None:
        self.requests: deque[LayerRequest] = deque(maxlen=maxlen)
        self.reads: deque[ExpertRead] = deque(maxlen=maxlen)

    def routing(self) -> list[list[Key]]:
        """Needed experts per (step, layer), oldest first: what ``cache.replay`` takes."""
        return [[(r.block, e) for e in r.needed] for r in self.requests]


class Offloader:
    """Serves expert weights of every MoE block of one model from a store through a budgeted cache."""

    def __init__(
        self,
        store: ExpertStore,
        cache: SlotCache,
        fmt: str,
        layers: dict[int, MoE],
        prefetch: str = "router",
        min_precision: float = 0.5,
        record_trace: int = 0,
        *,
        slots_in_budget: int,
    ) -> None:
        """``slots_in_budget``: the slots the budget pays for, beyond the experts there are (``cache``
        has no more slots than experts); what ``use_packed_kernels`` may split between slots and copies."""
        if prefetch not in PREFETCH_MODES:
            raise OptionError("prefetch", f"choose from {', '.join(PREFETCH_MODES)}", prefetch)
        self.store, self.cache, self.fmt, self.prefetch = store, cache, fmt, prefetch
        self.min_precision = min_precision
        self.blocks = sorted(layers)
        self.routers = {b: layers[b].router for b in self.blocks}
        self.num_experts = {b: layers[b].cfg.num_experts for b in self.blocks}
        self._expert_shapes = {_expert_shapes_NK(layers[b].cfg) for b in self.blocks}  # distinct, for the copies
        self.stats = OffloadStats()
        self.trace = OffloadTrace(record_trace) if record_trace else None
        self._step_reads: dict[int, Counter[Key]] = {}  # reads per expert of the steps in flight (this, next)
        self._pending: dict[int, list[Key]] = {}  # block -> keys prefetched for it, not yet settled
        self._in_use: dict[Key, Entry] = {}  # slots the running layer pinned and has not computed yet
        self._predicted: tuple[int, set[int]] | None = None  # (block, experts) the router prefetch predicted
        self.loader = make_loader(store, cache)  # file reads on the CPU, copies from pinned memory on a GPU
        self.slots_in_budget = slots_in_budget
        # full-precision experts by the resident model's kernel: "mm", "packed" (prepacked experts') or "rows"
        self.kernel = "mm"
        self._reordered: dict[int, tuple[Key, dict[str, Tensor]]] | None = None  # slot -> its expert, prepacked
        self._reordered_bytes = 0  # one expert's, prepacked

    @property
    def reordered_bytes(self) -> int:
        """At most what the fp32 experts kept reordered beside their slots hold (``use_packed_kernels``)."""
        return 0 if self._reordered is None else self.cache.num_slots * self._reordered_bytes

    def use_packed_kernels(self, dtype: torch.dtype) -> None:
        """Multiply full-precision experts by the resident model's prepacked kernel (``prepack_``). An fp32
        weight's prepacked layout costs a reorder no cheaper than 5x its product (``unpacked_linear``),
        so each cached fp32 expert is kept reordered beside its slot, made once as it is first computed:
        the cache holds fewer experts, so that slots and copies stay within what the budget pays for.
        ``dtype``: the model's, which full-precision experts are computed in. Before the first step."""
        self.kernel = "packed"
        if self.fmt != "fp" or dtype != torch.float32 or self._reordered is not None:
            return
        slot, self._reordered_bytes = self.cache.slot_bytes, max(map(_reordered_nbytes, self._expert_shapes))
        slots = min(self.slots_in_budget * slot // (slot + self._reordered_bytes), self.cache.num_slots)
        if slots >= 1:
            self.cache.keep(slots)
            self._reordered = {}

    def use_row_kernels(self) -> None:
        """Multiply full-precision experts as the resident row layout does (``prepack_``'s ``RowExperts``,
        ``experts.matmul.plain_linear``) over the slot's weight. Before the first step."""
        self.kernel = "rows"

    def close(self) -> None:
        self.loader.close()
        self.store.close()

    # --- loading -------------------------------------------------------------------------------

    def _count_read(self, key: Key, step: int, prefetch: bool) -> None:
        """Book a finished load (on the loading thread, before its waiter wakes)."""
        with self.cache.lock:
            self.stats.reads += 1
            self.stats.prefetch_reads += prefetch
            self.stats.bytes_read += self.store.bytes_per_expert
            reads = self._step_reads.setdefault(step, Counter())
            reads[key] += 1
            self.stats.max_reads_per_step = max(self.stats.max_reads_per_step, reads[key])
            if self.trace is not None:
                self.trace.reads.append(ExpertRead(step, key, prefetch))

    def _load_now(self, key: Key) -> Entry | None:
        """Load a missing expert into a pinned slot and wait for it (None: every slot is pinned)."""
        entry = self.cache.reserve(key)
        if entry is None:
            return None
        self._in_use[key] = entry
        self._start_load(key, entry, self.stats.steps, prefetch=False)
        self._wait(key, entry)
        return entry

    def _start_load(self, key: Key, entry: Entry, step: int, prefetch: bool) -> None:
        entry.loading = self.loader.load(key, entry, partial(self._count_read, key, step, prefetch))

    def _wait(self, key: Key, entry: Entry) -> None:
        """Wait for a load into ``entry``; a failed load frees its slot and raises."""
        assert entry.loading is not None
        try:
            entry.loading.result()
        except BaseException:
            self.cache.drop(key)
            self._in_use.pop(key, None)  # a dropped slot is held by no one
            raise
        finally:
            entry.loading = None

    def _settle(self, block: int, needed: set[int]) -> None:
        """Wait for prefetched experts this layer needs; cancel or release the others.

        A failed read is raised only once every other slot of the prefetch is released (waited for
        and unpinned, or freed): a slot left pinned, or holding a finished read, could never be evicted.
        """
        error: BaseException | None = None
        for key in self._pending.pop(block, []):
            try:
                self._release(key, key[1] in needed)
            except BaseException as err:  # the slot is freed; the others are still to release
                error = error or err
        if error is not None:
            raise error

    def _release(self, key: Key, needed: bool) -> None:
        """Unpin a slot once its read is done; free it if the read was cancelled or failed (raised)."""
        entry = self.cache.entries[key]
        if entry.loading is not None:  # else resident already, only kept from eviction
            if not needed and entry.loading.cancel():
                self.cache.drop(key)
                return
            self._wait(key, entry)
        self.cache.unpin(entry)

    def _release_unsettled(self, keep: int | None = None) -> None:
        """Release every slot a layer or a prefetch still holds, but the prefetch for block ``keep``.

        Called when a layer fails, and when a step starts (the previous one may have failed between
        two MoE layers): no later layer of a failed pass settles what it pinned or reserved. Reads in
        flight are cancelled, or waited for and unpinned (a finished one stays resident, evictable).
        """
        for entry in self._in_use.values():  # its computation may have been issued before the failure
            self.loader.after_compute(entry)
        held = list(self._in_use)
        self._in_use.clear()
        for block in [b for b in self._pending if b != keep]:
            held += self._pending.pop(block)
        for key in held:
            with contextlib.suppress(BaseException):  # a failed read frees its slot; the others still go
                self._release(key, needed=False)
        self._predicted = None  # a prediction for a layer that did not run would be scored against the next step

    def _prefetch_for(self, block: int, x_RD: Tensor) -> None:
        """Start background reads of the experts the next MoE layer is predicted to need."""
        i = self.blocks.index(block)
        if self.prefetch == "off" or (i + 1 == len(self.blocks) and self.prefetch == "router"):
            return
        target = self.blocks[(i + 1) % len(self.blocks)]
        if self.prefetch == "all":
            predicted = list(range(self.num_experts[target]))
        else:
            router = self.routers[target]
            if isinstance(router, HashRouter) or x_RD.shape[0] == 0:
                return  # a hash router needs token ids, not hidden states
            predicted = torch.unique(router(x_RD).expert_idx).tolist()
            self.stats.predicted += len(predicted)
            self._predicted = (target, set(predicted))
            if self.stats.recent_precision < self.min_precision:
                return
        step = self.stats.steps + (target <= block)  # wrapping around: the next step's first layer
        assert target not in self._pending, target
        # NOTE: the predicted experts already resident are pinned before any slot is claimed, or the
        # claims could evict them (the oldest, often) and read them again; the target layer unpins them.
        keys = [(target, e) for e in predicted if self.cache.pin_resident((target, e)) is not None]
        for expert in predicted:
            key = (target, expert)
            if key in self.cache.entries:
                continue
            entry = self.cache.reserve(key)
            if entry is None:
                break  # every slot is pinned: no room to look further ahead
            self._start_load(key, entry, step, prefetch=True)
            keys.append(key)
        self._pending[target] = keys

    # --- one layer -----------------------------------------------------------------------------

    def run_layer(self, block: int, x_RD: Tensor, tokens_per_expert: Tensor, compute: ExpertCompute) -> Tensor:
        """The experts' outputs [R, D] for rows sorted by expert, loading weights as needed.

        A failed read raises (``ExpertStoreError`` naming the file and the expert) with no slot left pinned.
        """
        try:
            return self._run_layer(block, x_RD, tokens_per_expert, compute)
        except BaseException:
            self._release_unsettled()
            raise

    def _run_layer(self, block: int, x_RD: Tensor, tokens_per_expert: Tensor, compute: ExpertCompute) -> Tensor:
        if block == self.blocks[0]:
            self._start_step()
        counts = tokens_per_expert.tolist()
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        needed = [e for e, n in enumerate(counts) if n]
        self._settle(block, set(needed))
        self._record_prediction(block, needed)

        x_RD = x_RD.to(compute_dtype(x_RD))
        y_RD = x_RD.new_empty(x_RD.shape)
        ready: list[tuple[int, Entry]] = []
        missing: list[int] = []
        for e in needed:
            entry = self.cache.get((block, e))
            if entry is not None:
                self.cache.pin(entry)
                self._in_use[(block, e)] = entry
                ready.append((e, entry))
            else:
                missing.append(e)
        self.stats.hits += len(ready)
        self.stats.misses += len(missing)
        if self.trace is not None:
            self.trace.requests.append(LayerRequest(self.stats.steps, block, tuple(needed), tuple(e for e, _ in ready)))
        reading: list[tuple[int, Entry]] = []
        while missing:  # demand reads in the background while there are slots
            entry = self.cache.reserve((block, missing[0]))
            if entry is None:
                break
            self._in_use[(block, missing[0])] = entry
            self._start_load((block, missing[0]), entry, self.stats.steps, prefetch=False)
            reading.append((missing.pop(0), entry))
        if not missing:
            self._prefetch_for(block, x_RD)
        for e, entry in ready:  # resident experts compute while the misses are read
            self._compute((block, e), entry, x_RD, y_RD, starts, compute)
        for e, entry in reading:  # a failed read raises; run_layer releases the other slots
            self._wait((block, e), entry)
            self._compute((block, e), entry, x_RD, y_RD, starts, compute)
        for e in missing:  # the budget holds fewer experts than this layer needs: one at a time
            entry = self._load_now((block, e))
            assert entry is not None, "a layer's own experts are unpinned once computed"
            self._compute((block, e), entry, x_RD, y_RD, starts, compute)
        return y_RD

    def _start_step(self) -> None:
        # NOTE: the first block's prefetch is kept: the last layer of the previous step started it (ring).
        self._release_unsettled(keep=self.blocks[0])
        with self.cache.lock:
            self.stats.steps += 1
            for step in [s for s in self._step_reads if s < self.stats.steps]:  # their reads were settled
                del self._step_reads[step]

    def _compute(
        self, key: Key, entry: Entry, x_RD: Tensor, y_RD: Tensor, starts: list[int], compute: ExpertCompute
    ) -> None:
        e = key[1]
        rows = slice(starts[e], starts[e + 1])
        self.loader.before_compute(entry)
        views = self.store.views(key, self.cache.slot(entry))
        if self._reordered is not None:
            packed = self._reordered_weights(key, entry, views)
            w_in, w_out = (lambda x, role=role: packed_linear(x, packed[role]) for role in ("w_in", "w_out"))
        else:
            w_in, w_out = (
                lambda x, role=role: matmul(self.fmt, views, role, x, self.kernel) for role in ("w_in", "w_out")
            )
        y_RD[rows] = compute(x_RD[rows], w_in, w_out, e)
        self.loader.after_compute(entry)  # before the unpin that lets the slot be loaded into again
        del self._in_use[key]
        self.cache.unpin(entry)

    def _reordered_weights(self, key: Key, entry: Entry, views: dict[str, Tensor]) -> dict[str, Tensor]:
        """The fp32 expert in ``entry``'s slot, prepacked: kept from its last computation there, or made
        now when the slot holds another expert (the old copy freed first)."""
        kept = self._reordered.get(entry.slot)
        if kept is not None and kept[0] == key:
            return kept[1]
        self._reordered.pop(entry.slot, None)
        # NOTE: made in a serving step, in inference mode: read by later steps only, never written in place
        weights = {role: inference_layout(views[role], torch.float32).t() for role in ("w_in", "w_out")}
        self._reordered[entry.slot] = (key, {role: prepack(w_NK) for role, w_NK in weights.items()})
        return self._reordered[entry.slot][1]

    def _record_prediction(self, block: int, needed: list[int]) -> None:
        if self._predicted is None or self._predicted[0] != block:
            return
        predicted = self._predicted[1]
        right = len(predicted.intersection(needed))
        self.stats.needed_with_prediction += len(needed)
        self.stats.predicted_needed += right
        precision = right / max(1, len(predicted))
        self.stats.recent_precision = (
            _PRECISION_DECAY * self.stats.recent_precision + (1 - _PRECISION_DECAY) * precision
        )
        self._predicted = None


class OffloadedExperts(nn.Module):
    """Drop-in for ``GroupedExperts`` at inference: same call, weights fetched from the offloader
    (set once it exists); the experts' biases, if any, are small and stay resident here."""

    def __init__(self, cfg: MoEConfig, block: int) -> None:
        super().__init__()
        self.offloader: Offloader | None = None
        self.block, self.activation = block, Activation(cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)
        width_in = cfg.d_ff * (2 if self.activation.gated else 1)
        bias = cfg.expert_ffn_bias
        self.w_in_bias = nn.Parameter(torch.zeros(cfg.num_experts, width_in)) if bias else None
        self.w_out_bias = nn.Parameter(torch.zeros(cfg.num_experts, cfg.d_model)) if bias else None

    def forward(self, x_RD: Tensor, tokens_per_expert: Tensor) -> Tensor:
        assert self.offloader is not None, "build_offloaded sets the offloader"
        compute = ExpertCompute(self.activation, self.w_in_bias, self.w_out_bias)
        return self.offloader.run_layer(self.block, x_RD, tokens_per_expert, compute)


def _expert_shapes_NK(cfg: MoEConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """One expert's two weights' shapes, [out, in]: the input projection (gated or not), the output one."""
    width_in = cfg.d_ff * (2 if Activation(cfg.activation).gated else 1)
    return (width_in, cfg.d_model), (cfg.d_model, cfg.d_ff)


def _reordered_nbytes(shapes_NK: tuple[tuple[int, int], ...]) -> int:
    """Bytes of one fp32 expert's weights in oneDNN's prepacked layout (padded to its blocks)."""
    return sum(torch.ops.mkldnn._nbytes(prepack(torch.empty(shape))) for shape in shapes_NK)
