"""PNG plots of a run's metrics.jsonl: loss curves, expert-load heatmaps, and runs compared on one axes.

Legend: S logged steps, L MoE layers, E experts, C heatmap columns.

matplotlib is optional and imported lazily. Figures are built with ``matplotlib.figure.Figure`` and
rendered by Agg through ``savefig``, never through pyplot: that works headless without
``matplotlib.use("Agg")``, leaves the backend of a notebook that imports us alone, and keeps no
figures alive in pyplot's registry between calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moekit.train.metrics import METRICS_FILE, read_metrics

_DPI = 120
_MAX_HEATMAP_COLUMNS = 400  # more steps than this are averaged into bins: a PNG cannot show more anyway


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write PNGs for a run from its metrics.jsonl; returns the paths written. out_dir defaults to run_dir/plots.

    Always ``loss.png`` (train/val loss, router losses, learning rate); ``expert_load.png``
    (per-layer expert-share heatmaps and load max/mean) only when the run has MoE layers;
    ``placement.png`` (rows per ep rank, rank imbalance, re-placements) only under expert parallelism.
    """
    run_dir = Path(run_dir)
    records = _load(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [_plot_loss(records, out_dir / "loss.png", run_dir.name)]
    if any(r.get("expert_load") or r.get("load_max_over_mean") for r in records):
        written.append(_plot_expert_load(records, out_dir / "expert_load.png", run_dir.name))
    if any(r.get("rank_load") for r in records):
        written.append(_plot_placement(records, out_dir / "placement.png", run_dir.name))
    return written


def compare_runs(runs: dict[str, Path], out_path: Path, title: str) -> Path:
    """Draw the train (smoothed) and val loss of several runs on one axes, e.g. a dense model against an MoE."""
    if not runs:
        raise ValueError(f"compare_runs needs at least one run, got {runs!r}")
    fig = _figure(figsize=(10, 5.5))
    ax = fig.subplots()
    for i, (name, run_dir) in enumerate(runs.items()):
        records = _load(Path(run_dir))
        color = f"C{i % 10}"
        steps, loss = _series(records, "loss")
        _plot_noisy(ax, steps, loss, color=color, label=f"{name} train{_smoothing_note(len(loss))}")
        val_steps, val = _series(records, "val_loss")
        if val_steps.size:
            ax.plot(val_steps, val, "o--", color=color, ms=4, lw=1, label=f"{name} val")
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, Path(out_path))


# ---------------------------------------------------------------------------------------------
# Figures.


def _plot_loss(records: list[dict[str, Any]], path: Path, run_name: str) -> Path:
    steps, loss = _series(records, "loss")
    val_steps, val = _series(records, "val_loss")
    aux_steps, aux = _series(records, "aux_loss")
    z_steps, z = _series(records, "z_loss")
    lr_steps, lr = _series(records, "lr")
    has_router = bool(aux_steps.size or z_steps.size)
    has_lr = bool(lr_steps.size)
    ratios = [3.0] + [1.6] * has_router + [1.0] * has_lr
    fig = _figure(figsize=(10, 1.0 + 1.3 * sum(ratios)))
    fig.suptitle(f"{run_name}: training curves", fontweight="bold")
    axes = list(fig.subplots(len(ratios), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": ratios})[:, 0])
    axes[-1].set_xlabel("optimizer step")

    ax = axes.pop(0)
    _plot_noisy(ax, steps, loss, color="C0", label=f"train loss{_smoothing_note(len(loss))}")
    if val_steps.size:
        ax.plot(val_steps, val, "o-", color="C3", ms=4, lw=1.2, label="val loss")
    ax.set_title("Loss")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()

    if has_router:
        ax = axes.pop(0)
        handles = []
        if aux_steps.size:
            handles += ax.plot(aux_steps, aux, color="C2", lw=1.2, label="aux loss")
            ax.set_ylabel("aux loss", color="C2")
        if z_steps.size:
            # The z-loss (squared logsumexp) lives on another scale than the balance loss: own y-axis.
            z_ax = ax.twinx() if aux_steps.size else ax
            handles += z_ax.plot(z_steps, z, color="C4", lw=1.2, label="z loss")
            z_ax.set_ylabel("z loss", color="C4")
        ax.set_title("Router losses")
        ax.grid(alpha=0.3)
        ax.legend(handles=handles, loc="upper right")

    if has_lr:
        ax = axes.pop(0)
        ax.plot(lr_steps, lr, color="C1", lw=1.2)
        ax.set_title("Learning rate")
        ax.set_ylabel("lr")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _plot_expert_load(records: list[dict[str, Any]], path: Path, run_name: str) -> Path:
    """Heatmaps (x step, y expert, colour share of tokens) per MoE layer, then load max/mean per layer."""
    heatmaps = [_layer_load(records, layer) for layer in range(max(len(r.get("expert_load") or []) for r in records))]
    balance_steps, balance_SL = _per_layer(records, "load_max_over_mean")
    num_heat = len(heatmaps)
    heat_height = float(np.clip(14 / max(num_heat, 1), 1.1, 2.2))
    heights = [heat_height] * num_heat + [2.6] * bool(balance_steps.size)
    fig = _figure(figsize=(11, 0.8 + sum(heights)))
    from matplotlib.colors import Normalize  # after _figure(), which explains a missing matplotlib
    from matplotlib.ticker import MaxNLocator

    fig.suptitle(f"{run_name}: expert load", fontweight="bold")
    grid = fig.add_gridspec(len(heights), 2, width_ratios=[60, 1], height_ratios=heights)
    rows: list[Any] = []  # the step-axis panels, top to bottom

    if heatmaps:
        norm = Normalize(0.0, max(float(load_SE.max()) for _, load_SE in heatmaps))
        for layer, (steps, load_SE) in enumerate(heatmaps):
            ax = fig.add_subplot(grid[layer, 0], sharex=rows[0] if rows else None)
            rows.append(ax)
            num_experts = load_SE.shape[1]
            edges, load_CE = _bin_columns(steps, load_SE)
            # pcolorfast draws one image, not a polygon per cell: 24 layers x 64 experts x 400 columns stays fast.
            mesh = ax.pcolorfast(edges, np.arange(num_experts + 1) - 0.5, load_CE.T, cmap="viridis", norm=norm)
            ax.set_ylim(num_experts - 0.5, -0.5)  # expert 0 on top, like a table
            ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(num_experts, int(4 * heat_height))))
            ax.set_ylabel("expert")
            ax.set_title(
                f"MoE layer {layer}: share of tokens per expert (uniform share 1/{num_experts} = {1 / num_experts:.3g})"
            )
        cbar = fig.colorbar(mesh, cax=fig.add_subplot(grid[:num_heat, 1]))
        cbar.set_label("share of tokens")
        for num_experts in {load_SE.shape[1] for _, load_SE in heatmaps}:
            cbar.ax.axhline(1 / num_experts, color="white", lw=1.5)  # the uniform share

    if balance_steps.size:
        ax = fig.add_subplot(grid[-1, 0], sharex=rows[0] if rows else None)
        rows.append(ax)
        num_layers = balance_SL.shape[1]
        # NOTE: past ten layers a legend and raw lines would bury the plot: colour smoothed lines by depth instead.
        many = num_layers > 10
        colors = _colormap_cycle(num_layers) if many else [f"C{i}" for i in range(num_layers)]
        for layer in range(num_layers):
            label = None if many else f"MoE layer {layer}"
            _plot_noisy(ax, balance_steps, balance_SL[:, layer], color=colors[layer], label=label, raw=not many)
        ax.axhline(1.0, color="0.3", ls="--", lw=1, label="perfect balance")
        note = _smoothing_note(len(balance_steps))
        ax.set_title(f"Load balance: busiest expert's load / mean expert load{note}")
        ax.set_ylabel("max / mean")
        ax.grid(alpha=0.3)
        ax.legend(ncols=min(num_layers + 1, 6), fontsize="small", loc="upper right")
        if many:
            from matplotlib.cm import ScalarMappable
            from matplotlib.colors import ListedColormap

            depth = ScalarMappable(Normalize(-0.5, num_layers - 0.5), ListedColormap(colors))
            fig.colorbar(depth, cax=fig.add_subplot(grid[-1, 1]), label="MoE layer")

    for ax in rows[:-1]:
        ax.tick_params(labelbottom=False)
    rows[-1].set_xlabel("optimizer step")
    return _save(fig, path)


def _plot_placement(records: list[dict[str, Any]], path: Path, run_name: str) -> Path:
    """Expert parallelism's balance: each ep rank's share of the rows, max/mean over ranks, and the
    bytes and seconds spent re-placing experts (refreshing shadows included)."""
    pairs = [(r["step"], r["rank_load"]) for r in records if r.get("rank_load")]
    steps = np.asarray([p[0] for p in pairs], dtype=float)
    load_SR = np.asarray([p[1] for p in pairs], dtype=float)
    share_SR = load_SR / np.maximum(load_SR.sum(1, keepdims=True), 1e-12)
    fig = _figure(figsize=(10, 8))
    fig.suptitle(f"{run_name}: expert placement over the ep ranks", fontweight="bold")
    top, mid, low = fig.subplots(3, 1, sharex=True)
    for rank in range(share_SR.shape[1]):
        _plot_noisy(top, steps, share_SR[:, rank], color=f"C{rank % 10}", label=f"rank {rank}")
    top.axhline(1 / share_SR.shape[1], color="0.3", ls="--", lw=1, label="even share")
    top.set_ylabel("share of rows")
    top.legend(ncols=min(share_SR.shape[1] + 1, 6), fontsize="small", loc="upper right")
    imb_steps, imb = _series(records, "rank_imbalance")
    _plot_noisy(mid, imb_steps, imb, color="C0", label="busiest rank / mean")
    mid.axhline(1.0, color="0.3", ls="--", lw=1)
    mid.set_ylabel("max / mean")
    mid.legend(fontsize="small", loc="upper right")
    byte_steps, moved = _series(records, "placement_bytes")
    low.bar(byte_steps, moved / 1e6, width=1.0, color="C1", label="MB moved (experts + optimizer state, shadows)")
    low.set_ylabel("MB moved")
    time_steps, seconds = _series(records, "placement_s")
    twin = low.twinx()
    twin.plot(time_steps, seconds * 1e3, color="C2", lw=1, label="ms spent")
    twin.set_ylabel("ms re-placing")
    low.legend(fontsize="small", loc="upper left")
    twin.legend(fontsize="small", loc="upper right")
    for ax in (top, mid, low):
        ax.grid(alpha=0.3)
    low.set_xlabel("optimizer step")
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------
# Data helpers.


def _load(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"no metrics to plot: {path} does not exist")
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"no metrics to plot: {path} holds no records")
    return records


def _series(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that have a number under ``key``."""
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    steps, values = zip(*pairs, strict=True) if pairs else ((), ())
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def _per_layer(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps_S, values_SL) of a per-layer list, NaN where a record has fewer layers."""
    rows = [r for r in records if r.get(key)]
    num_layers = max((len(r[key]) for r in rows), default=0)
    values_SL = np.full((len(rows), num_layers), np.nan)
    for i, r in enumerate(rows):
        values_SL[i, : len(r[key])] = r[key]
    return np.asarray([r["step"] for r in rows], dtype=float), values_SL


def _layer_load(records: list[dict[str, Any]], layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(steps_S, load_SE) of one MoE layer's expert_load."""
    rows = [r for r in records if len(r.get("expert_load") or []) > layer]
    widths = {len(r["expert_load"][layer]) for r in rows}
    if len(widths) != 1:
        raise ValueError(f"expert_load of MoE layer {layer} has differing expert counts across steps: {sorted(widths)}")
    load_SE = np.asarray([r["expert_load"][layer] for r in rows], dtype=float)
    return np.asarray([r["step"] for r in rows], dtype=float), load_SE


def _bin_columns(steps_S: np.ndarray, values_SE: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Average consecutive steps into at most ``_MAX_HEATMAP_COLUMNS`` columns; returns (edges_C+1, values_CE).

    Edges sit halfway between neighbouring columns, so uneven logging intervals keep true step positions.
    """
    groups = np.array_split(np.arange(len(steps_S)), min(len(steps_S), _MAX_HEATMAP_COLUMNS))
    values_CE = np.stack([values_SE[g].mean(axis=0) for g in groups])
    first = np.asarray([steps_S[g[0]] for g in groups])
    last = np.asarray([steps_S[g[-1]] for g in groups])
    half = (first[1] - last[0]) / 2 if len(groups) > 1 else 0.5
    edges = np.concatenate([[first[0] - half], (last[:-1] + first[1:]) / 2, [last[-1] + half]])
    return edges, values_CE


def _smoothing_window(n: int) -> int:
    """Records per moving-average window: none below 100 points (every point is readable), then ~2% of the run."""
    return 1 if n < 100 else max(5, n // 50)


def _smoothing_note(n: int) -> str:
    window = _smoothing_window(n)
    return f" (moving average of {window})" if window > 1 else ""


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average that skips NaN/inf (a diverged step must not blank its neighbours)."""
    finite = np.isfinite(values)
    kernel = np.ones(window)
    total = np.convolve(np.where(finite, values, 0.0), kernel, mode="same")
    count = np.convolve(finite.astype(float), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return total / count


# ---------------------------------------------------------------------------------------------
# Drawing helpers.


def _plot_noisy(
    ax: Any, steps: np.ndarray, values: np.ndarray, color: Any, label: str | None, raw: bool = True
) -> None:
    """A noisy per-step series (loss, load balance): faint raw line plus a labelled moving average when long enough."""
    window = _smoothing_window(len(values))
    if window == 1:
        ax.plot(steps, values, color=color, lw=1.5, label=label)
        return
    if raw:
        ax.plot(steps, values, color=color, lw=0.8, alpha=0.25)
    ax.plot(steps, _smooth(values, window), color=color, lw=1.8, label=label)


def _colormap_cycle(n: int) -> list[Any]:
    from matplotlib import colormaps

    return list(colormaps["plasma"](np.linspace(0.0, 0.9, n)))


def _figure(figsize: tuple[float, float]) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib") from None
    return Figure(figsize=figsize, layout="constrained")


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI)
    return path
