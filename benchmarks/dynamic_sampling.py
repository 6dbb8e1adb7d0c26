"""Dynamic sampling against the plain step, on the built-in arithmetic task: wall time to a
target validation accuracy, over seeds.

    python benchmarks/dynamic_sampling.py --out runs/dynamic-sampling     # ~25 min, 2 cores

Each seed starts from its warm start (the demo's, cached under ``--out``/cache) and trains
``--steps`` RL steps with the demo's estimator (OTB) and batch sizes, once without and once with
``algorithm.dynamic_sampling=true``. As accuracy climbs most groups of 8 get the same reward
(all right), and on the way many get none right: the share of groups without signal is
measured (``dynamic_sampling/kept_frac`` of the dynamic arm). Time to the target is the RL
steps' own time (``timing/step``, summed up to the first validation at or above ``--target``;
validation itself is the same in both arms and left out). Runs are one process each and a
finished one is not run again: a killed study resumes. Prints a table and the ratio of the
medians; writes ``results.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from study_runs import (
    demo_overrides,
    final_accuracy,
    first_step_reaching,
    records,
    run_once,
    val_curve,
)

ARMS = {"plain": [], "dynamic": ["algorithm.dynamic_sampling=true"]}


def _seconds_to(out: Path, step: int | None) -> float | None:
    """RL time (``timing/step`` summed) of the run's steps up to ``step`` (None: never)."""
    if step is None:
        return None
    return sum(r["timing/step"] for r in records(out) if "timing/step" in r and r["step"] <= step)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/dynamic-sampling")
    p.add_argument("--seeds", default="0,2,3")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--target", type=float, default=0.8, help="validation accuracy")
    args = p.parse_args()
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict = {"target": args.target, "steps": args.steps, "runs": {}}
    for seed in seeds:
        for arm, extra in ARMS.items():
            out = root / f"{arm}-seed{seed}"
            run_once(out, [*demo_overrides(out, root / "cache", seed, args.steps), *extra])
            curve = val_curve(out)
            reached = first_step_reaching(curve, args.target)
            steps = [r for r in records(out) if "timing/step" in r]
            kept = [
                r["dynamic_sampling/kept_frac"] for r in steps if "dynamic_sampling/kept_frac" in r
            ]
            results["runs"][f"{arm}/{seed}"] = {
                "curve": curve,
                "final": final_accuracy(curve),
                "step_reaching_target": reached,
                "seconds_to_target": _seconds_to(out, reached),
                "seconds_per_step": statistics.median(r["timing/step"] for r in steps),
                "kept_frac_mean": statistics.mean(kept) if kept else None,
            }
            print(f"seed {seed} {arm}: {results['runs'][f'{arm}/{seed}']}"[:200], flush=True)
    (root / "results.json").write_text(json.dumps(results, indent=1))
    print(f"seed | arm | step reaching {args.target} | RL seconds to it | s/step | signal share "
          "| final (mean of the last 3 checks)")  # fmt: skip
    for seed in seeds:
        for arm in ARMS:
            r = results["runs"][f"{arm}/{seed}"]
            secs = r["seconds_to_target"]
            kept = r["kept_frac_mean"]
            print(f"{seed} | {arm} | {r['step_reaching_target']} | "
                  f"{'-' if secs is None else f'{secs:.0f}'} | {r['seconds_per_step']:.2f} | "
                  f"{'-' if kept is None else f'{kept:.2f}'} | {r['final']:.3f}")  # fmt: skip
    times = {
        arm: [results["runs"][f"{arm}/{s}"]["seconds_to_target"] for s in seeds] for arm in ARMS
    }
    if all(t is not None for ts in times.values() for t in ts):
        ratio = statistics.median(times["dynamic"]) / statistics.median(times["plain"])
        print(f"median RL time to {args.target}: dynamic / plain = {ratio:.2f}")
    else:
        print("an arm did not reach the target in every seed: see the table")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
