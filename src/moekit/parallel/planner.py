"""The auto-parallel planner (SmartMoE's two stages): a cost model over numbers only, no process group.

Stage one enumerates dp x ep x tp x pp x micro-batches x (flat | two-level all-to-all) x overlap for a
cluster, drops the layouts that do not fit in memory and ranks the rest by predicted step time.
Stage two re-scores candidates with measured expert loads, with and without load-aware placement
(``parallel/placement.py``, the code a live run uses), and says whether switching pays.

Units: seconds, bytes, FLOPs. The model follows moekit's mesh (``pp, dp, ep_node, ep_local, tp``,
tp innermost), so a group of ``n`` ranks with stride ``s`` has ``min(n, G // s)`` members per node of
``G`` devices. Collective times are alpha-beta: a latency per message plus bytes over the link's
bandwidth, with the slower (inter-node) link for traffic that leaves the node. Compute is FLOPs over
the device's effective rate plus a fixed cost per block pass, and FSDP pays a fixed cost per
collective (both measured, not guessed: ``benchmarks/planner_calibration.py``), so layouts of many
small micro-batches rank as slow as they run.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from moekit.config import ModelConfig, MoEConfig
from moekit.parallel.placement import imbalance, place_experts, rank_loads

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MEMORY_USABLE = 0.9  # NOTE: workspace, fragmentation and the allocator's caches take the rest
OVERLAP_CHUNKS = 2  # chunks of an overlapped dispatch (parallel.overlap_chunks)


@dataclass(frozen=True)
class Cluster:
    """Devices and links, per device (bandwidths are what one device can send at once)."""

    name: str
    nodes: int  # machines
    gpus_per_node: int  # devices per machine sharing the fast intra-node link
    peak_tflops: float  # dense matmul peak per device in the training dtype
    efficiency: float  # fraction of peak reached by real layers (MFU of the GEMMs)
    memory_gb: float  # device memory
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


@dataclass(frozen=True)
class ModelSpec:
    """A model to plan for: its config and its workload."""

    name: str
    model: ModelConfig
    moe: MoEConfig
    workload: Workload


@dataclass(frozen=True)
class Candidate:
    dp: int
    ep: int
    tp: int
    pp: int
    micro: int  # micro-batches per step (pipeline micro-batches, or gradient accumulation when pp = 1)
    all_to_all: str  # flat | two_level
    overlap: bool  # dispatch in chunks overlapped with the expert GEMMs


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    step_s: float
    compute_s: float  # GEMMs, with the pipeline bubble
    a2a_s: float  # expert-parallel exchanges on the critical path
    sync_s: float  # FSDP all-gathers and reduce-scatters, tp all-reduces and pipeline sends
    memory_gb: float  # peak per device
    fits: bool


# --- reading presets --------------------------------------------------------------------------------


def _read_toml(kind: str, name: str) -> tuple[str, dict]:
    path = Path(name)
    if path.suffix == ".toml":
        if not path.is_file():
            raise ValueError(f"--{kind}: no such file {name}")
        text, label = path.read_text(), path.stem
    else:
        folder = resources.files("moekit.configs").joinpath(f"{kind}s")
        names = sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))
        if name not in names:
            raise ValueError(f"--{kind}: unknown preset {name!r} (choose from {', '.join(names)}, or a .toml file)")
        text, label = folder.joinpath(f"{name}.toml").read_text(), name
    try:
        return label, tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"--{kind} {name}: invalid TOML: {err}") from None


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


def load_cluster(name: str) -> Cluster:
    """A cluster preset shipped in ``moekit/configs/clusters`` or a TOML file; fields as ``Cluster``."""
    label, tree = _read_toml("cluster", name)
    cluster = _build("cluster", label, Cluster, tree, {"name": label})
    for f in dataclasses.fields(Cluster):
        value = getattr(cluster, f.name)
        if f.name == "name":
            continue
        optional = f.default is not dataclasses.MISSING  # an optional field may be 0
        if not (isinstance(value, int | float) and (value >= 0 if optional else value > 0)):
            raise ValueError(f"cluster {label}: {f.name}={value!r} must be a number {'>= 0' if optional else '> 0'}")
    return cluster


def load_model(name: str) -> ModelSpec:
    """A model preset (``[model]``, ``[moe]`` as in run presets, and ``[workload]``)."""
    from moekit.runconfig import build

    label, tree = _read_toml("model", name)
    workload = _build("model", label, Workload, tree.pop("workload", {}))
    if workload.global_batch <= 0:
        raise ValueError(f"model {label}: workload.global_batch={workload.global_batch} must be > 0")
    try:
        cfg = build(tree)
    except ValueError as err:
        raise ValueError(f"model {label}: {err}") from None
    return ModelSpec(label, cfg.model, cfg.moe, workload)


# --- the cost model's pieces ------------------------------------------------------------------------


def _mult(activation: str) -> int:
    """Weight matrices of one FFN: (clamped) SwiGLU has gate, up and down; GELU up and down."""
    return 2 if activation == "gelu" else 3


def layer_flops(spec: ModelSpec, moe_layer: bool) -> dict[str, float]:
    """Forward FLOPs per token of one block: attention (projections + causal scores), dense MLP or
    the MoE layer's router, routed experts (k of them) and shared experts."""
    m, e = spec.model, spec.moe
    D, hd = m.d_model, m.head_size
    attn = 2 * D * hd * (2 * m.n_heads + 2 * m.kv_heads) + 2 * m.context_length * D
    if not moe_layer:
        return {"attention": attn, "dense": 2 * _mult(m.mlp_activation) * D * m.d_ff, "experts": 0.0}
    ffn = 2 * _mult(e.activation) * D * e.d_ff
    shared = 2 * _mult(e.activation) * D * e.shared_hidden
    return {"attention": attn, "dense": 2 * D * e.num_experts + shared, "experts": e.top_k * ffn}


def param_counts(spec: ModelSpec) -> tuple[float, float]:
    """(non-expert parameters, routed-expert parameters) of the whole model."""
    m, e = spec.model, spec.moe
    D, hd = m.d_model, m.head_size
    attn = D * hd * (2 * m.n_heads + 2 * m.kv_heads) + 2 * D
    moe = set(m.moe_layers())
    ffn = _mult(e.activation) * D * e.d_ff
    shared = _mult(e.activation) * D * e.shared_hidden
    dense = sum(
        (D * e.num_experts + shared) if i in moe else _mult(m.mlp_activation) * D * m.d_ff for i in range(m.n_layers)
    )
    embed = m.vocab_size * D * (1 if m.tie_embeddings else 2)
    return m.n_layers * attn + dense + embed + D, len(moe) * e.num_experts * ffn  # + D: the final norm


def members_per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """How many ranks of a mesh group (``size`` ranks, ``stride`` apart) share a node."""
    return 1 if stride >= gpus_per_node else max(1, min(size, gpus_per_node // stride))


def all_to_all_time(nbytes: float, size: int, stride: int, c: Cluster, two_level: bool = False) -> float:
    """One exchange in which each rank holds ``nbytes`` spread evenly over the ``size`` ranks."""
    if size == 1:
        return 0.0
    local = members_per_node(size, stride, c.gpus_per_node)
    a_in, a_out = c.intra_latency_us * 1e-6, c.inter_latency_us * 1e-6
    b_in, b_out = c.intra_gbps * 1e9, c.inter_gbps * 1e9
    if two_level and 1 < local < size:
        nodes = size // local
        within = (local - 1) * a_in + nbytes * (local - 1) / local / b_in
        across = (nodes - 1) * a_out + nbytes * (nodes - 1) / nodes / b_out
        return within + across
    latency = (local - 1) * a_in + (size - local) * a_out
    return latency + max(nbytes * (local - 1) / size / b_in, nbytes * (size - local) / size / b_out)


def ring_time(nbytes: float, size: int, stride: int, c: Cluster, passes: float = 2.0) -> float:
    """A ring collective over ``nbytes``: all-reduce is 2 passes, reduce-scatter or all-gather 1."""
    if size == 1:
        return 0.0
    local = members_per_node(size, stride, c.gpus_per_node)
    alpha, bw = (c.intra_latency_us, c.intra_gbps) if local == size else (c.inter_latency_us, c.inter_gbps)
    return passes * ((size - 1) * alpha * 1e-6 + nbytes * (size - 1) / size / (bw * 1e9))


def p2p_time(nbytes: float, stride: int, c: Cluster) -> float:
    """One pipeline send to the next stage (``stride`` ranks away)."""
    same_node = stride < c.gpus_per_node
    alpha, bw = (c.intra_latency_us, c.intra_gbps) if same_node else (c.inter_latency_us, c.inter_gbps)
    return alpha * 1e-6 + nbytes / (bw * 1e9)


def memory_bytes(spec: ModelSpec, cand: Candidate, load_imbalance: float = 1.0) -> float:
    """Peak bytes per device: sharded training state, two gathered blocks and the live activations."""
    m, e, w = spec.model, spec.moe, spec.workload
    D, hd = m.d_model, m.head_size
    dense, experts = param_counts(spec)
    state = dense * w.state_bytes / (cand.tp * cand.pp * cand.dp * cand.ep) + experts * w.state_bytes / (
        cand.ep * cand.pp * cand.dp
    )
    gathered = 2 * dense / m.n_layers / cand.tp * w.dtype_bytes  # FSDP: the block running and the next
    attn = 2 * D + (2 * D + 2 * m.kv_heads * hd) / cand.tp
    moe = D + e.top_k * load_imbalance * (2 * D + (_mult(e.activation) + 1) * e.d_ff)
    mlp = D + (_mult(m.mlp_activation) + 1) * m.d_ff / cand.tp
    n_moe = len(m.moe_layers())
    per_token = (m.n_layers * attn + n_moe * moe + (m.n_layers - n_moe) * mlp) / cand.pp * w.dtype_bytes
    tokens = micro_tokens(spec, cand)
    in_flight = min(cand.micro, cand.pp) if cand.pp > 1 else 1
    logits = tokens * m.vocab_size * 4  # fp32 logits for the loss
    return state + gathered + per_token * tokens * in_flight + logits


def micro_tokens(spec: ModelSpec, cand: Candidate) -> float:
    return spec.workload.global_batch * spec.model.context_length / (cand.dp * cand.ep * cand.micro)


def training_flops_per_token(spec: ModelSpec) -> tuple[float, float]:
    """(FLOPs outside the routed experts, FLOPs of the routed experts) per token of one training
    step of the whole model: 3x the forward (the backward is two GEMMs per forward GEMM), the output
    head included."""
    m = spec.model
    moe = set(m.moe_layers())
    per_layer = [layer_flops(spec, i in moe) for i in range(m.n_layers)]
    dense = sum(f["attention"] + f["dense"] for f in per_layer) + 2 * m.d_model * m.vocab_size
    return 3 * dense, 3 * sum(f["experts"] for f in per_layer)


def fsdp_collectives(spec: ModelSpec, cand: Candidate, c: Cluster) -> tuple[float, float]:
    """FSDP on one micro-batch of a pipeline stage: (alpha-beta seconds, number of collectives).

    Every micro-batch, each unit (a block, and the root) all-gathers its shard before the forward
    and again before the backward, then reduce-scatters its gradient; sharded experts do the same
    over dp, once per MoE layer even when overlapped dispatch computes them chunk by chunk."""
    m, w = spec.model, spec.workload
    dense_p, expert_p = param_counts(spec)
    n_moe = len(m.moe_layers())
    units = m.n_layers / cand.pp + 1
    seconds = count = 0.0
    if cand.dp * cand.ep > 1:
        unit_bytes = dense_p / (cand.tp * cand.pp) * w.dtype_bytes / units
        seconds += 3 * units * ring_time(unit_bytes, cand.dp * cand.ep, cand.tp, c, passes=1)
        count += 3 * units
    if n_moe and cand.dp > 1:
        layer_bytes = expert_p / (cand.ep * n_moe) * w.dtype_bytes
        seconds += 3 * n_moe / cand.pp * ring_time(layer_bytes, cand.dp, cand.tp * cand.ep, c, passes=1)
        count += 3 * n_moe / cand.pp
    return seconds, count


def estimate(spec: ModelSpec, cand: Candidate, c: Cluster, load_imbalance: float = 1.0) -> Estimate:
    """Predicted step time and memory of one layout; ``load_imbalance`` is the max/mean rank load of
    the experts (1.0 balanced), which slows the busiest rank's GEMMs and exchanges."""
    m, e, w = spec.model, spec.moe, spec.workload
    tokens = micro_tokens(spec, cand)
    n_moe = len(m.moe_layers())
    layers = m.n_layers / cand.pp  # blocks per pipeline stage
    dense_f, expert_f = training_flops_per_token(spec)
    # Per micro-batch and pipeline stage (experts are split over ep, not tp).
    dense_s = tokens * dense_f / (cand.tp * cand.pp * c.flops) + layers * c.pass_overhead_us * 1e-6
    expert_s = tokens * expert_f * load_imbalance / cand.pp / c.flops
    rows_bytes = tokens * e.top_k * m.d_model * w.dtype_bytes * load_imbalance
    chunks = OVERLAP_CHUNKS if cand.overlap else 1
    one = chunks * all_to_all_time(rows_bytes / chunks, cand.ep, cand.tp, c, cand.all_to_all == "two_level")
    exchanges = 2 * one * n_moe / cand.pp  # dispatch and combine of every MoE layer: the forward's, or the backward's
    if cand.overlap:
        # NOTE: the dispatcher overlaps only the forward's exchanges with the forward's expert GEMMs (a
        # third of their FLOPs); the backward's exchanges run in the autograd thread, fully exposed.
        forward_s = expert_s / 3
        moe_s = max(exchanges, forward_s) + min(exchanges, forward_s) / chunks + exchanges + expert_s - forward_s
    else:
        moe_s = 2 * exchanges + expert_s
    act = tokens * m.d_model * w.dtype_bytes
    tp_s = 4 * layers * ring_time(act, cand.tp, 1, c)
    p2p = 2 * p2p_time(act, cand.tp * cand.ep * cand.dp, c) if cand.pp > 1 else 0.0
    wire, collectives = fsdp_collectives(spec, cand, c)
    fsdp = wire + collectives * c.fsdp_overhead_us * 1e-6
    slots = cand.micro + cand.pp - 1  # the pipeline bubble: pp - 1 idle slots per step
    mem = memory_bytes(spec, cand, load_imbalance)
    return Estimate(
        cand,
        step_s=slots * (dense_s + moe_s + tp_s + p2p + fsdp),
        compute_s=slots * (dense_s + expert_s),
        a2a_s=slots * (moe_s - expert_s),
        sync_s=slots * (tp_s + p2p + fsdp),
        memory_gb=mem / 1e9,
        fits=mem <= c.memory_gb * 1e9 * MEMORY_USABLE,
    )


# --- stage one: enumerate and rank ------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(spec: ModelSpec, c: Cluster) -> list[Candidate]:
    """Every layout moekit can run for this model on this cluster (memory not yet considered)."""
    m, e, w = spec.model, spec.moe, spec.workload
    out = []
    for tp, ep, pp in itertools.product(_divisors(c.world), repeat=3):
        if c.world % (tp * ep * pp) or tp > c.gpus_per_node or m.kv_heads % tp or m.d_ff % tp:
            continue
        if (ep > 1 and not m.moe_layers()) or e.num_experts % ep or m.n_layers % pp:
            continue
        dp = c.world // (tp * ep * pp)
        if w.global_batch % (dp * ep):
            continue
        per_rank = w.global_batch // (dp * ep)
        for micro in (k for k in _divisors(per_rank) if k <= 64 and (pp == 1 or k >= pp)):
            local = members_per_node(ep, tp, c.gpus_per_node)
            forms = ("flat", "two_level") if 1 < local < ep else ("flat",)
            for form, overlap in itertools.product(forms, (False, True) if ep > 1 else (False,)):
                out.append(Candidate(dp, ep, tp, pp, micro, form, overlap))
    return out


def plan(spec: ModelSpec, c: Cluster, top: int = 10, load_imbalance: float = 1.0) -> list[Estimate]:
    """Stage one: the ``top`` fastest layouts that fit, fastest first."""
    fitting = [est for cand in candidates(spec, c) if (est := estimate(spec, cand, c, load_imbalance)).fits]
    return sorted(fitting, key=lambda est: (est.step_s, est.memory_gb))[:top]


# --- stage two: re-score with measured loads --------------------------------------------------------


@dataclass(frozen=True)
class Rescored:
    estimate: Estimate  # with the measured loads and plain expert parallelism
    placed: Estimate  # with the measured loads after load-aware placement
    switch_s: float  # one re-placement: expert weights and optimizer state moved
    switch: bool  # the time saved over ``remaining_steps`` pays for the re-placement


def layout_imbalance(loads: Sequence[Sequence[float]], ep: int, placed: bool) -> tuple[float, float]:
    """(mean over layers of max/mean rank load, fraction of experts moved) with or without placement."""
    if ep == 1:
        return 1.0, 0.0
    factors, moved = [], []
    for layer in loads:
        if placed:
            p = place_experts(layer, ep)
            factors.append(p.after)
            moved.append(p.moves / len(layer))
        else:
            factors.append(imbalance(rank_loads(layer, tuple(range(len(layer))), ep)))
    return sum(factors) / len(factors), (sum(moved) / len(moved) if moved else 0.0)


def rescore(
    spec: ModelSpec, c: Cluster, rows: list[Estimate], loads: Sequence[Sequence[float]], remaining_steps: int
) -> list[Rescored]:
    """Stage two: re-score stage one's candidates with measured per-layer expert loads."""
    _, expert_p = param_counts(spec)
    out = []
    for row in rows:
        cand = row.candidate
        plain_f, _ = layout_imbalance(loads, cand.ep, placed=False)
        placed_f, moved = layout_imbalance(loads, cand.ep, placed=True)
        plain, placed = estimate(spec, cand, c, plain_f), estimate(spec, cand, c, placed_f)
        nbytes = moved * expert_p / (cand.ep * cand.pp * cand.dp) * (spec.workload.state_bytes - 4)
        switch_s = all_to_all_time(nbytes, cand.ep, cand.tp, c)
        switch = (plain.step_s - placed.step_s) * remaining_steps > switch_s
        out.append(Rescored(plain, placed, switch_s, switch))
    return sorted(out, key=lambda r: min(r.estimate.step_s, r.placed.step_s))


def format_table(rows: Sequence[Estimate]) -> str:
    """The ranked table ``moekit plan`` prints."""
    head = f"{'#':>3} {'dp':>4} {'ep':>3} {'tp':>3} {'pp':>3} {'mb':>3} {'a2a':>9} {'ovl':>3} "
    head += f"{'step s':>9} {'compute':>9} {'a2a s':>9} {'sync s':>9} {'mem GB':>7}"
    lines = [head]
    for i, est in enumerate(rows, 1):
        c = est.candidate
        lines.append(
            f"{i:>3} {c.dp:>4} {c.ep:>3} {c.tp:>3} {c.pp:>3} {c.micro:>3} {c.all_to_all:>9} "
            f"{'yes' if c.overlap else 'no':>3} {est.step_s:>9.4f} {est.compute_s:>9.4f} {est.a2a_s:>9.4f} "
            f"{est.sync_s:>9.4f} {est.memory_gb:>7.1f}"
        )
    return "\n".join(lines)
