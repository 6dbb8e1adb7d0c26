"""``otbrl compare``: OTB vs GRPO at equal token budget, several seeds, one table and one plot.

Every arm (estimator, group size n) trains from the same warm-started policy with the same
number of prompts per step; the budget is a number of *sampled responses*, so an arm with
n = 16 takes 4x fewer steps than one with n = 4. Reported per arm, over seeds: generated tokens
consumed until the validation accuracy first reaches the target, final validation accuracy
(mean ± std) and the max / median gradient norm. Orchestration only: training is
``otbrl.trainer.Trainer``, curves come from each run's ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ARMS = "optimal_token_baseline:4,grpo:4,grpo:16,optimal_token_baseline:16"
SHORT = {"optimal_token_baseline": "OTB", "grpo": "GRPO", "rloo": "RLOO"}


def parse_arms(text: str) -> list[tuple[str, int]]:
    """``"grpo:4,optimal_token_baseline:16"`` -> [("grpo", 4), ...]; ``ValueError`` if malformed."""
    arms = []
    for item in text.split(","):
        name, sep, n = item.strip().partition(":")
        if not sep or not name or not n.isdigit() or int(n) < 2:
            raise ValueError(f"arms: expected 'estimator:n' with n >= 2, got {item!r}")
        arms.append((name, int(n)))
    return arms


def arm_label(name: str, n: int) -> str:
    """``("grpo", 16)`` -> ``"GRPO N=16"``."""
    return f"{SHORT.get(name, name)} N={n}"


def arm_steps(budget_responses: int, prompts: int, n: int) -> int:
    """Steps that spend ``budget_responses`` sampled responses at ``prompts`` × ``n`` per step."""
    return max(1, budget_responses // (prompts * n))


def run_curves(run_dir: Path, responses_per_step: int) -> dict:
    """From ``metrics.jsonl``: validation accuracy against generated tokens, and grad norms.

    Returns ``{"tokens": [...], "accuracy": [...], "grad_norm": [...], "final_accuracy"}``;
    tokens at a validation point = Σ over the steps so far of mean response length × responses.
    """
    from otbrl.logging import read_metrics

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
    }


def tokens_to_target(curve: dict, target: float) -> float:
    """Generated tokens at the first validation with accuracy ≥ target (inf if never)."""
    for tokens, acc in zip(curve["tokens"], curve["accuracy"]):
        if acc >= target:
            return tokens
    return math.inf


def _mean_std(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.inf, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


def summarize(curves: dict[str, list[dict]], target: float) -> dict[str, dict]:
    """Per arm over its seeds: tokens to target (mean ± std over the seeds that reached it, and
    how many did), final accuracy mean ± std, mean over seeds of the max and median grad norm."""
    out = {}
    for label, runs in curves.items():
        reach = [tokens_to_target(c, target) for c in runs]
        t_mean, t_std = _mean_std(reach)
        finals = [c["final_accuracy"] for c in runs]
        out[label] = {
            "seeds": len(runs),
            "reached_target": sum(math.isfinite(t) for t in reach),
            "tokens_to_target_mean": t_mean,
            "tokens_to_target_std": t_std,
            "final_accuracy_mean": statistics.fmean(finals),
            "final_accuracy_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "grad_norm_max": statistics.fmean(max(c["grad_norm"]) for c in runs),
            "grad_norm_median": statistics.fmean(statistics.median(c["grad_norm"]) for c in runs),
        }
    return out


def markdown_table(summary: dict[str, dict], target: float) -> str:
    """The comparison as a markdown table."""
    lines = [
        f"| arm | tokens to acc ≥ {target:g} (mean ± std, reached) | final acc (mean ± std) "
        "| max grad norm | median grad norm |",
        "|---|---|---|---|---|",
    ]
    for label, s in summary.items():
        if s["reached_target"]:
            reach = f"{s['tokens_to_target_mean']:,.0f} ± {s['tokens_to_target_std']:,.0f}"
        else:
            reach = "not reached"
        lines.append(
            f"| {label} | {reach} ({s['reached_target']}/{s['seeds']}) "
            f"| {s['final_accuracy_mean']:.3f} ± {s['final_accuracy_std']:.3f} "
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


def _json_safe(obj):
    """JSON has no inf/NaN ("not reached" is inf): those become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


def run_compare(
    config_file: str | None,
    overrides: list[str],
    *,
    arms: str = ARMS,
    seeds: int = 3,
    budget_responses: int = 19200,
    prompts: int = 16,
    target: float = 0.25,
    out_dir: str = "runs/compare",
    echo=print,
) -> dict:
    """Train every arm × seed, then write ``summary.json``, ``compare.md`` and ``compare.png``
    into ``out_dir``; returns the summary. Finished runs (their ``summary.json`` exists) are
    reused rather than retrained."""
    from otbrl.config import load_config
    from otbrl.trainer import Trainer, model_path, validate_config

    arm_list = parse_arms(arms)
    if seeds < 1 or prompts < 1 or budget_responses < 1:
        raise ValueError(
            f"seeds, prompts, budget: expected >= 1, got {seeds}, {prompts}, {budget_responses}"
        )
    out = Path(out_dir)
    base_cfg = load_config(config_file, overrides)
    validate_config(base_cfg)
    # one warm start shared by every arm and seed: seeds vary the RL sampling, not the start
    start_path = model_path(base_cfg)
    start = time.perf_counter()
    curves: dict[str, list[dict]] = {}
    for name, n in arm_list:
        label = arm_label(name, n)
        steps = arm_steps(budget_responses, prompts, n)
        for seed in range(seeds):
            run_dir = out / f"{name}-n{n}" / f"seed{seed}"
            cfg = load_config(
                config_file,
                [
                    *overrides,
                    f"model.path={start_path}",
                    f"algorithm.adv_estimator={name}",
                    f"rollout.n={n}",
                    f"data.train_batch_size={prompts}",
                    f"actor.ppo_mini_batch_size={prompts}",
                    f"trainer.total_steps={steps}",
                    f"trainer.val_every={max(1, steps // 10)}",
                    f"trainer.seed={seed}",
                    f"trainer.output_dir={run_dir}",
                    "trainer.logger=[jsonl]",
                ],
            )
            t0 = time.perf_counter()
            # a finished run (summary.json written at the end of fit) is reused, so arms can
            # be trained by separate processes and summarized by one last call
            if not (run_dir / "summary.json").is_file():
                Trainer(cfg).fit()
            curves.setdefault(label, []).append(run_curves(run_dir, prompts * n))
            final = curves[label][-1]["final_accuracy"]
            echo(
                f"{label} seed {seed}: {steps} steps, final acc {final:.3f}, "
                f"{time.perf_counter() - t0:.0f} s"
            )
    summary = summarize(curves, target)
    table = markdown_table(summary, target)
    seconds = time.perf_counter() - start
    result = {
        "arms": arms,
        "seeds": seeds,
        "budget_responses": budget_responses,
        "prompts_per_step": prompts,
        "target": target,
        "model": str(start_path),
        "overrides": overrides,
        "seconds": seconds,
        "summary": summary,
        "curves": curves,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(_json_safe(result), indent=2, default=str) + "\n")
    (out / "compare.md").write_text(table + "\n")
    plot_compare(curves, target, out / "compare.png")
    echo(table)
    echo(f"wrote {out}/summary.json, compare.md, compare.png; {seconds:.0f} s")
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m otbrl.compare [--config F] [key=value ...] [--arms ...] [--seeds S] ...``"""
    parser = argparse.ArgumentParser(prog="otbrl compare", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--arms", default=ARMS, help="estimator:n, comma-separated")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=19200, help="sampled responses per run")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--target", type=float, default=0.25, help="validation accuracy target")
    parser.add_argument("--out-dir", default="runs/compare")
    args = parser.parse_args(argv)
    try:
        parse_arms(args.arms)
        if min(args.seeds, args.budget, args.prompts) < 1:
            raise ValueError(
                f"--seeds, --budget, --prompts: expected >= 1, got "
                f"{args.seeds}, {args.budget}, {args.prompts}"
            )
    except ValueError as err:  # one line, before any model loads
        print(f"otbrl compare: {err}", file=sys.stderr)
        return 2
    run_compare(
        args.config,
        args.overrides,
        arms=args.arms,
        seeds=args.seeds,
        budget_responses=args.budget,
        prompts=args.prompts,
        target=args.target,
        out_dir=args.out_dir,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
