"""A tiny model, small parquet files and the overrides of a seconds-long ``otbrl train`` run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from otbrl.data import get_task, write_parquet_rows
from otbrl.models import build_tiny_model


def tiny_run_factory(root: Path):
    """Build the model and data under ``root``; returns ``overrides(out_dir, *extra)``: a
    4-step run (4 prompts x 4 samples, 2 optimizer steps per RL step), saved every 2 steps."""
    model = build_tiny_model(
        root / "model", hidden_size=32, intermediate_size=64, num_hidden_layers=1
    )
    task = get_task("arithmetic")
    train = write_parquet_rows(task.rows("train", 32, seed=0), root / "train.parquet")
    val = write_parquet_rows(task.rows("val", 8, seed=0), root / "val.parquet")

    def overrides(out_dir, *extra):
        return [
            f"model.path={model}",
            f"trainer.output_dir={out_dir}",
            "trainer.total_steps=4",
            "trainer.save_every=2",
            "trainer.val_every=2",
            "trainer.logger=[jsonl]",
            "data.train_batch_size=4",
            f"data.train_files=[{train}]",
            f"data.val_files=[{val}]",
            "data.max_response_length=4",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=2",
            "actor.micro_batch_size=4",
            *extra,
        ]

    return overrides


# A random tiny model never answers right: a reward that varies inside each group (the parity of
# the response's length) gives the update a real gradient, so a missed weight sync would show.
LENGTH_REWARD = """
def score(data_source, solution_str, ground_truth, extra_info):
    return float(len(solution_str) % 2)
"""


def length_reward_file(root: Path) -> Path:
    """``root/reward.py`` with ``score`` = the response length's parity; returns its path."""
    path = root / "reward.py"
    path.write_text(LENGTH_REWARD)
    return path


def length_reward_files(root: Path, n_val: int) -> tuple[Path, Path, Path]:
    """(train.parquet with 32 arithmetic prompts, val.parquet with ``n_val``, the length-parity
    reward.py) under ``root``."""
    task = get_task("arithmetic")
    return (
        write_parquet_rows(task.rows("train", 32, seed=0), root / "train.parquet"),
        write_parquet_rows(task.rows("val", n_val, seed=0), root / "val.parquet"),
        length_reward_file(root),
    )


def kill_at_first_checkpoint(command: list[str], run_dir: Path, env: dict) -> None:
    """Start ``command`` (an ``otbrl train`` writing to ``run_dir``) and SIGKILL it as soon as
    its step-2 checkpoint is complete (``checkpoint.json`` is written last)."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = run_dir / "checkpoints" / "step_2" / "checkpoint.json"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.exists(), "the first checkpoint never appeared"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
