"""On-policy distillation against RL from the reward alone, on the built-in arithmetic task.

    python benchmarks/distill_demo.py --out runs/distill-demo      # ~40 min on 2 CPU cores

The teacher is the built-in model after RL (the demo's run: ``TEACHER_SEED``'s warm start,
``TEACHER_STEPS`` RL steps, its last checkpoint). Each student seed starts from its own fresh
warm start (none of them the teacher's) and trains ``--steps`` RL steps in three arms, all
with the demo's estimator (OTB) and batch sizes:

- ``rl``: the task's reward alone (what ``otbrl demo`` does);
- ``distill``: the teacher's per-token signal alone (``algorithm.distill.task_reward=false``:
  the reward is scored and logged, not trained on);
- ``distill+rl``: both.

Reported: validation accuracy (500 prompts, greedy) every 25 steps; each arm's final accuracy as
the mean of its last ``LAST`` validations (one validation swings by ±0.1 between neighbouring
checks on this task, in every arm); and for every arm the first step at which it reached the
``rl`` arm's final accuracy of the same seed. Each run is one ``python -m otbrl train``
process; a run whose ``summary.json`` exists is not run again, so a killed study resumes where
it stopped. Writes ``results.json`` and ``distill_demo.png`` into ``--out`` (``--figure`` copies
the image).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from study_runs import (
    LAST,
    demo_overrides,
    final_accuracy,
    first_step_reaching,
    run_once,
    val_curve,
)

TEACHER_SEED = 1
TEACHER_STEPS = 800
ARMS = {
    "rl": [],
    "distill": ["algorithm.distill.task_reward=false"],
    "distill+rl": [],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/distill-demo")
    p.add_argument("--seeds", default="0,2,3", help="student seeds (not the teacher's)")
    p.add_argument("--steps", type=int, default=400, help="RL steps per student run")
    p.add_argument("--coef", type=float, default=1.0, help="algorithm.distill.coef")
    p.add_argument("--figure", default=None, help="also copy the figure here")
    args = p.parse_args()
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    cache = root / "cache"
    seeds = [int(s) for s in args.seeds.split(",")]
    if TEACHER_SEED in seeds:
        raise SystemExit(f"--seeds: {TEACHER_SEED} is the teacher's seed")
    teacher_run = root / "teacher"
    teacher = run_once(
        teacher_run,
        [
            *demo_overrides(teacher_run, cache, TEACHER_SEED, TEACHER_STEPS),
            f"trainer.save_every={TEACHER_STEPS}",
        ],
    )
    teacher_dir = teacher_run / "checkpoints" / f"step_{TEACHER_STEPS}"
    print(f"teacher: {teacher['initial_val_accuracy']} -> {teacher['final_val_accuracy']}")
    distill = [
        f"algorithm.distill.teacher_path={teacher_dir}",
        f"algorithm.distill.coef={args.coef}",
    ]
    results: dict = {
        "teacher": {"seed": TEACHER_SEED, "steps": TEACHER_STEPS, **teacher},
        "steps": args.steps,
        "coef": args.coef,
        "runs": {},
    }
    for seed in seeds:
        for arm, extra in ARMS.items():
            out = root / f"{arm}-seed{seed}"
            more = [] if arm == "rl" else [*distill, *extra]
            summary = run_once(out, [*demo_overrides(out, cache, seed, args.steps), *more])
            curve = val_curve(out)
            final = final_accuracy(curve)
            results["runs"][f"{arm}/{seed}"] = {
                "initial": summary["initial_val_accuracy"],
                "final": final,
                "last": summary["final_val_accuracy"],
                "curve": curve,
            }
            print(
                f"seed {seed} {arm}: {summary['initial_val_accuracy']} -> {final:.3f} "
                f"(mean of the last {LAST} validations)",
                flush=True,
            )
    reach = {}
    for seed in seeds:
        target = results["runs"][f"rl/{seed}"]["final"]
        for arm in ARMS:
            curve = results["runs"][f"{arm}/{seed}"]["curve"]
            reach[f"{arm}/{seed}"] = first_step_reaching(curve, target)
    results["steps_to_rl_final"] = reach
    (root / "results.json").write_text(json.dumps(results, indent=1))
    figure = _plot(results, seeds, root / "distill_demo.png")
    if args.figure:
        shutil.copyfile(figure, args.figure)
    print(_table(results, seeds))
    return 0


def _table(results: dict, seeds: list[int]) -> str:
    """One row per seed: the start, each arm's final accuracy and the first step at which it
    reached the rl arm's final accuracy ("-": never within the run)."""
    head = " | ".join(f"{arm} final (step reaching rl's)" for arm in ARMS)
    lines = [f"seed | start | {head}"]
    runs, reach = results["runs"], results["steps_to_rl_final"]
    for seed in seeds:
        cells = [f"{runs[f'rl/{seed}']['initial']:.3f}"]
        for arm in ARMS:
            step = reach[f"{arm}/{seed}"]
            final = runs[f"{arm}/{seed}"]["final"]
            cells.append(f"{final:.3f} ({'-' if step is None else step})")
        lines.append(f"{seed} | " + " | ".join(cells))
    return "\n".join(lines)


def _plot(results: dict, seeds: list[int], path: Path) -> Path:
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib.pyplot as plt

    colors = {"rl": "tab:gray", "distill": "tab:blue", "distill+rl": "tab:green"}
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for arm, color in colors.items():  # each seed thin, their mean thick
        curves = [results["runs"][f"{arm}/{seed}"]["curve"] for seed in seeds]
        for curve in curves:
            steps, acc = zip(*curve, strict=True)
            ax.plot(steps, acc, color=color, alpha=0.3, lw=0.8)
        mean = [sum(c[i][1] for c in curves) / len(curves) for i in range(len(curves[0]))]
        ax.plot(steps, mean, color=color, lw=2.0, label=f"{arm} (mean of {len(seeds)} seeds)")
    teacher = results["teacher"]["final_val_accuracy"]
    ax.axhline(teacher, color="black", ls="--", lw=0.8, label=f"teacher ({teacher:.2f})")
    ax.set_xlabel("RL step")
    ax.set_ylabel("validation accuracy (500 prompts, greedy)")
    ax.set_title(f"arithmetic: distillation vs RL alone, seeds {','.join(map(str, seeds))}")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
