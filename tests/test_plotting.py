"""Curves: which panels appear, what each line holds, overlay labels, files and errors."""

import json

import numpy as np
import pytest
from matplotlib.image import imread

from otbrl.report.metrics_log import MetricsLogger
from otbrl.report.plots import (
    _figure,
    collect_series,
    load_run,
    load_runs,
    plot_run,
    plot_runs,
    smooth,
)


def write_run(run_dir, estimator, steps=60, keys=None, summary=True, nan_at=None):
    keys = keys or ["train/reward_mean", "policy/entropy_mean", "policy/grad_norm"]
    rng = np.random.default_rng(len(estimator))
    with MetricsLogger(run_dir, backends=("jsonl",), total_steps=steps) as logger:
        for step in range(1, steps + 1):
            metrics = {key: float(rng.random()) for key in keys}
            if step == nan_at:
                metrics[keys[0]] = float("nan")
            logger.log(step, metrics)
            if step % 20 == 0:
                logger.log(step, {"val/accuracy": step / (2 * steps)})
        if summary:
            logger.summary(
                {"initial_val_accuracy": 0.1, "final_val_accuracy": 0.5, "adv_estimator": estimator}
            )
    return run_dir


def raw_points(run_dir, key):
    """Independent reference: (steps, values) of one key straight from the JSON lines."""
    steps, values = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get(key) is not None:
            steps.append(record["step"])
            values.append(record[key])
    return steps, values


def test_smooth_is_a_trailing_mean():
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0]
    expected = [float(np.mean(values[max(0, i - 2) : i + 1])) for i in range(len(values))]
    assert smooth(values, 3) == pytest.approx(expected)
    assert smooth(values, 1) == values
    with pytest.raises(ValueError, match="window"):
        smooth(values, 0)


def test_plot_run_draws_present_panels_with_the_logged_points(tmp_path):
    with pytest.warns(RuntimeWarning, match="nan at step 7"):
        run_dir = write_run(tmp_path / "otb", "optimal_token_baseline", nan_at=7)
    run = load_run(run_dir)
    assert run.label == "otb (optimal_token_baseline)"
    for key in ("train/reward_mean", "val/accuracy", "policy/grad_norm"):
        assert run.series[key] == raw_points(run_dir, key)
    assert 7 not in run.series["train/reward_mean"][0]  # the null is a gap, not a zero

    fig = _figure([run], run.label)
    titles = [ax.get_title() for ax in fig.axes]
    # Σπ² was never logged: its panel is skipped, the order of the rest is kept.
    assert titles == [
        "reward (mean)",
        "validation accuracy",
        "entropy (mean per token)",
        "grad norm",
    ]
    reward_lines = fig.axes[0].get_lines()
    steps, values = raw_points(run_dir, "train/reward_mean")
    assert list(reward_lines[0].get_xdata()) == steps
    assert list(reward_lines[0].get_ydata()) == values
    window = len(values) // 25
    assert list(reward_lines[1].get_ydata()) == pytest.approx(smooth(values, window))
    val_line = fig.axes[1].get_lines()[0]
    assert list(val_line.get_xdata()) == [20, 40, 60]

    png = plot_run(run_dir)
    assert png == run_dir / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(png)
    assert image.shape[0] > 300 and image.shape[1] > image.shape[0]
    assert image[..., :3].std() > 0.05  # something was drawn
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) == []


def test_step_ticks_are_whole_steps(tmp_path):
    """Issue 53: a 3-step run's x axis read 1.0, 1.5, 2.0, 2.5, 3.0: steps are integers."""
    run = load_run(write_run(tmp_path / "short", "grpo", steps=3))
    fig = _figure([run], run.label)
    fig.canvas.draw()  # the locators pick their ticks at draw time
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks


def test_plot_runs_overlays_and_labels(tmp_path):
    otb = write_run(tmp_path / "otb", "optimal_token_baseline")
    grpo = write_run(
        tmp_path / "grpo", "grpo", keys=["train/reward_mean", "policy/sum_pi_squared_mean"]
    )
    # No summary yet (a run in progress): the estimator comes from config.yaml.
    live = tmp_path / "live"
    MetricsLogger(
        live, backends=("jsonl",), total_steps=3, config={"algorithm": {"adv_estimator": "rloo"}}
    ).log(1, {"train/reward_mean": 0.5})
    runs = [load_run(p) for p in (otb, grpo, live)]
    assert [r.label for r in runs] == ["otb (optimal_token_baseline)", "grpo", "live (rloo)"]

    fig = _figure(runs, "cmp")
    assert len(fig.axes[0].get_lines()) == 2 * 2 + 1  # faint + smoothed for the long runs
    assert len(fig.axes) == 5  # the union of the runs' panels
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == [r.label for r in runs]

    out = plot_runs([otb, grpo, live], tmp_path / "plots" / "cmp.png")
    assert out.is_file() and imread(out).shape[1] > 600

    # Same directory name under different parents: the parent tells them apart.
    a = write_run(tmp_path / "a" / "run", "grpo", summary=False)
    b = write_run(tmp_path / "b" / "run", "grpo", summary=False)
    assert [r.label for r in load_runs([a, b])] == ["a/run", "b/run"]


def test_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="run_dirs"):
        plot_runs([], tmp_path / "x.png")
    with pytest.raises(ValueError, match="run_dirs"):
        plot_runs(str(tmp_path), tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"run_dir.*metrics\.jsonl"):
        plot_run(tmp_path / "missing")
    with MetricsLogger(tmp_path / "other", backends=("jsonl",), total_steps=1) as logger:
        logger.log(1, {"timing/step_s": 1.0})
    with pytest.raises(ValueError, match="any of the plotted metrics"):
        plot_run(tmp_path / "other")
    assert collect_series([]) == {}
