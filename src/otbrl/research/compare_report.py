"""``otbrl compare``'s report: each run's curves read from its ``metrics.jsonl``, their summary
over seeds (tokens to a target accuracy, final and late accuracy, gradient norms), the markdown
table and the plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path


def run_curves(run_dir: Path, responses_per_step: int) -> dict:
    """From ``metrics.jsonl``: validation accuracy against generated tokens, and grad norms.

    Returns ``{"tokens": [...], "accuracy": [...], "grad_norm": [...], "final_accuracy",
    "late_accuracy"}``; tokens at a validation point = Σ over the steps so far of mean response
    length × responses; ``late_accuracy`` = mean of the validations in the last quarter of the
    run's tokens (one validation is a noisy end point: a few prompts flipping moves it).
    """
    from otbrl.report.metrics_log import read_metrics

    tokens, acc_tokens, accuracy, grad_norm = 0.0, [], [], []
    for record in read_metrics(run_dir):
        step = record.get("step", 0)
        if step > 0 and record.get("train/response_length_mean") is not None:
            tokens += record["train/response_length_mean"] * responses_per_step
        if record.get("policy/grad_norm") is not None:
            grad_norm.append(record["policy/grad_norm"])
        if record.get("val/accuracy") is not None:
            acc_tokens.append(tokens)
            accuracy.append(record["val/accuracy"])
    return {
        "tokens": acc_tokens,
        "accuracy": accuracy,
        "grad_norm": grad_norm,
        "final_accuracy": accuracy[-1] if accuracy else math.nan,
        "late_accuracy": late_mean(acc_tokens, accuracy),
    }


def late_mean(tokens: list[float], accuracy: list[float], fraction: float = 0.25) -> float:
    """Mean accuracy of the validations at tokens ≥ (1 − fraction) × the last one's tokens."""
    if not accuracy:
        return math.nan
    start = (1.0 - fraction) * tokens[-1]
    late = [a for t, a in zip(tokens, accuracy) if t >= start]
    return statistics.fmean(late)


def tokens_to_target(curve: dict, target: float, *, stay: bool = False) -> float:
    """Generated tokens at the first validation with accuracy ≥ target (inf if never);
    ``stay``: at the first validation from which every later one is ≥ target too (a run that
    touches the target and falls back has not reached it yet)."""
    tokens, accuracy = curve["tokens"], curve["accuracy"]
    if stay:
        start = len(accuracy)
        while start > 0 and accuracy[start - 1] >= target:
            start -= 1
        return tokens[start] if start < len(accuracy) else math.inf
    for spent, acc in zip(tokens, accuracy):
        if acc >= target:
            return spent
    return math.inf


def _mean_std(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.inf, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


def summarize(curves: dict[str, list[dict]], target: float) -> dict[str, dict]:
    """Per arm over its seeds: tokens to target, first reached and for good (``stay``; mean ±
    std over the seeds that got there, and how many did), final accuracy mean ± std, mean over
    seeds of the max and median grad norm."""
    out = {}
    for label, runs in curves.items():
        reach = [tokens_to_target(c, target) for c in runs]
        t_mean, t_std = _mean_std(reach)
        stays = [tokens_to_target(c, target, stay=True) for c in runs]
        s_mean, s_std = _mean_std(stays)
        finals = [c["final_accuracy"] for c in runs]
        lates = [c.get("late_accuracy", c["final_accuracy"]) for c in runs]
        out[label] = {
            "seeds": len(runs),
            "reached_target": sum(math.isfinite(t) for t in reach),
            "tokens_to_target_mean": t_mean,
            "tokens_to_target_std": t_std,
            "stayed_at_target": sum(math.isfinite(t) for t in stays),
            "tokens_to_stay_mean": s_mean,
            "tokens_to_stay_std": s_std,
            "final_accuracy_mean": statistics.fmean(finals),
            "final_accuracy_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "late_accuracy_mean": statistics.fmean(lates),
            "late_accuracy_std": statistics.stdev(lates) if len(lates) > 1 else 0.0,
            "grad_norm_max": statistics.fmean(max(c["grad_norm"]) for c in runs),
            "grad_norm_median": statistics.fmean(statistics.median(c["grad_norm"]) for c in runs),
        }
    return out


def tokens_ratio(
    curves: dict[str, list[dict]],
    base: str,
    target: float,
    *,
    resamples: int = 10_000,
    seed: int = 0,
    stay: bool = False,
) -> dict[str, dict]:
    """Per arm: mean tokens to ``target`` (``stay``: to stay at it, ``tokens_to_target``) over
    its seeds divided by the ``base`` arm's, with a
    95 % percentile bootstrap interval (each arm's seeds resampled on their own: runs of
    different arms share nothing but the warm start, so there is no pairing to keep).

    A seed that never reached the target counts with all the tokens it generated: a lower
    bound on what it would have needed, so the ratio is then a bound too (``censored``: this
    arm's seeds that did not reach it, of its ``seeds``). When no seed of the arm, or none of
    the base, reached it, the ratio is a bound alone: ``ci95`` is None. Returns ``{label:
    {"value", "ci95": [lo, hi] | None, "censored", "seeds"}}``; ``ValueError`` when ``base``
    is not an arm.
    """
    import numpy as np

    if base not in curves:
        raise ValueError(f"base: expected one of the arms {sorted(curves)}, got {base!r}")

    def spent(curve: dict) -> tuple[float, bool]:
        reached = tokens_to_target(curve, target, stay=stay)
        if math.isfinite(reached):
            return reached, False
        return (curve["tokens"][-1] if curve["tokens"] else math.nan), True

    rng = np.random.default_rng(seed)
    per_arm = {label: [spent(c) for c in runs] for label, runs in curves.items()}
    base_tokens = np.array([t for t, _ in per_arm[base]])
    base_reached = not all(c for _, c in per_arm[base])
    base_draws = rng.choice(base_tokens, size=(resamples, len(base_tokens))).mean(axis=1)
    out = {}
    for label, spends in per_arm.items():
        tokens = np.array([t for t, _ in spends])
        censored = sum(c for _, c in spends)
        ci = None
        if base_reached and censored < len(spends):  # else a bound, whose spread means nothing
            with np.errstate(divide="ignore", invalid="ignore"):  # a base at 0 tokens: nan
                draws = rng.choice(tokens, size=(resamples, len(tokens))).mean(axis=1) / base_draws
            ci = [float(q) for q in np.percentile(draws, [2.5, 97.5])]
        out[label] = {
            "value": float(tokens.mean() / base_tokens.mean()) if base_tokens.mean() else math.nan,
            "ci95": ci,
            "censored": censored,
            "seeds": len(spends),
        }
    return out


def markdown_table(
    summary: dict[str, dict],
    target: float,
    ratios: dict[str, dict] | None = None,
    base=None,
    stay_ratios: dict[str, dict] | None = None,
) -> str:
    """The comparison as a markdown table: tokens to ``target`` first reached and for good
    (every later validation ≥ target); with ``ratios`` / ``stay_ratios`` (``tokens_ratio``)
    each relative to the ``base`` arm, with its 95 % interval."""

    def tokens(mean, std, count, seeds):
        shown = f"{mean:,.0f} ± {std:,.0f}" if count else "never"
        return f"{shown} ({count}/{seeds})"

    def ratio(label, r, b):
        """A ratio cell; ``b``: the base arm's entry. Unreached seeds count at their budget."""
        unreached, seeds = r["censored"], r["seeds"]
        if r["ci95"] is not None:
            lo, hi = r["ci95"]
            note = f" ({unreached} of {seeds} seeds unreached, counted at their budget)"
            return f" {r['value']:.2f} [{lo:.2f}, {hi:.2f}]{note if unreached else ''} |"
        base_never = b["censored"] == b["seeds"]
        if label == base or (base_never and unreached == seeds):
            return " — (no seed reached it: no ratio) |"
        if unreached == seeds:  # its budget is less than it would have needed
            return f" ≥ {r['value']:.2f} (no seed reached it: a bound, no CI) |"
        return f" ≤ {r['value']:.2f} ({base} never reached it: a bound, no CI) |"

    first_head = f" ÷ {base}'s [95 % CI] |" if ratios else ""
    stay_head = f" ÷ {base}'s [95 % CI] |" if stay_ratios else ""
    lines = [
        f"| arm | tokens to acc ≥ {target:g} (mean ± std, reached) |{first_head} tokens to "
        f"stay ≥ {target:g} |{stay_head} final acc (mean ± std) | acc over the last 25 % "
        "(mean ± std) | max grad norm | median grad norm |",
        "|---|---|"
        + ("---|" if ratios else "")
        + "---|"
        + ("---|" if stay_ratios else "")
        + "---|---|---|---|",
    ]
    for label, s in summary.items():
        first = tokens(s["tokens_to_target_mean"], s["tokens_to_target_std"],
                       s["reached_target"], s["seeds"])  # fmt: skip
        stay = tokens(s["tokens_to_stay_mean"], s["tokens_to_stay_std"],
                      s["stayed_at_target"], s["seeds"])  # fmt: skip
        lines.append(
            f"| {label} | {first} |"
            f"{ratio(label, ratios[label], ratios[base]) if ratios else ''} {stay} |"
            f"{ratio(label, stay_ratios[label], stay_ratios[base]) if stay_ratios else ''}"
            f" {s['final_accuracy_mean']:.3f} ± {s['final_accuracy_std']:.3f} "
            f"| {s['late_accuracy_mean']:.3f} ± {s['late_accuracy_std']:.3f} "
            f"| {s['grad_norm_max']:.3g} | {s['grad_norm_median']:.3g} |"
        )
    return "\n".join(lines)


def plot_compare(curves: dict[str, list[dict]], target: float, out_png: Path) -> Path:
    """Validation accuracy against generated tokens: faint line per seed, bold mean per arm."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for (label, runs), color in zip(curves.items(), colors * 4):
        for c in runs:
            ax.plot(c["tokens"], c["accuracy"], color=color, alpha=0.25, lw=0.8)
        length = min(len(c["accuracy"]) for c in runs)
        if length:
            xs = [statistics.fmean(c["tokens"][i] for c in runs) for i in range(length)]
            ys = [statistics.fmean(c["accuracy"][i] for c in runs) for i in range(length)]
            ax.plot(xs, ys, color=color, lw=2, label=f"{label} (mean of {len(runs)})")
    ax.axhline(target, color="gray", ls="--", lw=0.8)
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("validation accuracy")
    ax.legend(fontsize=8)
    fig.savefig(out_png, dpi=110)
    return out_png
