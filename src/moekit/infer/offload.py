"""Offloaded experts for a run's model: the options (``moekit generate --memory-budget ...``) and the
model built under them, its non-expert weights resident and its experts served by an ``Offloader``
(``moekit.infer.offloader``) from the checkpoint's file through a cache of what the budget leaves."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from moekit.config import ModelConfig, MoEConfig
from moekit.errors import OptionError
from moekit.infer.expert_store import ExpertStore, ExpertStoreError
from moekit.infer.offloader import PREFETCH_MODES, OffloadedExperts, Offloader
from moekit.infer.quant import QUANT_FORMATS, roles, write_quantized_store
from moekit.infer.range_store import RangeStore
from moekit.layer import MoE
from moekit.model import Transformer
from moekit.storage.slots import POLICIES, SlotCache, make_policy
from moekit.units import format_bytes

Store = ExpertStore | RangeStore  # a run's own file (or quantized copy), or another checkpoint's files in place


@dataclass(frozen=True)
class OffloadOptions:
    """How a run's experts are offloaded (the ``moekit generate`` flags of the same names)."""

    memory_budget: int  # bytes for resident weights: non-expert weights + the expert cache
    policy: str = "lru"  # cache eviction: lru | lfu | fifo
    prefetch: str = "auto"  # auto | router (predict the next layer) | all (throughput ring) | off
    expert_format: str = "fp"  # fp (the checkpoint itself) | int8 | int4 (a quantized store, made once)
    direct_io: bool = True  # O_DIRECT reads where the filesystem allows: no page cache beside the budget
    drop_pages: bool = False  # buffered reads: evict each from the OS page cache (measure the disk, not RAM)
    prefetch_min_precision: float = 0.5  # router prefetch pauses while fewer of its picks are used
    record_trace: int = 0  # keep the last N layer requests and reads (``Offloader.trace``); 0: none

    def __post_init__(self) -> None:
        choices = {
            "policy": (self.policy, tuple(POLICIES)),
            "prefetch": (self.prefetch, ("auto", *PREFETCH_MODES)),
            "expert_format": (self.expert_format, ("fp", *QUANT_FORMATS)),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise OptionError(name, f"choose from {', '.join(allowed)}", value)
        if self.memory_budget <= 0:
            raise OptionError("memory_budget", "must be > 0", self.memory_budget)
        if not 0 <= self.prefetch_min_precision <= 1:
            raise OptionError("prefetch_min_precision", "must be in [0, 1]", self.prefetch_min_precision)
        if self.record_trace < 0:
            raise OptionError("record_trace", "must be >= 0 (0 = no trace)", self.record_trace)

    def build(
        self,
        model_cfg: ModelConfig,
        moe_cfg: MoEConfig,
        checkpoint: Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> tuple[Transformer, Offloader]:
        """``load_run``'s hook (``run.load.Offload``): the model with its experts served under these options."""
        return build_offloaded(model_cfg, moe_cfg, checkpoint, self, device, dtype)


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


Tensors = Callable[[Collection[str]], Iterator[tuple[str, Tensor]]]  # names wanted -> (name, tensor), one at a time


def _fill(model: Transformer, resident: Tensors, source: Path) -> None:
    """Copy the tensors ``resident`` yields into the model's allocated state, each checked by name and shape."""
    wanted = model.state_dict()
    loaded: set[int] = set()
    with torch.no_grad():
        for name, tensor in resident(wanted.keys()):
            if name in wanted:
                if tuple(tensor.shape) != tuple(wanted[name].shape):
                    shape, want = list(tensor.shape), list(wanted[name].shape)
                    raise ExpertStoreError(f"{source}: {name} is {shape}, the model's {want}")
                wanted[name].copy_(tensor)
                loaded.add(wanted[name].data_ptr())
    missing = [n for n, t in wanted.items() if t.data_ptr() not in loaded]
    if missing:
        raise ExpertStoreError(f"{source}: does not fit this model (missing {sorted(missing)[:3]})")


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers (shared tensors counted once; a prepacked oneDNN
    weight, which has no storage to share, by its logical size)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[id(t) if t.is_mkldnn else t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def build_offloaded(
    model_cfg: ModelConfig,
    moe_cfg: MoEConfig,
    checkpoint: Path,
    options: OffloadOptions,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Transformer, Offloader]:
    """A ``Transformer`` whose non-expert weights are loaded (in ``dtype``) from a run's checkpoint and
    whose experts come from its file (or quantized copy) through a cache of what the budget leaves.

    The checkpoint's checksum is not recomputed (that would read every expert); a truncated file is
    still caught, by the store, naming the first expert it cuts.
    """
    from safetensors import safe_open

    weights = Path(checkpoint) / "model.safetensors"

    def resident(wanted: Collection[str]) -> Iterator[tuple[str, Tensor]]:
        with safe_open(str(weights), "pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if name in wanted:
                    yield name, f.get_tensor(name)

    def store(blocks: dict[int, int]) -> Store:
        return open_store(Path(checkpoint), blocks, options)

    return offloaded_model(model_cfg, moe_cfg, resident, store, weights, options, device, dtype)


def offloaded_model(
    model_cfg: ModelConfig,
    moe_cfg: MoEConfig,
    resident: Tensors,
    open_experts: Callable[[dict[int, int]], Store],
    source: Path,
    options: OffloadOptions,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Transformer, Offloader]:
    """A ``Transformer`` whose non-expert weights come from ``resident`` (given the names wanted, it
    yields (name, tensor) one at a time, copied in ``dtype`` into place) and whose experts come from the
    store ``open_experts`` opens for the MoE blocks ({block: experts}), through a cache of what the
    budget leaves after the non-expert weights. ``source`` names the weights in errors.

    The expert tensors are never materialised: the model is built on the meta device, its experts
    swapped for ``OffloadedExperts``, then the remaining tensors allocated and filled by name.
    """
    from moekit.run.load import materialise

    with torch.device("meta"):
        model = Transformer(model_cfg, moe_cfg)
    layers = {i: b.ffn for i, b in enumerate(model.blocks) if isinstance(b.ffn, MoE)}
    for block, moe in layers.items():
        moe.experts = OffloadedExperts(moe.cfg, block)  # the offloader is set below, once it exists
    materialise(model, dtype, device)
    store = open_experts({b: m.cfg.num_experts for b, m in layers.items()})  # first: a cut file names an expert
    try:
        _fill(model, resident, source)
    except BaseException:
        store.close()
        raise
    budget, resident_bytes = options.memory_budget, model_bytes(model)
    in_budget = (budget - resident_bytes) // store.slot_bytes
    slots = min(in_budget, len(store.pieces))
    if slots < 1:
        store.close()
    if budget < resident_bytes:
        raise OptionError(
            "memory_budget",
            f"smaller than the non-expert weights ({format_bytes(resident_bytes)}), which stay resident",
            format_bytes(budget),
        )
    if slots < 1:
        raise OptionError(
            "memory_budget",
            f"leaves {format_bytes(budget - resident_bytes)} for experts after the non-expert weights "
            f"({format_bytes(resident_bytes)}): less than one expert ({format_bytes(store.slot_bytes)})",
            format_bytes(budget),
        )
    cache = SlotCache(slots, store.slot_bytes, torch.device(device), make_policy(options.policy))
    offloader = Offloader(
        store,
        cache,
        options.expert_format,
        layers,
        resolve_prefetch(options.prefetch, torch.device(device)),
        options.prefetch_min_precision,
        options.record_trace,
        slots_in_budget=in_budget,
    )
    for moe in layers.values():
        moe.experts.offloader = offloader
    return model.eval(), offloader


def resolve_prefetch(mode: str, device: torch.device) -> str:
    """``auto``: router prediction where the slow tier is a disk (the CPU's: reads of hundreds of MB/s to
    hide), none where it is pinned host memory copied to a GPU. On an H200, copying at 55 GB/s, router
    prefetch copied 27% more experts at 57% precision and ran 13-29% slower than none, at batch 1 and 16
    (benchmarks/offload.py --device cuda)."""
    if mode != "auto":
        return mode
    return "off" if device.type == "cuda" else "router"
