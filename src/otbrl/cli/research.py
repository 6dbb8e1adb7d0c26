"""``otbrl plot``, ``otbrl variance`` and ``otbrl compare``: the commands that look at runs and
estimators beside the training loop (``otbrl.report``, ``otbrl.research``)."""

from __future__ import annotations

import argparse
import sys

from otbrl.cli.common import load, usage_error
from otbrl.config import ConfigError


def plot(args: argparse.Namespace) -> int:
    """``otbrl plot``: one run's curves beside it, or several runs overlaid."""
    from otbrl.report.plots import plot_run, plot_runs

    try:
        if len(args.run_dirs) == 1 and args.out is None:
            print(f"wrote {plot_run(args.run_dirs[0])}")
        else:
            print(f"wrote {plot_runs(args.run_dirs, args.out or 'curves.png')}")
    except ValueError as err:  # not a run directory
        return usage_error(err)
    return 0


def add_variance_args(p: argparse.ArgumentParser) -> None:
    """``otbrl variance``'s own flags (beside the configuration's)."""
    p.add_argument(
        "--estimators",
        default=None,
        help="comma-separated (default grpo,drgrpo,rloo,otb,otb_notail)",
    )
    p.add_argument("--n", default="16", help="group sizes, comma-separated (e.g. 4,16)")
    p.add_argument("--repeats", type=int, default=200, help="K repeats per group size")
    p.add_argument("--prompts", type=int, default=8, help="P prompts from the configured data")
    p.add_argument("--reference-samples", type=int, default=512, help="RLOO reference samples")
    p.add_argument("--base", default="grpo", help="estimator the ratios divide by")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--sketch-dim", type=int, default=None, help="0 = exact Gram; default auto")
    p.add_argument("--method", default="loop", choices=("loop", "batched"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="variance.json", help="JSON to write (PNG beside it)")


def variance(args: argparse.Namespace) -> int:
    """``otbrl variance``: the empirical gradient variance per estimator, with CIs."""
    cfg = load(args)
    if cfg.algorithm.distill.teacher_path is not None:  # before the plan loads its tokenizer
        raise ConfigError(
            "'algorithm.distill.teacher_path': otbrl variance measures the gradient of the task "
            "reward alone (no teacher, no in-reward KL); drop the key",
            "algorithm.distill.teacher_path",
        )
    from otbrl.research.gradient_probe import parse_estimators
    from otbrl.research.variance import (
        DEFAULT_ESTIMATORS,
        MeasurementError,
        check_variance_args,
        run_variance,
    )
    from otbrl.run.plan import plan_run

    try:  # the configured estimator options apply to every estimator measured
        measured = [s.name for s in parse_estimators(args.estimators or DEFAULT_ESTIMATORS)]
    except ValueError as err:
        raise ConfigError(f"otbrl variance: {err}", "--estimators") from None
    plan = plan_run(cfg, estimators=measured)
    if args.prompts > len(plan.train_rows):
        raise ConfigError(
            f"otbrl variance: --prompts {args.prompts} is more than the training data's "
            f"{len(plan.train_rows)} rows",
            "--prompts",
        )
    try:
        ns = [int(x) for x in args.n.split(",")]
        kwargs = {
            "estimators": args.estimators or DEFAULT_ESTIMATORS,
            "ns": ns,
            "repeats": args.repeats,
            "prompts": args.prompts,
            "reference_samples": args.reference_samples,
            "base": args.base or None,
        }
        check_variance_args(**kwargs)
    except ValueError as err:  # bad flags: one line, before any model loads
        raise ConfigError(f"otbrl variance: {err}", "variance") from None
    try:
        run_variance(
            plan,
            **kwargs,
            out=args.out,
            num_bootstrap=args.bootstrap,
            sketch_dim=args.sketch_dim,
            method=args.method,
            seed=args.seed,
        )
    except MeasurementError as err:  # nothing to measure on this policy: one line, not a trace
        print(f"otbrl variance: error: {err}", file=sys.stderr)
        return 1
    return 0


def compare(args: argparse.Namespace) -> int:
    """``otbrl compare``: its own parser and run (``otbrl.research.compare.main``)."""
    from otbrl.research.compare import main as compare_main

    return compare_main(args.args)
