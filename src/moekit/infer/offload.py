"""Inference beyond memory: experts in a slow tier, a budgeted fast-tier cache, prefetch on a thread.

The model stays the single-device ``Transformer``; each MoE layer's ``experts`` module is swapped
for an ``OffloadedExperts`` that asks the ``Offloader`` for the weights of the experts its tokens
picked. Non-expert weights stay resident. Per layer and step:

1. experts prefetched for this layer are waited for (needed) or let go (mispredicted);
2. every needed expert already resident is pinned (a hit); misses are read on demand, each at most
   once per step for the whole batch, by a pool of reader threads (a deeper disk queue than one)
   while the resident experts compute;
3. the next MoE layer's experts are predicted by applying its router to this layer's input
   (``prefetch="router"``; Eliseev & Mazur 2023) or taken whole (``prefetch="all"``: throughput
   mode, layers streamed round-robin through the slots with FIFO eviction, MoESys/MoE-Lightning)
   and read by the same pool while this layer computes (the predicted experts already resident are
   pinned first, so those reads cannot evict them); a router prediction is only
   fetched while the prefetcher's recent precision holds up (a mispredicted read costs a whole
   expert's bytes, a right one saves only the overlap), and keeps being scored while it is not;
4. each expert's rows are computed with plain matmuls, the same arithmetic as the resident
   per-expert path, so greedy tokens match resident inference exactly in full precision.

When the budget holds fewer experts than a layer needs, the layer runs in chunks: resident
experts first, then each missing one loaded into an evicted slot and computed at once.

On a GPU the slow tier is page-locked host memory (``PinnedExperts``, filled from the file once) and
loads are DMA copies on a separate CUDA stream: each copy records an event the compute stream waits
for before using the slot, and each computation records an event the next copy into that slot waits
for, so transfers overlap compute without synchronising the device.

Legend: R rows sorted by expert, D model dim, E experts.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from moekit.config import ModelConfig, MoEConfig
from moekit.experts.grouped import apply_activation, compute_dtype
from moekit.infer.cache import POLICIES, Entry, ExpertCache, make_policy
from moekit.infer.expert_store import ExpertStore, ExpertStoreError, Key, aligned_empty
from moekit.infer.quant import QUANT_FORMATS, matmul, roles, write_quantized_store
from moekit.layer import MoE
from moekit.model import Transformer
from moekit.routing import HashRouter

PREFETCH_MODES = ("router", "all", "off")
READERS = 4  # concurrent expert reads: the disk's queue depth
_PRECISION_DECAY = 0.75  # of the moving precision per scored prediction: a prefill does not mask decode
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str, name: str = "--memory-budget") -> int:
    """``512MB``, ``1.5GiB``, ``1000000`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={text!r}: give a size such as 512MB, 2GiB or a byte count")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


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
        cache: ExpertCache,
        fmt: str,
        layers: dict[int, MoE],
        prefetch: str = "router",
        min_precision: float = 0.5,
        record_trace: int = 0,
    ) -> None:
        if prefetch not in PREFETCH_MODES:
            raise ValueError(f"prefetch={prefetch!r}: choose from {', '.join(PREFETCH_MODES)}")
        self.store, self.cache, self.fmt, self.prefetch = store, cache, fmt, prefetch
        self.min_precision = min_precision
        self.blocks = sorted(layers)
        self.routers = {b: layers[b].router for b in self.blocks}
        self.num_experts = {b: layers[b].cfg.num_experts for b in self.blocks}
        self.stats = OffloadStats()
        self.trace = OffloadTrace(record_trace) if record_trace else None
        self._step_reads: dict[int, Counter[Key]] = {}  # reads per expert of the steps in flight (this, next)
        self._pending: dict[int, list[Key]] = {}  # block -> keys prefetched for it, not yet settled
        self._predicted: tuple[int, set[int]] | None = None  # (block, experts) the router prefetch predicted
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="moekit-read")
        device = self.cache.arena.device
        self._host = PinnedExperts(store) if device.type == "cuda" else None
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._slot_released: list[torch.cuda.Event | None] = [None] * cache.num_slots  # GPU: last compute

    def close(self) -> None:
        self._readers.shutdown(wait=True, cancel_futures=True)
        self.store.close()

    # --- loading -------------------------------------------------------------------------------

    def _read(self, key: Key, entry: Entry, step: int, prefetch: bool) -> None:
        slot = self.cache.slot(entry)
        if self._copy_stream is not None:  # GPU: DMA from pinned host memory on the copy stream
            with torch.cuda.stream(self._copy_stream):
                released = self._slot_released[entry.slot]
                if released is not None:  # the slot's previous expert may still be computing
                    self._copy_stream.wait_event(released)
                slot.copy_(self._host.slot(key), non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
                entry.ready = ready
        else:
            self.store.read_into(key, slot)
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
        """Read a missing expert on the calling thread into a pinned slot (None: every slot is pinned)."""
        entry = self.cache.reserve(key)
        if entry is None:
            return None
        try:
            self._read(key, entry, self.stats.steps, prefetch=False)
        except BaseException:
            self.cache.drop(key)
            raise
        return entry

    def _read_later(self, key: Key, entry: Entry, step: int, prefetch: bool) -> None:
        entry.loading = self._readers.submit(self._read, key, entry, step, prefetch)

    def _wait(self, key: Key, entry: Entry) -> None:
        """Wait for a background read into ``entry``; a failed read frees its slot and raises."""
        assert entry.loading is not None
        try:
            entry.loading.result()
        except BaseException:
            self.cache.drop(key)
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
                self._release_prefetched(key, key[1] in needed)
            except BaseException as err:  # the slot is freed; the others are still to release
                error = error or err
        if error is not None:
            raise error

    def _release_prefetched(self, key: Key, needed: bool) -> None:
        """Unpin a prefetched slot once its read is done; free it if the read was cancelled or failed (raised)."""
        entry = self.cache.entries[key]
        if entry.loading is not None:  # else resident before the prefetch, only kept from eviction
            if not needed and entry.loading.cancel():
                self.cache.drop(key)
                return
            self._wait(key, entry)
        self.cache.unpin(entry)

    def _abandon_prefetches(self) -> None:
        """Release every prefetched slot (a layer failed: no later layer of this pass settles them)."""
        for block in list(self._pending):
            for key in self._pending.pop(block):
                with contextlib.suppress(BaseException):
                    self._release_prefetched(key, needed=False)

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
            self._read_later(key, entry, step, prefetch=True)
            keys.append(key)
        self._pending[target] = keys

    # --- one layer -----------------------------------------------------------------------------

    def run_layer(self, block: int, x_RD: Tensor, tokens_per_expert: Tensor, activation: str) -> Tensor:
        """The experts' outputs [R, D] for rows sorted by expert, loading weights as needed.

        A failed read raises (``ExpertStoreError`` naming the file and the expert) with no slot left pinned.
        """
        try:
            return self._run_layer(block, x_RD, tokens_per_expert, activation)
        except BaseException:
            self._abandon_prefetches()
            raise

    def _run_layer(self, block: int, x_RD: Tensor, tokens_per_expert: Tensor, activation: str) -> Tensor:
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
            self._read_later((block, missing[0]), entry, self.stats.steps, prefetch=False)
            reading.append((missing.pop(0), entry))
        if not missing:
            self._prefetch_for(block, x_RD)
        for e, entry in ready:  # resident experts compute while the misses are read
            self._compute((block, e), entry, x_RD, y_RD, starts, activation)
        for n, (e, entry) in enumerate(reading):
            try:
                self._wait((block, e), entry)
            except BaseException:
                for later, other in reading[n + 1 :]:  # free the other slots before reporting
                    with contextlib.suppress(BaseException):
                        self._wait((block, later), other)
                        self.cache.drop((block, later))
                raise
            self._compute((block, e), entry, x_RD, y_RD, starts, activation)
        for e in missing:  # the budget holds fewer experts than this layer needs: one at a time
            entry = self._load_now((block, e))
            assert entry is not None, "a layer's own experts are unpinned once computed"
            self._compute((block, e), entry, x_RD, y_RD, starts, activation)
        return y_RD

    def _start_step(self) -> None:
        with self.cache.lock:
            self.stats.steps += 1
            for step in [s for s in self._step_reads if s < self.stats.steps]:  # their reads were settled
                del self._step_reads[step]

    def _compute(self, key: Key, entry: Entry, x_RD: Tensor, y_RD: Tensor, starts: list[int], act: str) -> None:
        e = key[1]
        rows = slice(starts[e], starts[e + 1])
        if entry.ready is not None:  # GPU: the copy into the slot must have landed
            torch.cuda.current_stream(x_RD.device).wait_event(entry.ready)
        views = self.store.views(key, self.cache.slot(entry))
        h = apply_activation(matmul(self.fmt, views, "w_in", x_RD[rows]), act)
        y_RD[rows] = matmul(self.fmt, views, "w_out", h)
        if self._copy_stream is not None:  # recorded before the unpin that lets the slot be reused
            released = torch.cuda.Event()
            released.record(torch.cuda.current_stream(x_RD.device))
            self._slot_released[entry.slot] = released
        self.cache.unpin(entry)

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


class PinnedExperts:
    """The slow tier on a GPU: every expert of the store in page-locked host memory, read once.

    Page-locked memory is what lets the device copy asynchronously (DMA); pageable memory would
    make each copy synchronous and staged by the driver.
    """

    def __init__(self, store: ExpertStore, pin: bool = True) -> None:
        self.index = {key: i for i, key in enumerate(store.pieces)}
        self.host = aligned_empty(len(self.index) * store.slot_bytes, pin=pin).view(len(self.index), store.slot_bytes)
        for key, i in self.index.items():
            store.read_into(key, self.host[i])

    def slot(self, key: Key) -> Tensor:
        return self.host[self.index[key]]


class OffloadedExperts(nn.Module):
    """Drop-in for ``GroupedExperts`` at inference: same call, weights fetched from the offloader."""

    def __init__(self, offloader: Offloader, block: int, activation: str) -> None:
        super().__init__()
        self.offloader, self.block, self.activation = offloader, block, activation

    def forward(self, x_RD: Tensor, tokens_per_expert: Tensor) -> Tensor:
        return self.offloader.run_layer(self.block, x_RD, tokens_per_expert, self.activation)


# ---------------------------------------------------------------------------------------------
# Building an offloaded model from a run directory.


@dataclass(frozen=True)
class OffloadOptions:
    """How a run's experts are offloaded (the ``moekit generate`` flags of the same names)."""

    memory_budget: int  # bytes for resident weights: non-expert weights + the expert cache
    policy: str = "lru"  # cache eviction: lru | lfu | fifo
    prefetch: str = "router"  # router (predict the next layer) | all (throughput ring) | off
    expert_format: str = "fp"  # fp (the checkpoint itself) | int8 | int4 (a quantized store, made once)
    direct_io: bool = True  # O_DIRECT reads where the filesystem allows: no page cache beside the budget
    drop_pages: bool = False  # buffered reads: evict each from the OS page cache (measure the disk, not RAM)
    prefetch_min_precision: float = 0.5  # router prefetch pauses while fewer of its picks are used
    record_trace: int = 0  # keep the last N layer requests and reads (``Offloader.trace``); 0: none

    def __post_init__(self) -> None:
        choices = {
            "--policy": (self.policy, tuple(POLICIES)),
            "--prefetch": (self.prefetch, PREFETCH_MODES),
            "--expert-format": (self.expert_format, ("fp", *QUANT_FORMATS)),
        }
        for flag, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"{flag}={value!r}: choose from {', '.join(allowed)}")
        if self.memory_budget <= 0:
            raise ValueError(f"--memory-budget={self.memory_budget}: must be > 0")
        if not 0 <= self.prefetch_min_precision <= 1:
            raise ValueError(f"prefetch_min_precision={self.prefetch_min_precision}: must be in [0, 1]")
        if self.record_trace < 0:
            raise ValueError(f"record_trace={self.record_trace}: must be >= 0 (0 = no trace)")

    def build(
        self, model_cfg: ModelConfig, moe_cfg: MoEConfig, checkpoint: Path, device: str = "cpu"
    ) -> tuple[Transformer, Offloader]:
        """``load_run``'s hook (``run.load.Offload``): the model with its experts served under these options."""
        return build_offloaded(model_cfg, moe_cfg, checkpoint, self, device)


def open_store(checkpoint: Path, blocks: dict[int, int], options: OffloadOptions) -> ExpertStore:
    """The checkpoint's own safetensors file (fp), or its quantized copy, written on first use."""
    weights = checkpoint / "model.safetensors"
    if options.expert_format == "fp":
        return ExpertStore(weights, blocks, roles("fp"), options.drop_pages, options.direct_io)
    path = checkpoint / f"experts-{options.expert_format}.safetensors"
    if not path.is_file():
        with ExpertStore(weights, blocks, roles("fp")) as source:
            write_quantized_store(source, path, options.expert_format)
    return ExpertStore(path, blocks, roles(options.expert_format), options.drop_pages, options.direct_io)


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers (shared tensors counted once)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def build_offloaded(
    model_cfg: ModelConfig, moe_cfg: MoEConfig, checkpoint: Path, options: OffloadOptions, device: str = "cpu"
) -> tuple[Transformer, Offloader]:
    """A ``Transformer`` whose non-expert weights are loaded from the checkpoint and whose experts
    come from a store through a cache of what the budget leaves after the non-expert weights.

    The expert tensors are never materialised: the model is built on the meta device, its experts
    swapped for ``OffloadedExperts``, then the remaining tensors allocated and loaded by name. The
    checkpoint's checksum is not recomputed (that would read every expert); a truncated file is
    still caught, by the store, naming the first expert it cuts.
    """
    from safetensors import safe_open

    from moekit.model.rope import model_rope

    with torch.device("meta"):
        model = Transformer(model_cfg, moe_cfg)
    layers = {i: b.ffn for i, b in enumerate(model.blocks) if isinstance(b.ffn, MoE)}
    for moe in layers.values():
        del moe.experts  # replaced below, once the offloader exists
    model.to_empty(device=device)
    if model_cfg.tie_embeddings:  # allocating meta tensors one module at a time unties shared ones
        model.lm_head.weight = model.embed.weight
    model.rope_freqs = model_rope(model_cfg).to(device)
    store = open_store(Path(checkpoint), {b: m.cfg.num_experts for b, m in layers.items()}, options)
    wanted = model.state_dict()
    state = {}
    weights = Path(checkpoint) / "model.safetensors"
    with safe_open(str(weights), "pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            if name in wanted:
                state[name] = f.get_tensor(name)
    model.load_state_dict(state, strict=False)
    loaded = {wanted[n].data_ptr() for n in state}
    missing = [n for n, t in wanted.items() if t.data_ptr() not in loaded]
    if missing:
        store.close()
        raise ExpertStoreError(f"{weights}: does not fit this model (missing {sorted(missing)[:3]})")
    budget, resident = options.memory_budget, model_bytes(model)
    slots = min((budget - resident) // store.slot_bytes, len(store.pieces))
    if slots < 1:
        store.close()
    if budget < resident:
        raise ValueError(
            f"--memory-budget={format_bytes(budget)} is smaller than the non-expert weights "
            f"({format_bytes(resident)}), which stay resident"
        )
    if slots < 1:
        raise ValueError(
            f"--memory-budget={format_bytes(budget)} leaves {format_bytes(budget - resident)} for experts "
            f"after the non-expert weights ({format_bytes(resident)}): "
            f"less than one expert ({format_bytes(store.slot_bytes)})"
        )
    cache = ExpertCache(slots, store.slot_bytes, torch.device(device), make_policy(options.policy))
    offloader = Offloader(
        store,
        cache,
        options.expert_format,
        layers,
        options.prefetch,
        options.prefetch_min_precision,
        options.record_trace,
    )
    for block, moe in layers.items():
        moe.experts = OffloadedExperts(offloader, block, moe.cfg.activation)
    return model.eval(), offloader
