"""Asynchronous RL side by side on this machine: synchronous (``trainer.max_staleness=0``)
against ``max_staleness`` 1 (also with ``rollout.partial_rollout``), 2, 4 with
``algorithm.off_policy=decoupled`` and 4 with ``off_policy=none``, all with
``rollout.mode=server`` (one vLLM server started here, shared by every arm through
``rollout.server.urls``; each run pushes its own initial weights).

Tasks: ``tool`` = the built-in tool task with a calculator whose latency is log-normal (median
0.2 s, p99 ~3 s, ``benchmarks/slow_calculator.py``); ``demo`` = the built-in arithmetic task.

    python benchmarks/async_rl.py [--task tool|demo] [--steps 30] [--seeds 0,1,2]
        [--arms sync,k1,k1-partial,k2,k4,k4-none] [--out runs/bench-async]

Per arm (mean over seeds): steps per minute, trainer idle fraction (synchronous: the share of
the wall time spent sampling, ``timing/rollout``; asynchronous: waiting for the producer,
``timing/trainer_wait``), mean staleness, the final validation accuracy, and the wall time
and samples at which validation first reached ``--target``. Last line: each arm's wall-time
ratio to the synchronous arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from otbrl import cli
from otbrl.config import load_config
from otbrl.rollout.server import ServerRollout
from otbrl.run.build import model_path
from otbrl.run.spec import resolve

HERE = Path(__file__).resolve().parent
ARMS = {
    "sync": ["trainer.max_staleness=0"],
    "k1": ["trainer.max_staleness=1", "algorithm.off_policy=decoupled"],
    "k1-partial": [
        "trainer.max_staleness=1",
        "algorithm.off_policy=decoupled",
        "rollout.partial_rollout=true",
    ],
    "k2": ["trainer.max_staleness=2", "algorithm.off_policy=decoupled"],
    "k4": ["trainer.max_staleness=4", "algorithm.off_policy=decoupled"],
    "k4-none": ["trainer.max_staleness=4", "algorithm.off_policy=none"],
}


def base_overrides(task: str) -> list[str]:
    common = ["model.path=builtin", "rollout.name=vllm", "trainer.logger=[jsonl]"]
    if task == "tool":
        tool = f"rollout.multi_turn.tools=[{HERE / 'slow_calculator.py'}:calculator]"
        return [*common, "data.task=tool_arithmetic", tool]
    return [*common, "data.task=arithmetic"]


def summarize(run: Path, target: float, samples_per_step: int) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    wall = json.loads((run / "summary.json").read_text())["wall_seconds"]
    waiting = sum(r.get("timing/trainer_wait", r.get("timing/rollout", 0.0)) for r in steps)
    elapsed, reached = 0.0, None
    for r in steps:
        elapsed += r.get("timing/step", 0.0) + r.get("timing/val", 0.0)
        if reached is None and r.get("val/accuracy", -1.0) >= target:
            reached = (elapsed, r["step"] * samples_per_step)
    finals = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    return {
        "steps_per_min": 60.0 * len(steps) / wall,
        "idle": waiting / wall,
        "staleness": statistics.mean(r.get("async/staleness_mean", 0.0) for r in steps),
        "dropped": sum(r.get("async/dropped_groups", 0.0) for r in steps),
        "acc0": finals[0],
        "acc": finals[-1],
        "wall": wall,
        "t_target": None if reached is None else reached[0],
        "n_target": None if reached is None else reached[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("tool", "demo"), default="tool")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--target", type=float, default=0.6, help="validation accuracy")
    parser.add_argument("--batch", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--val-size", type=int, default=64)
    parser.add_argument("--out", default="runs/bench-async")
    args = parser.parse_args()
    base = base_overrides(args.task)
    sizes = [f"data.train_batch_size={args.batch}", f"rollout.n={args.n}",
             f"data.val_size={args.val_size}", f"trainer.total_steps={args.steps}",
             f"trainer.val_every={max(1, args.steps // 5)}", "trainer.save_every=0"]  # fmt: skip
    model_dir = model_path(resolve(load_config(overrides=base)).model)
    server = ServerRollout(model_dir, seed=0)
    results: dict[str, list[dict]] = {}
    try:
        url = f"rollout.server.urls=[{server.servers[0].url}]"
        for seed in [int(s) for s in args.seeds.split(",")]:
            for arm in args.arms.split(","):
                run = Path(args.out) / args.task / f"{arm}-seed{seed}"
                overrides = [*base, *sizes, "rollout.mode=server", url, f"trainer.seed={seed}",
                             f"trainer.output_dir={run}", "trainer.resume=never",
                             "trainer.overwrite=true", *ARMS[arm]]  # fmt: skip
                start = time.perf_counter()
                if cli.main(["train", *overrides]) != 0:
                    raise SystemExit(f"{arm} seed {seed} failed")
                print(f"{arm} seed {seed}: {time.perf_counter() - start:.0f} s", flush=True)
                results.setdefault(arm, []).append(summarize(run, args.target, args.batch * args.n))
    finally:
        server.close()

    def mean(arm, key):
        values = [r[key] for r in results[arm] if r[key] is not None]
        return statistics.mean(values) if values else float("nan")

    print(f"\n{args.task} task, {args.steps} steps x {args.batch} prompts x {args.n} samples, "
          f"seeds {args.seeds}, target val accuracy {args.target}")  # fmt: skip
    head = ("arm", "steps/min", "idle", "staleness", "dropped", "val acc 0 -> end", "wall s",
            "s to target", "samples to target")  # fmt: skip
    print(" | ".join(head))
    for arm in results:
        reached = sum(r["t_target"] is not None for r in results[arm])
        print(f"{arm} | {mean(arm, 'steps_per_min'):.1f} | {mean(arm, 'idle'):.2f} | "
              f"{mean(arm, 'staleness'):.2f} | {mean(arm, 'dropped'):.0f} | "
              f"{mean(arm, 'acc0'):.3f} -> {mean(arm, 'acc'):.3f} | {mean(arm, 'wall'):.0f} | "
              f"{mean(arm, 't_target'):.0f} ({reached}/{len(results[arm])}) | "
              f"{mean(arm, 'n_target'):.0f}")  # fmt: skip
    if "sync" in results:
        ratios = [f"{arm} {mean(arm, 'wall') / mean('sync', 'wall'):.2f}" for arm in results]
        print("wall time / synchronous: " + ", ".join(ratios))
        ratios = [f"{arm} {mean(arm, 't_target') / mean('sync', 't_target'):.2f}"
                  for arm in results]  # fmt: skip
        print(f"time to {args.target} / synchronous (seeds that reached it): " + ", ".join(ratios))


if __name__ == "__main__":
    main()
