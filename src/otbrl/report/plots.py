"""Training curves from ``metrics.jsonl``: one run (``curves.png``) or several overlaid.

Uses matplotlib's object API with the Agg canvas, never ``pyplot``: plotting from a training
process must not pick or switch a GUI backend, and figures must not pile up in global state.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from otbrl.report.metrics_log import read_metrics
from otbrl.store.files import SUMMARY_FILE, atomic_write_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# (metrics key, panel title, smooth?) in panel order; a key no run logged gets no panel.
PANELS = (
    ("train/reward_mean", "reward (mean)", True),
    ("val/accuracy", "validation accuracy", False),
    ("policy/entropy_mean", "entropy (mean per token)", True),
    ("policy/sum_pi_squared_mean", "Σπ² (mean per token)", True),
    ("policy/grad_norm", "grad norm", True),
)
CURVES_FILE = "curves.png"


class Run(NamedTuple):
    """One run's plottable data: ``series[key] = (steps, values)``, non-finite points dropped."""

    label: str
    series: dict[str, tuple[list[int], list[float]]]
    summary: dict[str, Any]


def collect_series(records: Sequence[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Per panel key present in ``records``: (steps, values) in step order; nulls are skipped."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for key, _, _ in PANELS:
        points = [
            (r["step"], float(r[key]))
            for r in records
            if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)
        ]
        if points:
            points.sort(key=lambda p: p[0])
            series[key] = ([s for s, _ in points], [v for _, v in points])
    return series


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (fewer at the start), same length."""
    if window < 1:
        raise ValueError(f"window: expected an int >= 1, got {window!r}")
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _estimator(run_dir: Path, summary: dict[str, Any]) -> str | None:
    if summary.get("adv_estimator"):
        return str(summary["adv_estimator"])
    config_file = run_dir / "config.yaml"
    if config_file.is_file():  # a run still in progress has no summary yet
        import yaml

        config = yaml.safe_load(config_file.read_text()) or {}
        estimator = (config.get("algorithm") or {}).get("adv_estimator")
        return str(estimator) if estimator else None
    return None


def load_run(run_dir: str | Path, label: str | None = None) -> Run:
    """Read a run directory's metrics and summary; the label defaults to dir name (estimator)."""
    path = Path(run_dir)
    records = read_metrics(path)
    summary_file = path / SUMMARY_FILE
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    if label is None:
        estimator = _estimator(path, summary)
        label = path.resolve().name
        if estimator and estimator != label:
            label = f"{label} ({estimator})"
    return Run(label, collect_series(records), summary)


def _figure(runs: Sequence[Run], title: str) -> Figure:
    panels = [p for p in PANELS if any(p[0] in run.series for run in runs)]
    if not panels:
        keys = [key for key, _, _ in PANELS]
        raise ValueError(f"run_dirs: no run logged any of the plotted metrics {keys}")
    # matplotlib here, not at import: every training process imports this module and most
    # plot once, at the end (half a second of start-up for each `otbrl` process otherwise)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    ncols = 1 if len(panels) == 1 else 2 if len(panels) <= 4 else 3
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=(4.8 * ncols, 3.3 * nrows + 0.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for index, (key, panel_title, smoothed) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, index + 1)
        for run, color in zip(runs, colors):
            if key not in run.series:
                continue
            steps, values = run.series[key]
            if key == "val/accuracy":
                ax.plot(steps, values, "o-", color=color, markersize=3, label=run.label)
                continue
            # Raw per-step values are noisy: draw them faint, a trailing average on top.
            window = max(1, len(values) // 25) if smoothed else 1
            if window > 1:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
                ax.plot(steps, smooth(values, window), color=color, label=run.label)
            else:
                ax.plot(steps, values, color=color, label=run.label)
        if key == "val/accuracy":
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 1.5 on a short run
        ax.tick_params(labelsize=8)
        ax.ticklabel_format(axis="y", useOffset=False)  # "+2.937" offsets are hard to read
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        by_label = {}  # one entry per run, whichever panels it appears in
        for ax in fig.axes:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                by_label.setdefault(label, handle)
        labels = [run.label for run in runs if run.label in by_label]
        handles = [by_label[label] for label in labels]
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4))
    fig.suptitle(title, fontsize=11)
    return fig


def _save_png(fig: Figure, out_png: Path) -> Path:
    out_png.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    atomic_write_bytes(out_png, buffer.getvalue())
    return out_png


def plot_run(run_dir: str | Path, out_png: str | Path | None = None) -> Path:
    """Draw reward, validation accuracy, entropy, Σπ² and grad norm of one run.

    Panels whose metric was never logged are left out. Writes ``<run_dir>/curves.png`` (or
    ``out_png``) and returns its path. Raises ``ValueError`` when ``run_dir`` has no
    ``metrics.jsonl`` or none of the panel metrics.
    """
    path = Path(run_dir)
    run = load_run(path)
    title = run.label
    first, last = run.summary.get("initial_val_accuracy"), run.summary.get("final_val_accuracy")
    if isinstance(first, int | float) and isinstance(last, int | float):
        title += f"  ·  val accuracy {first:.3f} → {last:.3f}"
    return _save_png(_figure([run], title), Path(out_png) if out_png else path / CURVES_FILE)


def load_runs(run_dirs: Sequence[str | Path]) -> list[Run]:
    """``load_run`` for each directory; runs with the same directory name get their parent's
    name in front of the label (``a/run``, ``b/run``)."""
    if isinstance(run_dirs, str | Path) or not run_dirs:
        raise ValueError(f"run_dirs: expected a non-empty list of run dirs, got {run_dirs!r}")
    paths = [Path(p) for p in run_dirs]
    names = [p.resolve().name for p in paths]
    runs = []
    for path, name in zip(paths, names):
        run = load_run(path)
        if names.count(name) > 1:
            run = run._replace(label=f"{path.resolve().parent.name}/{run.label}")
        runs.append(run)
    return runs


def plot_runs(run_dirs: Sequence[str | Path], out_png: str | Path) -> Path:
    """Overlay several runs (e.g. OTB vs GRPO), one colour each, labelled dir name (estimator).

    Panels are the union of what the runs logged. Returns the written ``out_png``.
    """
    runs = load_runs(run_dirs)
    return _save_png(_figure(runs, "  vs  ".join(r.label for r in runs)), Path(out_png))
