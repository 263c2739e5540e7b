"""The planner against published large-scale MoE runs on DGX-H100 systems.

For each published run: predict tokens/s/GPU and model TFLOP/s/GPU for its layout (the planner's
step time with the run's precision, its recipe's token dispatcher, all-to-all overlap and recomputation,
the other techniques on), print them beside the published figures and their ratio, then where the planner ranks
the published layout among all the layouts it enumerates for that model, global batch, sequence length
and cluster size, with the gap between their predicted step times (a rank among layouts within a few
percent of each other means little), for each model the predicted spread of the planner's 5 fastest
layouts beside the published one's gap, and those 5 beside the published one, term by term (what makes
the planner prefer them), with what overlap hides of each exchange. A table row that contradicts
itself is taken from its recipe, the table's reading ranked beside it; two rows of one layout whose
published figures contradict their recipes are named.

The cluster's rates are measured on one H100 SXM, not fitted to these runs: large dense GEMMs, fp8
GEMMs, causal attention and elementwise work by benchmarks/device_rates.py, the grouped expert GEMMs
and their small-size slowdown by benchmarks/expert_gemm_rates.py (tables in benchmarks/measured/); the
few it cannot measure without a device are derived and labelled so in the preset.
One constant is fitted, by least squares on log tokens/s: ``overlap``, the share of an overlappable
exchange that the compute beside it hides. Every row's prediction, rank and error is out of sample,
by model: the overlap it uses is fitted on the other models' rows only (two rows of one model at the
same layout would otherwise be fitted on each other). Two rows of one layout whose published figures
contradict each other are predicted and reported but not fitted on. The overlap fitted on every other
row (printed first) is the DGX-H100 preset's.

Model TFLOP/s follow each source's own count (planner.model_flops_per_token's flags): a published
TFLOP/s figure is tokens/s times that count. Megatron-Core's Mixtral figure gives TFLOP/s only; its
tokens/s is derived from it under Megatron-Core v0.8's count (scores over the whole sequence).

    python benchmarks/planner_published.py [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import statistics
from dataclasses import dataclass
from typing import NamedTuple

from moekit.parallel import planner

MB = "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/5776a6d90b4dd8692902ab2eb581369484e19283/docs/performance-summary.md"
MCORE = "https://github.com/NVIDIA/Megatron-LM/blob/0b981f9c53059a21f868aa71ecc2868251aea5d0/megatron/core/transformer/moe/README.md"


@dataclass(frozen=True)
class Row:
    """One published run, as published (``None``: not in the source)."""

    label: str
    source: str
    version: str  # container or library version
    model: str  # moekit model preset
    precision: str
    gpus: int
    gbs: int
    mbs: int
    seq: int
    tp: int
    pp: int
    cp: int
    vp: int  # 1 where the table says n/a
    ep: int
    tokens: float | None  # tokens/s/GPU
    tflops: float  # model TFLOP/s/GPU
    count: tuple  # the source's FLOP count: (flag, value) pairs of planner.model_flops_per_token
    note: str = ""
    # How the run exchanges tokens, from its recipe (MB_RECIPES): "deduplicated" with DeepEP's dispatcher
    # (moe_flex_dispatcher_backend = deepep), else Megatron's flat all-to-all; both-pass overlap with
    # overlap_moe_expert_parallel_comm (moe_a2a_overlap), else none.
    dispatch: str = "flat"
    a2a_overlap: bool = False
    # Gate weights applied in the experts' activation (Megatron-Core's activation_func_with_probs, in the
    # Megatron-Core the NeMo containers ship); not verified for Megatron-Core v0.8, so left off there.
    weighted_activation: bool = True
    # The table's micro-batch size where it contradicts the table's other columns and the recipe's (which
    # ``mbs`` then holds): that reading is ranked too, and printed beside it.
    table_mbs: int = 0
    # The recipe's recomputation as the planner names it; "" where the source does not say (the least
    # that fits the planner's memory model is taken).
    recompute: str = ""


# The recipes behind the rows: 25.11 from the performance scripts at the commit MB documents
# (scripts/performance/configs/{qwen,gpt_oss,deepseek}/*_workload_base_configs.py: Qwen3 H100 moe_a2a_overlap
# True; gpt-oss H100 none; DeepSeek-V3 H100 moe_flex_dispatcher_backend "deepep", moe_a2a_overlap True);
# 25.09 from scripts/performance/run_script.py of that release's scripts (commit 5d194b9c1: DeepSeek-V3 on
# H100 DeepEP and overlap_moe_expert_parallel_comm; Qwen3 token-drop, no all-to-all overlap). Megatron-Core
# v0.8 (Mixtral) had neither.
MB_RECIPES = (
    "https://github.com/NVIDIA-NeMo/Megatron-Bridge/tree/5776a6d90b4dd8692902ab2eb581369484e19283/scripts/performance"
)
MB_COUNT = (("causal", True), ("windowed", False))  # Megatron-Bridge 25.09 / 25.11: no sliding-window term
ROWS = [
    Row("Mixtral-8x7B MCore v0.8", MCORE, "MCore v0.8", "mixtral-8x7b", "bf16", 64, 256, 1, 4096, 1, 4, 1, 8, 8,
        None, 438, (("causal", False),), "TFLOP/s only; layout from the README's v0.8 mapping table",
        weighted_activation=False),
    Row("GPT-OSS-120B 25.11", MB, "NeMo 25.11", "gpt-oss-120b", "bf16", 64, 512, 1, 4096, 1, 4, 1, 1, 8,
        5630, 153, (*MB_COUNT, ("gated", False)),
        "inconsistent row: the table's MBS 4 and GA 2 make 4 x 2 x DP 16 = 128 sequences, not its GBS 512 (they are "
        "its B200 row's, at PP 1); taken from the recipe: PP 4 on the base config's micro_batch_size 1 (GA 32); its "
        "recompute_modules (layernorm, moe_act) do nothing without recompute_granularity selective, which it leaves "
        "unset", table_mbs=4, recompute="none"),
    Row("Qwen3-30B-A3B 25.11", MB, "NeMo 25.11", "qwen3-30b-a3b", "fp8", 16, 512, 2, 4096, 1, 2, 1, 24, 8,
        5275, 121, MB_COUNT, "recipe says vp=12", a2a_overlap=True, recompute="none"),
    Row("Qwen3-235B-A22B 25.11", MB, "NeMo 25.11", "qwen3-235b-a22b", "fp8", 256, 2048, 1, 4096, 2, 8, 1, 4, 32,
        1575, 233, MB_COUNT, a2a_overlap=True, recompute="none"),
    Row("DeepSeek-V3 25.09", MB, "NeMo 25.09", "deepseek-v3", "fp8", 1024, 8192, 1, 4096, 2, 8, 1, 4, 64,
        1297, 338, MB_COUNT, "precision not in the table (its note is on fp8 scaling); dropless, MTP; recompute "
        "mla_up_proj and the 3 dense layers' MLPs (the latter not costed); gradient reduce not overlapped "
        "(overlap_grad_reduce false), predicted overlapped", dispatch="deduplicated", a2a_overlap=True,
        recompute="mla_up_proj"),
    Row("Qwen3-30B-A3B 25.09", MB, "NeMo 25.09", "qwen3-30b-a3b", "fp8", 16, 512, 2, 4096, 1, 2, 1, 24, 8,
        10494, 241, MB_COUNT, "precision not in the table; token-drop", recompute="none"),
    Row("Qwen3-235B-A22B 25.09", MB, "NeMo 25.09", "qwen3-235b-a22b", "fp8", 256, 2048, 1, 4096, 2, 8, 1, 4, 32,
        1204, 178, MB_COUNT, "precision not in the table; token-drop", recompute="none"),
]  # fmt: skip
GRID = {"overlap": [x / 20 for x in range(0, 21)]}  # the fitted constants and the values tried


@functools.cache
def _setup(row: Row) -> tuple[planner.ModelSpec, planner.Cluster, planner.Techniques]:
    spec = planner.load_model(row.model, global_batch=row.gbs)
    spec = dataclasses.replace(
        spec, workload=dataclasses.replace(spec.workload, seq_len=row.seq, precision=row.precision)
    )
    cluster = planner.load_cluster("dgx-h100", nodes=row.gpus // 8)
    return spec, cluster, planner.ALL


def published_candidate(row: Row, spec: planner.ModelSpec) -> planner.Candidate:
    """The run's layout with its recipe's all-to-all form and overlap, overlapped gradients, sp with tp."""
    dp = row.gpus // (row.tp * row.cp * row.pp)
    return planner.Candidate(
        dp, row.ep, row.tp, row.pp, row.gbs // (dp * row.mbs), row.dispatch, "both" if row.a2a_overlap else "none",
        cp=row.cp, vp=row.vp,
        grad_sync="overlapped", sp=row.tp > 1, fp8=row.precision == "fp8",
        weighted_activation=row.weighted_activation,
    )  # fmt: skip


def _published_tokens(row: Row, spec: planner.ModelSpec) -> float:
    return (
        row.tokens
        if row.tokens is not None
        else row.tflops * 1e12 / planner.model_flops_per_token(spec, **dict(row.count))
    )


def predict(row: Row, constants: dict) -> tuple[planner.Estimate, float]:
    """The planner's estimate for the published layout (its recipe's recomputation, else the least that
    fits) and its tokens/s/GPU."""
    spec, cluster, tech = _setup(row)
    cand = published_candidate(row, spec)
    if row.recompute:
        cand = dataclasses.replace(cand, recompute=row.recompute)
    else:
        cand = planner.least_recompute(spec, cand, cluster, tech, 1.0)
    cluster = dataclasses.replace(cluster, **constants)
    est = planner.estimate(spec, cand, cluster)
    return est, planner.throughput(spec, est, cluster).tokens_per_s


def fit(rows: list[Row]) -> dict:
    """The grid point minimising the squared log error of tokens/s over ``rows``."""
    published = [_published_tokens(r, _setup(r)[0]) for r in rows]
    best, best_err = {}, math.inf
    for values in itertools.product(*GRID.values()):
        constants = dict(zip(GRID, values, strict=True))
        err = sum(math.log(predict(r, constants)[1] / p) ** 2 for r, p in zip(rows, published, strict=True))
        if err < best_err:
            best, best_err = constants, err
    return best


class Ranked(NamedTuple):
    place: int  # the published layout's rank, at its fastest variant
    total: int  # layouts enumerated that fit
    gap: float  # its predicted step time over the planner's pick's
    top: list[planner.Estimate]  # the planner's 5 fastest layouts
    as_run: int  # its rank as its recipe runs it (token exchange, overlap, recomputation)
    gap_as_run: float


def rank(row: Row, constants: dict) -> Ranked:
    """Where the published layout ranks among the layouts enumerated for the run's global batch, sequence
    length and GPU count, distinct (tp, cp, pp, vp, ep, etp, micro-batches), each at its fastest variant:
    the published layout at its own fastest variant (what the planner would run on that layout), and as
    its recipe runs it (``predict``)."""
    spec, cluster, tech = _setup(row)
    cluster = dataclasses.replace(cluster, **constants)
    best: dict[tuple, planner.Estimate] = {}
    for est in planner.plan(spec, cluster, top=None, tech=tech):
        best.setdefault(est.candidate.layout, est)
    top = list(best.values())[:5]
    mine = predict(row, constants)[0]
    others = [est for layout, est in best.items() if layout != mine.candidate.layout]
    fastest = best.get(mine.candidate.layout, mine)  # not enumerated or not fitting: its own estimate
    floor = min(est.step_s for est in [*others, fastest, mine])
    return Ranked(
        1 + sum(est.step_s < fastest.step_s for est in others), len(others) + 1, fastest.step_s / floor, top,
        1 + sum(est.step_s < mine.step_s for est in others), mine.step_s / floor,
    )  # fmt: skip


TERMS = (
    "gemm",
    "gemm_shape",
    "gemm_experts",
    "attention",
    "elementwise",
    "head",
    "loss",
    "embedding",
    "a2a",
    "tp",
    "tp_contention",
    "cp",
    "pp",
    "pp_schedule",
    "pp_fill",
    "bubble",
    "fsdp",
    "fsdp_contention",
    "grads",
    "optimizer",
)
# Overlappable exchanges: what compute hides of them, beside the step.
HIDDEN = ("a2a", "tp", "cp", "pp", "fsdp", "grads")


def spread(top: list[planner.Estimate], gap: float) -> str:
    """The predicted spread of the planner's 5 fastest layouts beside the published layout's gap: where
    the published one sits within a few percent of the fastest, its rank among them means little."""
    fifth = top[-1].step_s / top[0].step_s - 1
    return f"5 fastest within {fifth:.1%} of the fastest, the published layout {gap - 1:+.1%}"


def explain(label: str, top: list[planner.Estimate], mine: planner.Estimate, gbs: int) -> None:
    """The planner's 5 fastest layouts beside the published one, step time by term (seconds a step), then
    the seconds a step that overlap hides of each overlappable exchange (``h:``, not in the step); then
    what the published layout pays over the pick, term by term (what keeps it out of the top)."""
    print(f"\n{label}: the planner's 5 fastest layouts and the published one, seconds a step by term")
    print(f"{'':>4} {'tp':>2} {'cp':>2} {'pp':>2} {'vp':>2} {'ep':>3} {'etp':>3} {'mbs':>3} {'recomp':>11} "
          f"{'grads':>10} {'mem GB':>6} {'step':>6} " + " ".join(f"{t[:8]:>8}" for t in TERMS)
          + " " + " ".join(f"{'h:' + t:>7}" for t in HIDDEN))  # fmt: skip
    for tag, est in [*((str(i), e) for i, e in enumerate(top, 1)), ("pub", mine)]:
        k = est.candidate
        print(
            f"{tag:>4} {k.tp:>2} {k.cp:>2} {k.pp:>2} {k.vp:>2} {k.ep:>3} {k.etp:>3} {gbs // (k.dp * k.micro):>3} "
            f"{k.recompute:>11} {k.grad_sync:>10} {est.memory_gb:>6.1f} {est.step_s:>6.2f} "
            + " ".join(f"{est.terms.get(t, 0.0):>8.3f}" for t in TERMS)
            + " "
            + " ".join(f"{est.hidden.get(t, 0.0):>7.3f}" for t in HIDDEN)
        )
    over = {t: mine.terms.get(t, 0.0) - top[0].terms.get(t, 0.0) for t in TERMS}
    print(f"{'pub - 1':>8} {'':>56} {mine.step_s - top[0].step_s:>6.2f} " + " ".join(f"{over[t]:>8.3f}" for t in TERMS))
    worst = sorted((t for t in TERMS if over[t] > 0), key=lambda t: -over[t])[:3]
    excess = ", ".join(f"{t} +{over[t]:.2f} s" for t in worst) or "none (it is the pick)"
    print(f"  the published layout's largest excess over the pick: {excess}")


def inconsistent_pairs(rows: list[Row]) -> list[tuple[Row, Row]]:
    """(slower, faster) rows of one model at one layout and dispatcher whose published tokens/s are more
    than 30% apart although their recipes are the same, or although the slower one overlaps its
    all-to-alls and the faster one does not: no one cost model predicts both, so neither is fitted on."""
    pairs = []
    for a, b in itertools.combinations(rows, 2):
        slow, fast = sorted((a, b), key=lambda r: _published_tokens(r, _setup(r)[0]))
        layout = (a.gpus, a.gbs, a.mbs, a.seq, a.tp, a.pp, a.cp, a.vp, a.ep, a.precision, a.dispatch)
        same = a.model == b.model and layout == (b.gpus, b.gbs, b.mbs, b.seq, b.tp, b.pp, b.cp, b.vp, b.ep,
                                                 b.precision, b.dispatch)  # fmt: skip
        faster = _published_tokens(fast, _setup(fast)[0]) > 1.3 * _published_tokens(slow, _setup(slow)[0])
        if same and faster and slow.a2a_overlap >= fast.a2a_overlap:
            pairs.append((slow, fast))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON on the last line")
    args = parser.parse_args()
    contradicting = inconsistent_pairs(ROWS)
    fitted = [r for r in ROWS if not any(r in pair for pair in contradicting)]
    constants = fit(fitted)
    print(f"fitted on {len(fitted)} rows (the preset's):", ", ".join(f"{k}={v:g}" for k, v in constants.items()))
    held_out = {m: fit([r for r in fitted if r.model != m]) for m in dict.fromkeys(r.model for r in ROWS)}
    for model, held in held_out.items():
        print(f"  fitted without {model}:", ", ".join(f"{k}={v:g}" for k, v in held.items()))
    head = f"{'run':<24} {'prec':<4} {'GPUs':>4} {'tp':>2} {'pp':>2} {'vp':>2} {'ep':>2} {'mbs':>3} "
    head += f"{'recomp':>11} {'mem GB':>6} {'tok/s pred':>10} {'pub':>6} {'ratio':>5} {'TFLOP/s pred':>12} {'pub':>4} "
    head += f"{'rank':>9} {'gap':>5} {'as run':>7} {'gap':>6}"
    print(head)
    out, explained, spreads = [], {}, {}
    for row in ROWS:
        spec = _setup(row)[0]
        est, tokens = predict(row, held_out[row.model])
        published = _published_tokens(row, spec)
        tflops = tokens * planner.model_flops_per_token(spec, **dict(row.count)) / 1e12
        ranked = rank(row, held_out[row.model])
        place, total, gap, top = ranked.place, ranked.total, ranked.gap, ranked.top
        pick = top[0].candidate
        if (row.model, row.gpus) not in explained:
            explained[(row.model, row.gpus)] = (row.label, top, est, row.gbs)
            spreads[row.model] = spread(top, gap)
        ratio = tokens / published
        rec = {
            "run": row.label, "source": row.source, "version": row.version, "note": row.note,
            "layout": {"gpus": row.gpus, "tp": row.tp, "pp": row.pp, "cp": row.cp, "vp": row.vp, "ep": row.ep,
                       "gbs": row.gbs, "mbs": row.mbs, "seq": row.seq, "precision": row.precision},
            "dispatch": row.dispatch, "a2a_overlap": row.a2a_overlap,
            "recompute": est.candidate.recompute, "memory_gb": est.memory_gb, "fits": est.fits,
            "tokens_pred": tokens, "tokens_pub": published, "tokens_derived": row.tokens is None,
            "tflops_pred": tflops, "tflops_pub": row.tflops, "ratio": ratio, "rank": place, "layouts": total,
            "gap": gap, "rank_as_run": ranked.as_run, "gap_as_run": ranked.gap_as_run,
            "top5_spread": top[-1].step_s / top[0].step_s - 1, "pick": dataclasses.asdict(pick),
        }  # fmt: skip
        out.append(rec)
        print(
            f"{row.label:<24} {row.precision:<4} {row.gpus:>4} {row.tp:>2} "
            f"{row.pp:>2} "
            f"{row.vp:>2} {row.ep:>2} {row.mbs:>3} {est.candidate.recompute:>11} "
            f"{est.memory_gb:>5.1f}{' ' if est.fits else '!'} {tokens:>10.0f} "
            f"{published:>6.0f}{'*' if row.tokens is None else ' '}{ratio:>5.2f} {tflops:>12.0f} {row.tflops:>4.0f} "
            f"{place:>4}/{total:<4} {gap - 1:>5.1%} {ranked.as_run:>7} {ranked.gap_as_run - 1:>6.1%}"
        )
    ratios = [r["ratio"] for r in out]
    summary = {
        "abs_err_median": statistics.median(abs(x - 1) for x in ratios),
        "within_30pct": sum(abs(x - 1) <= 0.3 for x in ratios),
        "rows": len(out),
        "top5": sorted({r["run"].split()[0] for r in out if r["rank"] <= 5}),
        "top5_as_run": sorted({r["run"].split()[0] for r in out if r["rank_as_run"] <= 5}),
    }
    for row in ROWS:
        if row.table_mbs:
            table_row = dataclasses.replace(row, mbs=row.table_mbs, recompute="")  # the least that fits
            place, total, gap = rank(table_row, held_out[row.model])[:3]
            est, tokens = predict(table_row, held_out[row.model])
            ratio = tokens / _published_tokens(row, _setup(row)[0])
            print(
                f"  {row.label} as its table reads (mbs {row.table_mbs}): {est.candidate.recompute}, "
                f"{est.memory_gb:.1f} GB, {tokens:.0f} tokens/s/GPU ({ratio:.2f} of published), "
                f"rank {place}/{total}, gap {gap - 1:.1%}"
            )
    print("* derived from the published TFLOP/s under the source's FLOP count")
    if not all(r["fits"] for r in out):
        print("! over the planner's usable memory (its recipe's recomputation, which the run fitted)")
    print("rank, gap: the published layout at its fastest variant; as run: at its recipe's token exchange, overlap")
    print("and recomputation; gap: its predicted step time over the planner's pick's, minus 1")
    print(
        f"out of sample (constants fitted without the row's model): median |error| {summary['abs_err_median']:.0%}, "
        f"{summary['within_30pct']} of {len(out)} rows within 30%; published layout in the planner's top 5 for "
        f"{len(summary['top5'])} of {len(held_out)} models ({', '.join(summary['top5']) or 'none'}); as run, for "
        f"{len(summary['top5_as_run'])} ({', '.join(summary['top5_as_run']) or 'none'})"
    )
    print("predicted spread by model (a rank among layouts this close means little):")
    for model, text in spreads.items():
        print(f"  {model}: {text}")
    for r in out:
        if r["note"]:
            print(f"  {r['run']}: {r['note']}")
    for slow, fast in contradicting:
        on = {True: "on", False: "off"}
        ratio = _published_tokens(fast, _setup(fast)[0]) / _published_tokens(slow, _setup(slow)[0])
        print(
            f"  inconsistent pair, not fitted on: {slow.label} (all-to-all overlap {on[slow.a2a_overlap]}) and "
            f"{fast.label} ({on[fast.a2a_overlap]}) publish one layout {ratio:.2f}x apart, the slower with no less "
            "overlap: no one cost model predicts both"
        )
    for r in out:
        if r["rank"] > 5:
            p = r["pick"]
            print(
                f"  {r['run']}: planner's pick tp{p['tp']} cp{p['cp']} pp{p['pp']} vp{p['vp']} ep{p['ep']} "
                f"etp{p['etp']} micro{p['micro']} {p['recompute']}"
            )
    for args_ in explained.values():
        explain(*args_)
    if args.json:
        print(json.dumps({"constants": constants, "held_out_constants": held_out, "rows": out, **summary}))


if __name__ == "__main__":
    main()
