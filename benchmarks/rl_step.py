"""One RL step of the default demo with and without Σπ², measured side by side.

"with": OTB as configured (logit-gradient energy), so the actor's stats forward computes Σπ²
next to the log-probs and entropy. "without": the same step with OTB's uniform energy, which
needs no Σπ², so the forward skips it; the estimator does the same group arithmetic either way.
Every repeat restores the same weights, optimizer, data position and rollout seed, so both
variants run on identical samples; variants alternate (A B, B A, ...) and medians are reported.

    python benchmarks/rl_step.py [--repeats 20] [key=value ...]   # overrides as for otbrl train

Last line: ``sum_pi_squared_overhead = X.X %`` of the median step time.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import tempfile
import time

import torch

from otbrl.config import load_config
from otbrl.run.trainer import Trainer


def snapshot(trainer: Trainer) -> dict:
    policy = trainer.policy
    return {
        "model": copy.deepcopy(policy.model.state_dict()),
        "optimizer": copy.deepcopy(policy.optimizer.state_dict()),
        "engine": copy.deepcopy(policy.state_dict()),
        "data": trainer.source.state_dict(),
    }


def restore(trainer: Trainer, state: dict) -> None:
    policy = trainer.policy
    policy.model.load_state_dict(state["model"])
    policy.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
    policy.load_state_dict(copy.deepcopy(state["engine"]))
    trainer.source.load_state_dict(state["data"])
    trainer.step = 0  # the rollout seed is a function of the step: same samples every time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)

    out = tempfile.mkdtemp(prefix="otbrl-bench-")
    # the demo's preset (otbrl demo): two optimizer steps per RL step
    demo = ["actor.ppo_mini_batch_size=16"]
    cfg = load_config(None, [f"trainer.output_dir={out}", *demo, *args.overrides])
    trainer = Trainer(cfg)
    spec = trainer.spec
    with_needs = spec.needs | {"sum_pi_squared"}
    options = dict(spec.estimator_options)
    variants = {
        "with Σπ²": dataclasses.replace(spec, needs=with_needs, estimator_options=options),
        "without Σπ²": dataclasses.replace(
            spec,
            needs=with_needs - {"sum_pi_squared"},
            estimator_options={**options, "energy": "uniform"},
        ),
    }
    if cfg.algorithm.adv_estimator != "optimal_token_baseline":
        print("note: the 'without' variant switches OTB's energy; other estimators keep theirs")
    state = snapshot(trainer)
    times: dict[str, list[float]] = {name: [] for name in variants}
    stats_times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for repeat in range(args.warmup + args.repeats):
        order = names if repeat % 2 == 0 else names[::-1]
        for name in order:
            restore(trainer, state)
            trainer.spec = variants[name]
            start = time.perf_counter()
            metrics = trainer.train_step()
            elapsed = time.perf_counter() - start
            if repeat >= args.warmup:
                times[name].append(elapsed)
                stats_times[name].append(metrics["timing/old_stats"])

    sequences = cfg.data.train_batch_size * cfg.rollout.n
    print(
        f"RL step, {cfg.data.train_batch_size} prompts x {cfg.rollout.n} = {sequences} sequences, "
        f"{args.repeats} interleaved repeats, torch threads {torch.get_num_threads()}"
    )
    print(f"{'variant':<14}{'step median ms':>16}{'stats-forward ms':>18}{'step min ms':>13}")
    for name in names:
        print(
            f"{name:<14}{1e3 * statistics.median(times[name]):>16.1f}"
            f"{1e3 * statistics.median(stats_times[name]):>18.1f}"
            f"{1e3 * min(times[name]):>13.1f}"
        )
    with_t, without_t = (statistics.median(times[n]) for n in names)
    overhead = 100.0 * (with_t - without_t) / without_t
    print(f"sum_pi_squared_overhead = {overhead:.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
