"""A run SIGKILLed after its first checkpoint and resumed gives the uninterrupted run's metrics."""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from otbrl import cli
from otbrl.data import get_task, write_parquet_rows
from otbrl.models import build_tiny_model
from otbrl.store.checkpoint import latest_checkpoint
from run_utils import kill_at_first_checkpoint

VOLATILE = ("timing/", "throughput/", "memory/")  # measurements of the machine differ between runs


def command(model_dir, out_dir, train, val):
    return [
        sys.executable,
        "-m",
        "otbrl",
        "train",
        f"model.path={model_dir}",
        f"trainer.output_dir={out_dir}",
        "trainer.total_steps=6",
        "trainer.save_every=2",
        "trainer.val_every=3",
        "trainer.logger=[jsonl]",
        "trainer.resume=auto",
        "data.train_batch_size=4",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "data.max_response_length=4",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=2",
        "actor.micro_batch_size=4",
        "actor.ppo_epochs=2",
        "actor.warmup_steps=2",
    ]


def stable_metrics(out_dir):
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


@pytest.mark.slow
def test_sigkill_and_resume_matches_uninterrupted(tmp_path, one_thread):
    """Only the killed run needs a process of its own: the uninterrupted and the resumed run
    run in this one, on one torch thread as the child's ``OMP_NUM_THREADS=1`` gives it."""
    model_dir = build_tiny_model(
        tmp_path / "model", hidden_size=32, intermediate_size=64, num_hidden_layers=1
    )
    task = get_task("arithmetic")
    train = write_parquet_rows(task.rows("train", 32, seed=0), tmp_path / "train.parquet")
    val = write_parquet_rows(task.rows("val", 8, seed=0), tmp_path / "val.parquet")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # same thread count in both runs
    full = tmp_path / "full"
    assert cli.main(command(model_dir, full, train, val)[3:]) == 0

    killed = tmp_path / "killed"
    kill_at_first_checkpoint(command(model_dir, killed, train, val), killed, env)
    # the kill landed before the end (else this test proves nothing)
    assert not (killed / "summary.json").exists()
    resumed_from = latest_checkpoint(killed / "checkpoints")
    state = json.loads((resumed_from / "state" / "trainer_state.json").read_text())
    first_segment = state["trainer"]["wall_seconds"]

    assert cli.main(command(model_dir, killed, train, val)[3:]) == 0
    expected, got = stable_metrics(full), stable_metrics(killed)
    assert [r["step"] for r in got] == list(range(7))
    assert got == expected
    a = load_file(full / "checkpoints" / "step_6" / "model.safetensors")
    b = load_file(killed / "checkpoints" / "step_6" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the summary's wall time covers both segments: the resumed one plus the first one's
    # time up to the checkpoint it resumed from
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["wall_seconds"] >= summary["segment_wall_seconds"] + first_segment > 0
