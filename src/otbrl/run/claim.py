"""Claiming the run directory for a run, before any model loads: the run layer's side of
``otbrl.store.rundir``, which reads no configuration — this hands it what makes the run this run
(its resolved configuration, the keys that may change on resume, the user code it executes).

``otbrl train`` claims right after the plan; ``otbrl train --nproc-per-node N`` claims in its
launcher, which holds the lock for the run's life and hands the claim to the processes it
starts (``CLAIMED``), so a run directory in use is one line before any process starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TextIO

from otbrl.config import Config, to_dict
from otbrl.config.keys import RESUME_MAY_DIFFER
from otbrl.config.resume import config_differences
from otbrl.store import rundir
from otbrl.store.rundir import RunDir, RunIdentity
from otbrl.user_code import file_sha256, spec_file

# a launcher's claim of the run directory, handed to the processes it starts
CLAIMED = "OTBRL_RUN_CLAIMED"


def claim_run_dir(cfg: Config, *, rank: int | None = None, stream: TextIO | None = None) -> RunDir:
    """Claim ``trainer.output_dir`` for the run of ``cfg`` before any model loads
    (``otbrl.store.rundir.claim_run_dir``: the lock, resume or refuse, the checkpoint to resume
    from, the manifest), with what makes the run this run: its resolved configuration, the keys
    that may change on resume (each declares it) and the user code files it executes.

    In a process that ``otbrl train --nproc-per-node`` started, the launcher claimed it already
    and holds its lock for the run's life (``CLAIMED``: the directory and the checkpoint it
    chose): this returns that claim, unlocked."""
    claimed = os.environ.get(CLAIMED)
    if claimed is not None:
        info = json.loads(claimed)
        resume = info["resume_from"]
        return RunDir(Path(info["path"]), resume_from=None if resume is None else Path(resume))
    t = cfg.trainer
    identity = RunIdentity(
        config=to_dict(cfg),
        differences=config_differences,
        may_differ=RESUME_MAY_DIFFER,
        user_files=user_file_hashes(cfg),
    )
    return rundir.claim_run_dir(
        t.output_dir, identity, resume=t.resume, overwrite=t.overwrite, rank=rank, stream=stream
    )


def claimed_for_children(run: RunDir) -> dict[str, str]:
    """The environment that hands ``run`` (claimed here) to the processes a launcher starts."""
    resume = None if run.resume_from is None else str(run.resume_from)
    return {CLAIMED: json.dumps({"path": str(run.path), "resume_from": resume})}


def user_file_hashes(cfg: Config) -> dict[str, str]:
    """SHA-256 of each user code file the run executes (``reward.function`` and
    ``rollout.multi_turn.tools`` given as ``file.py:fn``), by resolved path: what ran, kept
    with the run (the config names a path, whose content may change between starts)."""
    files = (spec_file(spec) for spec in [cfg.reward.function, *cfg.rollout.multi_turn.tools])
    return {str(file): file_sha256(file) for file in files if file is not None and file.is_file()}
