"""``otbrl compare``: OTB vs GRPO at equal token budget, several seeds, one table and one plot.

Every arm (estimator, group size n) trains from the same warm-started policy with the same
number of prompts per step; the budget is a number of *sampled responses*, so an arm with
n = 16 takes 4x fewer steps than one with n = 4. Reported per arm, over seeds: generated tokens
consumed until the validation accuracy first reaches the target, final validation accuracy
(mean ± std) and the max / median gradient norm. Orchestration only: training is
``otbrl.run.trainer.Trainer``, curves come from each run's ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from otbrl.research.compare_report import (
    markdown_table,
    plot_compare,
    run_curves,
    summarize,
    tokens_ratio,
)
from otbrl.research.compare_runs import ArmRun, train_runs

ARMS = "optimal_token_baseline:4,grpo:4,grpo:16,optimal_token_baseline:16"
# the default preset (docs/when-does-otb-help.md): 800 steps at n = 4, 200 at n = 16
BUDGET = 102_400
PROMPTS = 32
TARGET = 0.5
VAL_POINTS = 20  # validations per run (greedy, cheap next to training)
SHORT = {
    "optimal_token_baseline": "OTB",
    "grpo": "GRPO",
    "rloo": "RLOO",
    "drgrpo": "Dr. GRPO",
    "otb": "OTB",
    "otb_notail": "OTB no-tail",
    "otb_uniform": "OTB w≡1",
    "otb_loo": "OTB LOO",
}


def parse_arms(text: str) -> list[tuple[str, int]]:
    """``"grpo:4,drgrpo:16"`` -> [("grpo", 4), ("drgrpo", 16)]; ``ValueError`` if malformed.

    An arm's estimator is a registered name or an alias of ``ESTIMATOR_ALIASES`` (``drgrpo``,
    ``otb_notail``, ...).
    """
    from otbrl.algos import ESTIMATOR_ALIASES, ESTIMATORS

    arms = []
    for item in text.split(","):
        name, sep, n = item.strip().partition(":")
        if not sep or not name or not n.isdigit() or int(n) < 2:
            raise ValueError(f"arms: expected 'estimator:n' with n >= 2, got {item!r}")
        if name not in ESTIMATORS and name not in ESTIMATOR_ALIASES:
            known = sorted({*ESTIMATORS, *ESTIMATOR_ALIASES})
            raise ValueError(f"arms: unknown estimator {name!r} in {item!r}; known: {known}")
        arms.append((name, int(n)))
    if len(set(arms)) != len(arms):
        raise ValueError(f"arms: expected distinct arms, got {text!r}")
    return arms


def arm_estimator_overrides(name: str) -> list[str]:
    """Config overrides that select arm estimator ``name`` (an alias also sets its options)."""
    from otbrl.algos import ESTIMATOR_ALIASES
    from otbrl.config.keys import ESTIMATOR_OPTION_KEYS

    estimator, options = ESTIMATOR_ALIASES.get(name, (name, {}))
    return [f"algorithm.adv_estimator={estimator}"] + [
        f"{ESTIMATOR_OPTION_KEYS[key]}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in options.items()
    ]


def arm_label(name: str, n: int) -> str:
    """``("grpo", 16)`` -> ``"GRPO N=16"``."""
    return f"{SHORT.get(name, name)} N={n}"


def arm_steps(budget_responses: int, prompts: int, n: int) -> int:
    """Steps that spend ``budget_responses`` sampled responses at ``prompts`` × ``n`` per step."""
    return max(1, budget_responses // (prompts * n))


def _run_overrides(name, n, seed, *, start_path, prompts, updates_per_step, steps, run_dir):
    """The overrides that turn the base config into one arm × seed run."""
    return [
        f"model.path={start_path}",
        *arm_estimator_overrides(name),
        f"rollout.n={n}",
        f"data.train_batch_size={prompts}",
        f"actor.ppo_mini_batch_size={prompts // updates_per_step}",
        f"trainer.total_steps={steps}",
        f"trainer.val_every={max(1, steps // VAL_POINTS)}",
        f"trainer.seed={seed}",
        f"trainer.output_dir={run_dir}",
        "trainer.logger=[jsonl]",
        # an unfinished run with this same config starts over in place; one with another
        # config is refused by the run directory's manifest check
        "trainer.resume=auto",
    ]


def run_compare(
    config_file: str | None,
    overrides: list[str],
    *,
    arms: str = ARMS,
    seeds: int = 3,
    budget_responses: int = BUDGET,
    prompts: int = PROMPTS,
    updates_per_step: int = 2,
    target: float = TARGET,
    out_dir: str = "runs/compare",
    jobs: int = 1,
    base: str | None = None,
    echo=print,
) -> dict:
    """Train every arm × seed, then write ``summary.json``, ``compare.md`` and ``compare.png``
    into ``out_dir``; returns the summary.

    ``base`` (an arm, ``"grpo:32"``) adds each arm's tokens to target relative to that arm's,
    with a bootstrap interval over seeds (``tokens_ratio``).
    Every run takes ``prompts`` prompts per step and ``updates_per_step`` optimizer steps per
    RL step. Finished runs (``summary.json`` exists, ``config.yaml`` equal to the planned
    config) are reused rather than retrained; a finished run with other settings is a
    ``ValueError``.
    ``jobs`` > 1 trains that many runs at once, each in its own ``otbrl train`` process with
    ``cpu_count // jobs`` torch threads (small models train faster as parallel single-thread
    processes than as one multi-thread process). Raises ``RuntimeError`` naming every failed
    run after the others have finished.
    """
    from otbrl.config import load_config, to_dict
    from otbrl.run.build import model_path
    from otbrl.run.plan import plan_run

    arm_list = parse_arms(arms)
    check_settings(seeds, budget_responses, prompts, updates_per_step, jobs)
    base_label = check_base(base, arm_list)
    out = Path(out_dir)
    base_cfg = load_config(config_file, overrides)  # with the built-in model's and task's presets
    base_plan = plan_run(base_cfg)
    # every arm starts from the base's resolved settings: pointing model.path at the shared
    # warm start must not drop the built-in model's preset
    base = to_dict(base_cfg)
    # one warm start shared by every arm and seed: seeds vary the RL sampling, not the start
    start_path = model_path(base_plan.spec.model)
    start = time.perf_counter()
    plan = _plan_runs(
        arm_list,
        seeds,
        base=base,
        out=out,
        start_path=start_path,
        budget_responses=budget_responses,
        prompts=prompts,
        updates_per_step=updates_per_step,
    )
    train_runs(plan, jobs, echo)
    measured = _measure(plan, target, base_label)
    summary, ratios = measured["summary"], measured["tokens_ratio"]
    table = markdown_table(summary, target, ratios, base_label, measured["tokens_ratio_stay"])
    seconds = time.perf_counter() - start
    result = {
        "arms": arms,
        "seeds": seeds,
        "budget_responses": budget_responses,
        "prompts_per_step": prompts,
        "updates_per_step": updates_per_step,
        "target": target,
        "model": str(start_path),
        "overrides": overrides,
        "jobs": jobs,
        "seconds": seconds,
        **measured,
    }
    _write_outputs(out, result, table, measured["curves"], target)
    echo(table)
    echo(f"wrote {out}/summary.json, compare.md, compare.png; {seconds:.0f} s")
    return result


def _plan_runs(
    arm_list, seeds, *, base, out, start_path, budget_responses, prompts, updates_per_step
) -> list[ArmRun]:
    """One ``ArmRun`` per arm × seed (``out/<estimator>-n<n>/seed<s>``), its config loaded on
    ``base`` (the base run's resolved settings) and planned: a wrong arm config fails here,
    before anything trains."""
    from otbrl.config import load_config
    from otbrl.run.plan import plan_run

    plan = []
    for name, n in arm_list:
        steps = arm_steps(budget_responses, prompts, n)
        for seed in range(seeds):
            run_dir = out / f"{name}-n{n}" / f"seed{seed}"
            run = _run_overrides(
                name,
                n,
                seed,
                start_path=start_path,
                prompts=prompts,
                updates_per_step=updates_per_step,
                steps=steps,
                run_dir=run_dir,
            )
            # fail before training anything if one arm's config is wrong
            cfg = load_config(None, run, base=base)
            plan_run(cfg)
            plan.append(ArmRun(arm_label(name, n), seed, steps, prompts * n, run_dir, cfg, run))
    return plan


def _measure(plan: list[ArmRun], target: float, base_label: str | None) -> dict:
    """What the runs measured, read from their ``metrics.jsonl``: ``summary`` (per arm, over
    seeds), ``base``, ``tokens_ratio`` and ``tokens_ratio_stay`` (to target, and to stay
    there, relative to the base arm; None without one) and ``curves`` (per arm, one per seed)."""
    curves: dict[str, list[dict]] = {}
    for run in plan:
        curves.setdefault(run.label, []).append(run_curves(run.run_dir, run.responses_per_step))
    return {
        "summary": summarize(curves, target),
        "base": base_label,
        "tokens_ratio": tokens_ratio(curves, base_label, target) if base_label else None,
        "tokens_ratio_stay": (
            tokens_ratio(curves, base_label, target, stay=True) if base_label else None
        ),
        "curves": curves,
    }


def _write_outputs(out: Path, result: dict, table: str, curves: dict, target: float) -> None:
    """``summary.json`` (``result``) and ``compare.md`` (``table``), written atomically, and
    ``compare.png`` (the curves overlaid) into ``out``."""
    from otbrl.store.files import atomic_write_text
    from otbrl.store.plain import json_safe

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        out / "summary.json", json.dumps(json_safe(result), indent=2, default=str) + "\n"
    )
    atomic_write_text(out / "compare.md", table + "\n")
    plot_compare(curves, target, out / "compare.png")


def check_settings(seeds, budget_responses, prompts, updates_per_step, jobs) -> None:
    """``ValueError`` naming the option when a comparison setting is out of range."""
    for flag, value in (
        ("--seeds", seeds),
        ("--budget", budget_responses),
        ("--prompts", prompts),
        ("--updates-per-step", updates_per_step),
        ("--jobs", jobs),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag}: expected an integer >= 1, got {value!r}")
    if prompts % updates_per_step:
        raise ValueError(
            f"--prompts {prompts} must be divisible by --updates-per-step {updates_per_step} "
            "(each optimizer step takes an equal share of the step's prompts)"
        )


def check_base(base: str | None, arm_list: list[tuple[str, int]]) -> str | None:
    """The label of the ``--base`` arm (``"grpo:32"`` -> ``"GRPO N=32"``), None without one;
    ``ValueError`` when it is not one of the arms."""
    if base is None:
        return None
    try:
        arms = parse_arms(base)
    except ValueError:
        arms = []
    if len(arms) != 1 or arms[0] not in arm_list:
        known = ",".join(f"{name}:{n}" for name, n in arm_list)
        raise ValueError(f"--base: expected one of the arms ({known}), got {base!r}")
    return arm_label(*arms[0])


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``otbrl compare``."""
    parser = argparse.ArgumentParser(
        prog="otbrl compare",
        description="OTB vs GRPO (or any estimators) trained at an equal token budget over "
        "several seeds: tokens to a target validation accuracy, final accuracy, grad norms, "
        "a markdown table and an overlay plot.",
    )
    parser.add_argument("--config", default=None, help="YAML file with config groups")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted config overrides for every run"
    )
    parser.add_argument(
        "--arms",
        default=ARMS,
        help="estimator:n, comma-separated; estimator = a registered name or an alias "
        f"(drgrpo, otb_notail, otb_uniform, otb_loo, otb); default {ARMS}",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm")
    parser.add_argument(
        "--budget",
        type=int,
        default=BUDGET,
        help=f"sampled responses per run, all arms equal (default {BUDGET})",
    )
    parser.add_argument(
        "--prompts", type=int, default=PROMPTS, help=f"prompts per RL step (default {PROMPTS})"
    )
    parser.add_argument(
        "--updates-per-step", type=int, default=2, help="optimizer steps per RL step (default 2)"
    )
    parser.add_argument(
        "--target",
        type=float,
        default=TARGET,
        help=f"validation accuracy target (default {TARGET})",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs trained at once, each its own process (default 1)"
    )
    parser.add_argument(
        "--base",
        default=None,
        metavar="ESTIMATOR:N",
        help="an arm to divide every arm's tokens to target by (a bootstrap 95%% interval "
        "over seeds), e.g. grpo:32",
    )
    parser.add_argument("--out-dir", default="runs/compare")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m otbrl.research.compare [--config F] [key=value ...] [--arms ...] ...``"""
    # overrides may sit before, between and after the options (argparse alone takes one run)
    args = build_parser().parse_intermixed_args(argv)
    try:
        parse_arms(args.arms)
        check_settings(args.seeds, args.budget, args.prompts, args.updates_per_step, args.jobs)
        check_base(args.base, parse_arms(args.arms))
    except ValueError as err:  # one line, before any model loads
        print(f"otbrl compare: {err}", file=sys.stderr)
        return 2
    try:
        run_compare(
            args.config,
            args.overrides,
            arms=args.arms,
            seeds=args.seeds,
            budget_responses=args.budget,
            prompts=args.prompts,
            updates_per_step=args.updates_per_step,
            target=args.target,
            out_dir=args.out_dir,
            jobs=args.jobs,
            base=args.base,
        )
    except ValueError as err:  # a config error or a finished run with other settings
        print(f"otbrl compare: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # training runs failed (named, with their logs)
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
