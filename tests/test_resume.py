"""A run SIGKILLed after its first checkpoint and resumed gives the uninterrupted run's metrics."""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from otbrl import cli
from otbrl.store.checkpoint import latest_checkpoint
from run_utils import kill_at_first_checkpoint, stable_metrics, tiny_run_factory

# the tiny run (run_utils), 6 steps of 2 epochs, checkpoints at steps 2, 4 and 6
RUN = ("trainer.total_steps=6", "trainer.val_every=3", "trainer.resume=auto")
EPOCHS = ("actor.ppo_epochs=2", "actor.warmup_steps=2")


@pytest.mark.slow
def test_sigkill_and_resume_matches_uninterrupted(tmp_path, one_thread):
    """Only the killed run needs a process of its own: the uninterrupted and the resumed run
    run in this one, on one torch thread as the child's ``OMP_NUM_THREADS=1`` gives it."""
    overrides = tiny_run_factory(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # same thread count in both runs
    full = tmp_path / "full"
    assert cli.main(["train", *overrides(full, *RUN, *EPOCHS)]) == 0

    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "otbrl", "train", *overrides(killed, *RUN, *EPOCHS)]
    kill_at_first_checkpoint(command, killed, env)
    # the kill landed before the end (else this test proves nothing)
    assert not (killed / "summary.json").exists()
    resumed_from = latest_checkpoint(killed / "checkpoints")
    state = json.loads((resumed_from / "state" / "trainer_state.json").read_text())
    first_segment = state["trainer"]["wall_seconds"]

    assert cli.main(command[3:]) == 0
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
