"""Stage one of the planner: enumerate the layouts a cluster allows with the techniques switched on,
drop the ones that do not fit in memory and rank the rest by predicted step time; and what a step
time means in throughput (tokens/s/GPU, model TFLOP/s/GPU, MFU).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from moekit.errors import OptionError
from moekit.parallel.planner.comm import members_per_node
from moekit.parallel.planner.cost import Estimate, estimate
from moekit.parallel.planner.flops import _blocks, attention_dims, model_flops_per_token
from moekit.parallel.planner.layout import Candidate
from moekit.parallel.planner.memory import MEMORY_USABLE as _USABLE
from moekit.parallel.planner.memory import memory_bytes
from moekit.parallel.planner.presets import Cluster, ModelSpec


@dataclass(frozen=True)
class Techniques:
    """What the enumeration may use; all off is moekit's own runtime (FSDP every micro-batch, the
    chunked forward-only all-to-all overlap, plain 1F1B, no recomputation)."""

    # Distributed optimizer: gradients reduced once a step, beside compute, beside moekit's FSDP (each layout
    # both ways; without it FSDP alone).
    overlapped_grads: bool = False
    a2a_overlap: bool = False  # all-to-all beside another micro-batch's compute in both passes
    interleave: bool = False  # virtual pipeline stages (interleaved 1F1B, uneven stages allowed)
    recompute: bool = False  # the least recomputation (selective, mla_up_proj, experts, full) that fits
    sequence_parallel: bool = False  # sp with tp; tp and cp ranks join the expert groups
    fp8: bool = False  # fp8 GEMMs where the workload's precision is fp8
    expert_tp: bool = False  # each expert's FFN split over etp = tp ranks
    context_parallel: bool = False  # sequences split over cp ranks (ring attention), >= 2048 tokens each
    deduplicated_dispatch: bool = False  # across nodes, one copy of a token a destination node (DeepEP)
    weighted_activation: bool = False  # gate weights applied in the experts' activation (Megatron-Core)

    def names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name)]


MOEKIT = Techniques()
ALL = Techniques(*(True for _ in dataclasses.fields(Techniques)))


def parse_techniques(text: str) -> Techniques:
    """``all``, ``moekit`` (none) or a comma-separated list of ``Techniques`` fields."""
    if text in ("all", "moekit"):
        return ALL if text == "all" else MOEKIT
    known = {f.name for f in dataclasses.fields(Techniques)}
    names = [n.strip().replace("-", "_") for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise OptionError("techniques", f"unknown {', '.join(bad)} (all, moekit, or any of {', '.join(sorted(known))})")
    return Techniques(**{n: True for n in names})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(spec: ModelSpec, c: Cluster, tech: Techniques = MOEKIT) -> list[Candidate]:
    """Every layout the techniques allow for this model on this cluster (memory not yet considered;
    recomputation is chosen in ``plan``, the least that fits)."""
    m, e, w, sh = spec.model, spec.moe, spec.workload, spec.shape
    heads, kv_heads = sh.heads or m.n_heads, (sh.heads or m.n_heads) if sh.kv_lora_rank else sh.kv_heads or m.kv_heads
    n_blocks, _ = _blocks(spec)
    cps = [d for d in _divisors(8) if d == 1 or (spec.seq_len % (2 * d) == 0 and spec.seq_len // d >= 2048)]
    out = []
    for tp, cp, pp in itertools.product(
        _divisors(c.gpus_per_node), cps if tech.context_parallel else [1], _divisors(c.world)
    ):
        if c.world % (tp * cp * pp) or heads % tp or kv_heads % tp or m.d_ff % tp:
            continue
        if m.n_layers % pp if not tech.interleave else n_blocks < pp:
            continue
        dp = c.world // (tp * cp * pp)
        if w.global_batch % dp:
            continue
        per_rank = w.global_batch // dp
        vps = [1]
        if tech.interleave and pp > 1:
            vps = [v for v in _divisors(math.ceil(n_blocks / pp)) if n_blocks >= pp * v]
        expert_ranks = dp * cp * tp if tech.sequence_parallel else dp
        etps = sorted({1, tp}) if tech.expert_tp else [1]
        for vp, etp, ep in itertools.product(vps, etps, _divisors(e.num_experts)):
            if (
                expert_ranks % (ep * etp)
                or (ep * etp > 1 and not m.moe_layers())
                or (etp > 1 and not tech.sequence_parallel)
            ):
                continue
            for micro in _divisors(per_rank):
                if per_rank // micro > 16 or (pp > 1 and micro < pp) or (vp > 1 and micro % pp):
                    continue
                stride = etp if tech.sequence_parallel else tp
                local = members_per_node(ep, stride, c.gpus_per_node)
                forms = ("flat", "two_level") if 1 < local < ep else ("flat",)
                if tech.deduplicated_dispatch and local < ep:
                    forms = (*forms, "deduplicated")
                # Megatron's both-pass overlap needs virtual stages on a pipeline (check_both_pass_overlap).
                both = ("both",) if pp == 1 or vp > 1 else ("none",)
                overlaps = ("none",) if ep == 1 else both if tech.a2a_overlap else ("none", "forward")
                syncs = ("overlapped", "fsdp") if tech.overlapped_grads else ("fsdp",)
                for form, overlap, grad_sync in itertools.product(forms, overlaps, syncs):
                    out.append(
                        Candidate(
                            dp, ep, tp, pp, micro, form, overlap, cp=cp, etp=etp, vp=vp,
                            grad_sync=grad_sync,
                            sp=tech.sequence_parallel and tp > 1,
                            fp8=tech.fp8 and w.precision == "fp8",
                            weighted_activation=tech.weighted_activation,
                        )
                    )  # fmt: skip
    return out


def least_recompute(spec: ModelSpec, cand: Candidate, c: Cluster, tech: Techniques, imbalance: float) -> Candidate:
    """The candidate with the least recomputation that fits (recomputation only adds time); full
    recomputation without the both-pass all-to-all overlap, which Megatron refuses beside it."""
    if not tech.recompute:
        return cand
    modes = ("none", "selective", "mla_up_proj", "experts", "full")
    for mode in modes if attention_dims(spec)["latent"] else (m for m in modes if m != "mla_up_proj"):
        # Full recomputation turns the both-pass all-to-all overlap off (check_both_pass_overlap).
        overlap = "none" if mode == "full" and cand.overlap == "both" else cand.overlap
        fitted = dataclasses.replace(cand, recompute=mode, overlap=overlap)
        if memory_bytes(spec, fitted, imbalance) <= c.memory_gb * 1e9 * _USABLE:
            return fitted
    return cand


def plan(
    spec: ModelSpec, c: Cluster, top: int | None = 10, load_imbalance: float = 1.0, tech: Techniques = MOEKIT
) -> list[Estimate]:
    """Stage one: the ``top`` fastest layouts that fit (``None``: all of them), fastest first."""
    fitting = []
    for cand in candidates(spec, c, tech):
        est = estimate(spec, least_recompute(spec, cand, c, tech, load_imbalance), c, load_imbalance)
        if est.fits:
            fitting.append(est)
    ranked = sorted(fitting, key=lambda est: (est.step_s, est.memory_gb))
    return ranked if top is None else ranked[:top]


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float  # per device
    tflops: float  # model TFLOP/s per device (Megatron's count, flops.model_flops_per_token)
    mfu: float  # of the bf16 dense peak


def throughput(spec: ModelSpec, est: Estimate, c: Cluster) -> Throughput:
    """Tokens/s/GPU and model TFLOP/s/GPU of a step time, the global batch over all devices."""
    tokens = spec.workload.global_batch * spec.seq_len / est.step_s / c.world
    tflops = tokens * model_flops_per_token(spec) / 1e12
    return Throughput(tokens, tflops, tflops / c.peak_tflops)


def format_table(rows: Sequence[Estimate], spec: ModelSpec, c: Cluster) -> str:
    """The ranked table ``moekit plan`` prints."""
    head = f"{'#':>3} {'dp':>4} {'ep':>3} {'etp':>3} {'tp':>2} {'cp':>2} {'pp':>3} {'vp':>2} {'mbs':>3} {'mb':>4} "
    head += f"{'a2a':>12} {'ovl':>7} {'recomp':>11} {'grads':>10} {'step s':>8} {'compute':>8} {'a2a s':>7} "
    head += f"{'sync s':>7} {'tok/s/GPU':>9} {'TFLOP/s':>7} {'MFU':>5} {'mem GB':>6}"
    lines = [head]
    for i, est in enumerate(rows, 1):
        k, t = est.candidate, throughput(spec, est, c)
        mbs = spec.workload.global_batch // (k.dp * k.micro)
        lines.append(
            f"{i:>3} {k.dp:>4} {k.ep:>3} {k.etp:>3} {k.tp:>2} {k.cp:>2} {k.pp:>3} {k.vp:>2} {mbs:>3} {k.micro:>4} "
            f"{k.all_to_all:>12} {k.overlap:>7} {k.recompute:>11} {k.grad_sync:>10} {est.step_s:>8.3f} "
            f"{est.compute_s:>8.3f} {est.a2a_s:>7.3f} {est.sync_s:>7.3f} {t.tokens_per_s:>9.0f} {t.tflops:>7.0f} "
            f"{t.mfu:>5.1%} {est.memory_gb:>6.1f}"
        )
    return "\n".join(lines)
