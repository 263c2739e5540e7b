"""What each of the planner's schedule terms changes in the published rows of planner_published.py.

Starting from the cost model without them (each replaced by what the planner charged before it), the
terms are switched back on one at a time, in order: FSDP enumerated beside the distributed optimizer
(with its prefetch), the first and last stages' own work (embedding gradient, loss), the pipeline's
fixed cost a chunk and fill sends, the dense GEMMs at their shapes, tp's backward collectives beside
their GEMMs. After each: every row's predicted over published tokens/s and the published layout's
rank, out of sample by model as planner_published.py computes them (the overlap refitted without the
row's model), the median error, the rows within 30%, the models whose published layout is in the top 5,
and each model's predicted spread of its 5 fastest layouts beside the published layout's gap. The
first line reproduces the cost model before the terms; the last is the planner as it is.

    python benchmarks/planner_terms.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import planner_published as published  # noqa: E402

from moekit.parallel.planner import cost, search, tensor  # noqa: E402
from moekit.parallel.planner.comm import ring_time  # noqa: E402
from moekit.parallel.planner.layout import RECOMPUTE_GEMMS, stage_blocks  # noqa: E402

ON = {
    "fsdp": search.candidates,
    "ends": (cost.loss_seconds, cost.embedding_seconds),
    "pipeline": cost.pipeline_fixed,
    "shapes": tensor.shape_factor,
    "tp": cost.tp_exchanges,
}
STEPS = [
    ("without the terms", ()),
    ("+ FSDP enumerated, prefetched", ("fsdp",)),
    ("+ embedding gradient, loss", ("fsdp", "ends")),
    ("+ pp schedule, pp fill", ("fsdp", "ends", "pipeline")),
    ("+ GEMM shapes", ("fsdp", "ends", "pipeline", "shapes")),
    ("+ tp backward overlap", ("fsdp", "ends", "pipeline", "shapes", "tp")),
]


def _exposed_tp(spec, cand, c, tokens, opening):
    """The tp exchanges as charged before: two all-reduces a block each pass, all exposed."""
    if cand.tp == 1:
        return 0.0, 0.0
    passes = 2 + RECOMPUTE_GEMMS[cand.recompute][0]
    nbytes = tokens * spec.model.d_model * spec.workload.dtype_bytes
    return 2 * passes * stage_blocks(spec, cand)[0] * ring_time(nbytes, cand.tp, 1, c), 0.0


def _without_fsdp(spec, c, tech=search.MOEKIT):
    return [k for k in ON["fsdp"](spec, c, tech) if not (tech.overlapped_grads and k.grad_sync == "fsdp")]


def switch(on: tuple[str, ...]) -> None:
    """The named terms as they are, the others as the planner charged them before."""
    search.candidates = ON["fsdp"] if "fsdp" in on else _without_fsdp
    cost.loss_seconds, cost.embedding_seconds = ON["ends"] if "ends" in on else (lambda *a: 0.0,) * 2
    cost.pipeline_fixed = ON["pipeline"] if "pipeline" in on else (lambda *a: (0.0, 0.0))
    tensor.shape_factor = ON["shapes"] if "shapes" in on else (lambda work, c: 1.0)
    cost.tp_exchanges = ON["tp"] if "tp" in on else _exposed_tp


def held_out() -> tuple[list[float], list[published.Ranked]]:
    """Every row's predicted over published tokens/s and its ranking, out of sample by model."""
    contradicting = published.inconsistent_pairs(published.ROWS)
    fitted = [r for r in published.ROWS if not any(r in pair for pair in contradicting)]
    models = dict.fromkeys(r.model for r in published.ROWS)
    held = {m: published.fit([r for r in fitted if r.model != m]) for m in models}
    ratios, ranks = [], []
    for row in published.ROWS:
        tokens = published.predict(row, held[row.model])[1]
        ratios.append(tokens / published._published_tokens(row, published._setup(row)[0]))
        ranks.append(published.rank(row, held[row.model]))
    return ratios, ranks


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print("| | " + " | ".join(r.label for r in published.ROWS) + " | median error | within 30% | top 5 |")
    print("|" + "---|" * (len(published.ROWS) + 4))
    for name, on in STEPS:
        switch(on)
        ratios, ranks = held_out()
        median = statistics.median(abs(x - 1) for x in ratios)
        within = sum(abs(x - 1) <= 0.3 for x in ratios)
        top5 = len({row.model for row, r in zip(published.ROWS, ranks, strict=True) if r.place <= 5})
        cells = " | ".join(f"{x:.2f} (#{r.place})" for x, r in zip(ratios, ranks, strict=True))
        spreads = {}
        for row, r in zip(published.ROWS, ranks, strict=True):
            spreads.setdefault(row.model, f"{r.top[-1].step_s / r.top[0].step_s - 1:.1%} / {r.gap - 1:+.1%}")
        print(f"| {name} | {cells} | {median:.0%} | {within} of 7 | {top5} of 5 |")
        print("|  5 fastest spread / published gap | " + " | ".join(
            spreads.pop(row.model, "") for row in published.ROWS) + " | | | |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
