"""What the multi-run studies (``distill_demo.py``, ``dynamic_sampling.py``) share: one
``otbrl train`` run per process that a killed study does not run again, and what its metrics
log says about accuracy and time."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path


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
