"""What the multi-run studies (``distill_demo.py``, ``dynamic_sampling.py``) share: one
``otbrl train`` run per process that a killed study does not run again, and what its metrics
log says about accuracy and time."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

VAL_EVERY = 25  # steps between validations (500 prompts, greedy)
LAST = 3  # validations averaged into a run's final accuracy: one swings by ±0.1 on this task


def demo_overrides(out: Path, cache: Path, seed: int, steps: int) -> list[str]:
    """A run of the built-in arithmetic task as ``otbrl demo`` sets it up (its batch sizes, a
    warm start cached in ``cache``), ``steps`` RL steps into ``out``, validated every
    ``VAL_EVERY`` steps, logged to ``metrics.jsonl``."""
    return [
        f"trainer.output_dir={out}",
        f"sft.cache_dir={cache}",
        f"trainer.seed={seed}",
        f"trainer.total_steps={steps}",
        f"trainer.val_every={VAL_EVERY}",
        "actor.ppo_mini_batch_size=16",  # the demo's
        "trainer.logger=[jsonl]",
    ]


def run_once(out: Path, overrides: list[str]) -> dict:
    """One ``python -m otbrl train`` run into ``out``, its output in ``out.log``; skipped when
    it finished before (its ``summary.json`` exists), restarted when it was killed part-way.
    Returns its summary."""
    summary = out / "summary.json"
    if not summary.is_file():
        shutil.rmtree(out, ignore_errors=True)
        with out.with_suffix(".log").open("w") as f:
            cmd = [sys.executable, "-m", "otbrl", "train", *overrides]
            subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True)
    return json.loads(summary.read_text())


def records(out: Path) -> list[dict]:
    """The run's ``metrics.jsonl`` records, in order."""
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def val_curve(out: Path) -> list[tuple[int, float]]:
    """``(step, val/accuracy)`` of every validation of the run."""
    return [(r["step"], r["val/accuracy"]) for r in records(out) if "val/accuracy" in r]


def first_step_reaching(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first step of ``curve`` whose accuracy is at least ``target`` (None: never)."""
    return next((step for step, acc in curve if acc >= target), None)


def final_accuracy(curve: list[tuple[int, float]]) -> float:
    """The mean of the last ``LAST`` validations of ``curve``."""
    return sum(acc for _, acc in curve[-LAST:]) / LAST
