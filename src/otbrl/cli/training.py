"""``otbrl train``, ``otbrl demo`` and ``otbrl sft``: the commands that train a model."""

from __future__ import annotations

import argparse
import time

from otbrl.cli.common import config_and_plan
from otbrl.cli.launch import launch
from otbrl.config import ConfigError

# the demo's promise is 10 minutes including the warm start; keep a margin for start-up,
# the final validation and the plot
DEMO_SECONDS = 560
# the demo's tuned preset (user overrides still win): two optimizer steps per RL step
DEMO_PRESET = [
    "trainer.output_dir=runs/demo",
    f"trainer.max_wall_seconds={DEMO_SECONDS}",
    "actor.ppo_mini_batch_size=16",
]


def train(args: argparse.Namespace) -> int:
    """``otbrl train``: RL training of the configured run; with ``--nproc-per-node N`` > 1, its
    configuration checked for N processes, then N processes started (``cli.launch``)."""
    nproc = getattr(args, "nproc_per_node", 1)
    if nproc > 1:  # one line and exit 2 for a mistake, before any process starts
        cfg, _ = config_and_plan(args, world_size=nproc)
        from otbrl.run.claim import claim_run_dir, claimed_for_children

        run = claim_run_dir(cfg, rank=0)  # held here for the run's life
        try:
            return launch(["train", *_config_argv(args)], nproc, env=claimed_for_children(run))
        finally:
            run.release()
    cfg, plan = config_and_plan(args)
    from otbrl.run.claim import claim_run_dir
    from otbrl.run.trainer import Trainer

    run = claim_run_dir(cfg)  # still before any model loads
    # one process, or one per device under torchrun: the same loop
    Trainer(cfg, plan, run).fit()
    return 0


def _config_argv(args: argparse.Namespace) -> list[str]:
    """The configuration arguments of ``args`` as a command line (``--config``, overrides)."""
    return [*(["--config", args.config] if args.config else []), *args.overrides]


def demo(args: argparse.Namespace) -> int:
    """``otbrl demo``: warm start + RL under ``DEMO_PRESET``; prints the accuracy gain."""
    cfg, plan = config_and_plan(args, DEMO_PRESET)
    from otbrl.run.claim import claim_run_dir
    from otbrl.run.trainer import Trainer

    start = time.perf_counter()
    run = claim_run_dir(cfg)
    trainer = Trainer(cfg, plan, run)  # pays for the warm start the first time, then cached
    if cfg.trainer.max_wall_seconds > 0:
        # the demo's wall budget covers the warm start: RL gets what the warm start left
        spent = time.perf_counter() - start
        trainer.settings.max_wall_seconds = max(1.0, cfg.trainer.max_wall_seconds - spent)
    summary = trainer.fit()
    before, after = summary.get("initial_val_accuracy"), summary.get("final_val_accuracy")
    wall = time.perf_counter() - start
    if before is None or after is None:
        print(f"demo finished in {wall:.0f} s (validation was off)")
        return 0
    print(
        f"validation accuracy: {before:.3f} (warm start) -> {after:.3f} (after RL, "
        f"{cfg.algorithm.adv_estimator}), gain {after - before:+.3f}; "
        f"{wall:.0f} s incl. warm start; curves: {cfg.trainer.output_dir}/curves.png"
    )
    if "final_val_accuracy_without_tools" in summary:
        rates = [summary.get(f"{k}_val_tool_call_rate") for k in ("initial", "final")]
        if None not in rates:
            print(f"tool-call rate: {rates[0]:.3f} -> {rates[1]:.3f}", end="; ")
        print(
            f"the final policy without its tools: {summary['final_val_accuracy_without_tools']:.3f}"
        )
    return 0


def sft(args: argparse.Namespace) -> int:
    """``otbrl sft``: the built-in model's (cached) supervised warm start."""
    cfg, plan = config_and_plan(args)
    if cfg.model.path != "builtin":
        raise ConfigError(
            "'model.path' must be 'builtin' for 'otbrl sft' (it warm-starts the built-in model)",
            "model.path",
        )
    from otbrl.run.build import model_path

    path = model_path(plan.spec.model)
    print(f"warm-started model: {path}")
    return 0
