"""Training the planned runs of ``otbrl compare``: a run that already finished with the planned
configuration is reused, the others train in this process (``jobs=1``) or as ``jobs`` child
``otbrl train`` processes at once; an interrupted comparison stops its children."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from otbrl.children import die_with_parent


@dataclass
class ArmRun:
    """One arm × seed training run of the comparison."""

    label: str
    seed: int
    steps: int
    responses_per_step: int
    run_dir: Path
    cfg: object  # the validated otbrl.config.Config
    overrides: list[str]  # what turns the base config into this run


def finished(run: ArmRun) -> bool:
    """True when ``run`` already finished with exactly the planned configuration; a finished
    run whose saved ``config.yaml`` differs is a ``ValueError`` naming the first difference
    (reusing it would mix settings in one table)."""
    import yaml

    from otbrl.config import to_dict, upgrade_saved
    from otbrl.config.resume import flat_config

    if not (run.run_dir / "summary.json").is_file():
        return False
    saved = flat_config(upgrade_saved(yaml.safe_load((run.run_dir / "config.yaml").read_text())))
    planned = flat_config(to_dict(run.cfg))
    for key in sorted(set(saved) | set(planned)):
        if saved.get(key) != planned.get(key):
            raise ValueError(
                f"{run.run_dir} finished with {key}={saved.get(key)!r}, but this comparison "
                f"sets {planned.get(key)!r}: delete that run or use another --out-dir"
            )
    return True


def train_runs(plan: list[ArmRun], jobs: int, echo) -> None:
    """Train every run of ``plan`` that has not ``finished``, ``jobs`` at a time, echoing
    ``[k/K] label seed s: steps, seconds`` as each ends. Raises ``RuntimeError`` naming every
    failed run (only child processes can fail that way) after the others have finished."""
    todo = [run for run in plan if not finished(run)]
    done = 0

    def report(item, seconds):
        nonlocal done
        done += 1
        echo(
            f"[{done}/{len(todo)}] {item.label} seed {item.seed}: {item.steps} steps, "
            f"{seconds:.0f} s"
        )

    if jobs == 1:
        _train_in_process(todo, report)
        return
    failures = _train_in_processes(todo, jobs, report)
    if failures:
        raise RuntimeError("otbrl compare: runs failed:\n" + "\n".join(failures))


def _train_in_process(todo: list[ArmRun], report) -> None:
    """One run after the other with this process's ``Trainer``; an error propagates."""
    from otbrl.run.trainer import Trainer

    for item in todo:
        t0 = time.perf_counter()
        Trainer(item.cfg).fit()
        report(item, time.perf_counter() - t0)


def _train_in_processes(todo: list[ArmRun], jobs: int, report) -> list[str]:
    """``jobs`` runs at once, each a child ``otbrl train`` with ``cpu_count // jobs`` torch
    threads; returns one line per failed run. Ctrl-C / SIGTERM stop the children."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    children: set = set()
    stopping = False
    failures = []

    def train(item):
        if stopping:  # interrupted: the runs not started stay unstarted
            return item, "not started", 0.0
        t0 = time.perf_counter()
        error = _train_subprocess(item.cfg, item.run_dir, threads, children)
        return item, error, time.perf_counter() - t0

    with ThreadPoolExecutor(jobs) as pool:
        try:
            for item, error, seconds in pool.map(train, todo):
                if error:
                    failures.append(f"{item.label} seed {item.seed}: {error}")
                report(item, seconds)
        except BaseException:
            # Ctrl-C / SIGTERM reach this (main) thread: pass them on to the runs, which
            # stop at their newest checkpoint, and wait for them before leaving
            stopping = True
            for child in list(children):
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)
            raise
    return failures


def _train_subprocess(cfg, run_dir: Path, threads: int, children: set) -> str | None:
    """``otbrl train`` of the resolved ``cfg`` (every key in a YAML file beside the run) in a
    child process with ``threads`` torch threads; output to ``run_dir/train.log``; the child's
    ``Popen`` is in ``children`` while it runs (an interrupted comparison stops them). Returns
    None on success, else a one-line reason."""
    import yaml

    from otbrl.config import to_dict

    run_dir.mkdir(parents=True, exist_ok=True)
    planned = run_dir.parent / f"{run_dir.name}.planned.yaml"
    planned.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "otbrl", "train", "--config", str(planned)]
    with open(run_dir / "train.log", "w") as log:
        # SIGTERM when compare dies: the run stops cleanly and resumes on the next compare
        child = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        children.add(child)
        try:
            code = child.wait()
        finally:
            children.discard(child)
    if code == 0 and (run_dir / "summary.json").is_file():
        return None
    return f"exit code {code}; see {run_dir / 'train.log'}"
