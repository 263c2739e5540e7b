"""What the planner plans for: a cluster, a model (with the attention shape ``ModelConfig`` does not
describe) and a workload, read from the TOML presets in ``moekit/configs/{clusters,models}`` or files.

Units: seconds, bytes, FLOPs; bandwidths in GB/s per device, latencies in microseconds.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from moekit.config import ModelConfig, MoEConfig
from moekit.errors import OptionError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class Cluster:
    """Devices and links, per device (bandwidths are what one device can send at once)."""

    name: str
    nodes: int  # machines
    gpus_per_node: int  # devices per machine sharing the fast intra-node link
    peak_tflops: float  # dense matmul peak per device in bf16 (or the training dtype)
    efficiency: float  # fraction of peak that large GEMMs reach (measured: benchmarks/device_rates.py)
    memory_gb: float  # device memory in GB of 1e9 bytes, as NVML counts it (an "80GB" H100: 81559 MiB = 85.5 GB)
    intra_gbps: float  # GB/s per device within a node (NVLink)
    intra_latency_us: float  # per message within a node
    inter_gbps: float  # GB/s per device across nodes (InfiniBand)
    inter_latency_us: float  # per message across nodes
    # Fixed costs beside FLOPs and alpha-beta bytes, which make many small micro-batches slow; measured
    # on CPU by benchmarks/planner_calibration.py, 0 leaves them out. One block's forward + backward on
    # one micro-batch (framework dispatch, kernel launches):
    pass_overhead_us: float = 0.0
    # One FSDP collective of one unit (copies into and out of its flat buffer, hooks):
    fsdp_overhead_us: float = 0.0
    # One extra overlap chunk of one MoE layer's dispatch, forward and backward (its own expert pass,
    # permutes and hand-offs to the exchanging thread):
    chunk_overhead_us: float = 0.0
    # One pipeline chunk's forward or backward on one micro-batch: the schedule's own work between chunks
    # (its sends and receives posted and waited for, the chunk's first launches); derived in the preset.
    stage_pass_us: float = 0.0
    # Cores the devices of a node share, where they are CPU ranks (0: each device computes on its own);
    # fewer cores than devices time-share them (benchmarks/planner_calibration.py sets it), and pay an
    # all-to-all's latency once a peer where devices pay it once (comm.posted_latency).
    cores: int = 0
    # The elementwise work between GEMMs (norms, dense SwiGLU, token permutes, casts into fp8), its bytes
    # counted once a tensor read or written, a second, as eager kernels run it (which move more than
    # that: benchmarks/device_rates.py); 0 leaves it out (the CPU calibration folds it into the FLOP rate).
    hbm_gbps: float = 0.0
    # Fractions of peak that causal fused attention (forward + backward, 3x the forward's score FLOPs)
    # and the routed experts' large grouped FFNs (their activation included) reach (0: ``efficiency``).
    attention_efficiency: float = 0.0
    expert_efficiency: float = 0.0
    # Bytes a second of the optimizer step (fused AdamW); 0 leaves the step out.
    optimizer_gbps: float = 0.0
    # FP8 GEMMs' rate over bf16 GEMMs' (peak is 2x).
    fp8_speedup: float = 1.0
    # A grouped expert GEMM runs at rows / (rows + gemm_half_rows) x work / (work + gemm_half_work) of
    # the large-GEMM rate: rows, an expert's (a tile's rows left empty), and work, a rank's local experts x
    # rows x d_model x expert width (the down projection's multiply-adds; too few to fill the device and
    # hide the launches).
    # Measured on the device (benchmarks/expert_gemm_rates.py --fit); 0 leaves a factor out.
    gemm_half_rows: float = 0.0
    gemm_half_work: float = 0.0
    # Share of a scheduled collective's time hidden beside compute (FSDP2's prefetched gathers, tp's
    # backward gathers and reduce-scatters) that the compute beside it loses: the collective's kernels
    # hold some of the device's SMs meanwhile (derived in the cluster preset; 0 leaves it out).
    overlap_contention: float = 0.0
    # Fraction of an overlappable exchange (gradient reduce-scatter / all-gather, all-to-all with both
    # passes overlapped, cp exchanges) hidden under the compute that runs beside it (fitted).
    overlap: float = 0.0

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def flops(self) -> float:
        return self.peak_tflops * 1e12 * self.efficiency


@dataclass(frozen=True)
class Workload:
    """What one training step processes and how numbers are stored."""

    global_batch: int  # sequences per optimizer step, over all data ranks
    dtype_bytes: int = 2  # activations, communicated tokens and gathered weights (bf16: 2, fp32: 4)
    state_bytes: int = 16  # per parameter: fp32 master 4 + grad 4 + AdamW moments 8
    grad_bytes: int = 4  # the distributed optimizer's gradient buffer, reduced in it: fp32 4, bf16 2
    precision: str = "bf16"  # GEMM precision: bf16 | fp8 (fp8 GEMMs at cluster.fp8_speedup, if switched on)
    seq_len: int = 0  # tokens per sequence; 0 = model.context_length


@dataclass(frozen=True)
class Shape:
    """The attention and extra layers beyond ``ModelConfig`` (whose head size and head counts are the defaults):
    0 takes the model's value or leaves the feature out."""

    heads: int = 0  # query heads
    kv_heads: int = 0  # key/value heads
    head_dim: int = 0  # width of one head (Qwen3, gpt-oss: not d_model / heads)
    q_lora_rank: int = 0  # MLA: query down-projection rank (DeepSeek-V3: 1536)
    kv_lora_rank: int = 0  # MLA: compressed KV width (DeepSeek-V3: 512); > 0 turns MLA on
    qk_rope_dim: int = 0  # MLA: the rotary part of each query/key head (64)
    v_head_dim: int = 0  # MLA: value head width (128)
    window: int = 0  # sliding-window span of the windowed layers (gpt-oss: 128)
    window_layers: int = 0  # how many blocks attend within the window
    mtp_layers: int = 0  # multi-token-prediction blocks (DeepSeek-V3: 1), each a block and a head


@dataclass(frozen=True)
class ModelSpec:
    """A model to plan for: its config, its attention shape and its workload."""

    name: str
    model: ModelConfig
    moe: MoEConfig
    workload: Workload
    shape: Shape = Shape()

    @property
    def seq_len(self) -> int:
        return self.workload.seq_len or self.model.context_length


def _read_toml(kind: str, name: str) -> tuple[str, dict]:
    path = Path(name)
    if path.suffix == ".toml":
        if not path.is_file():
            raise OptionError(kind, f"no such file {name}")
        text, label = path.read_text(), path.stem
    else:
        folder = resources.files("moekit.configs").joinpath(f"{kind}s")
        names = sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))
        if name not in names:
            raise OptionError(kind, f"unknown preset {name!r} (choose from {', '.join(names)}, or a .toml file)")
        text, label = folder.joinpath(f"{name}.toml").read_text(), name
    try:
        return label, tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise OptionError(kind, f"invalid TOML: {err}", name) from None


def _build(kind: str, label: str, cls: type, values: dict, extra: dict | None = None):
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            raise ValueError(f"{kind} {label}: unknown field {key!r} (fields: {', '.join(sorted(known))})")
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    missing = [name for name in required if name not in values and name not in (extra or {})]
    if missing:
        raise ValueError(f"{kind} {label}: missing field(s) {', '.join(missing)}")
    return cls(**values, **(extra or {}))


def load_cluster(name: str, nodes: int | None = None) -> Cluster:
    """A cluster preset shipped in ``moekit/configs/clusters`` or a TOML file; fields as ``Cluster``.
    ``nodes`` replaces the preset's node count (one preset per system, any size)."""
    label, tree = _read_toml("cluster", name)
    if nodes is not None:
        tree["nodes"] = nodes
    cluster = _build("cluster", label, Cluster, tree, {"name": label})
    for f in dataclasses.fields(Cluster):
        value = getattr(cluster, f.name)
        if f.name == "name":
            continue
        optional = f.default is not dataclasses.MISSING  # an optional field may be 0
        if not (isinstance(value, int | float) and (value >= 0 if optional else value > 0)):
            raise ValueError(f"cluster {label}: {f.name}={value!r} must be a number {'>= 0' if optional else '> 0'}")
    if cluster.overlap > 1 or cluster.overlap_contention > 1 or (cluster.fp8_speedup and cluster.fp8_speedup < 1):
        raise ValueError(
            f"cluster {label}: overlap={cluster.overlap} and overlap_contention={cluster.overlap_contention} "
            "must be <= 1, fp8_speedup >= 1"
        )
    return cluster


def load_model(name: str, global_batch: int | None = None) -> ModelSpec:
    """A model preset (``[model]``, ``[moe]`` as in run presets, ``[shape]`` and ``[workload]``);
    ``global_batch`` replaces the workload's."""
    from moekit.runconfig import build

    label, tree = _read_toml("model", name)
    values = tree.pop("workload", {})
    if global_batch is not None:
        values["global_batch"] = global_batch
    workload = _build("model", label, Workload, values)
    if workload.global_batch <= 0:
        raise ValueError(f"model {label}: workload.global_batch={workload.global_batch} must be > 0")
    if workload.precision not in ("bf16", "fp8"):
        raise ValueError(f"model {label}: workload.precision={workload.precision!r} must be bf16 or fp8")
    shape = _build("model", label, Shape, tree.pop("shape", {}))
    try:
        cfg = build(tree)
    except ValueError as err:
        raise ValueError(f"model {label}: {err}") from None
    return ModelSpec(label, cfg.model, cfg.moe, workload, shape)
