"""Several processes from the command line: ``otbrl train --nproc-per-node N`` checks the
configuration once and says a mistake in one line with exit 2 before any process starts (under
``torchrun`` every rank printed it, then ~35 lines of torchrun's report, exit 1); a rank's own
configuration error is said once, by rank 0; and the processes train."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from run_utils import refused, tiny_run_factory

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def overrides(tmp_path_factory):
    return tiny_run_factory(tmp_path_factory.mktemp("launch"))


def _otbrl(*argv: str, timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    env.pop("TORCHELASTIC_RUN_ID", None)
    return subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=timeout, env=env
    )


def _otbrl_lines(stderr: str) -> list[str]:
    """The lines otbrl says (the ranks' libraries may add warnings of their own)."""
    return [line for line in stderr.splitlines() if line.startswith("otbrl:")]


def test_a_config_error_is_one_line_before_any_process(overrides, tmp_path, capsys):
    out = tmp_path / "run"
    # a layout the 2 processes cannot have: found for world size 2, not 1
    argv = ["train", "--nproc-per-node", "2", *overrides(out, "actor.tensor_parallel_size=3")]
    refused(argv, capsys, "'actor.tensor_parallel_size'")
    assert not out.exists()  # nothing started


def test_a_run_directory_in_use_is_one_line_before_any_process(overrides, tmp_path):
    """The run directory held by another process: the launcher claims it before starting any
    process (it holds the lock for the run's life), so it is one line and exit 2 at once —
    found by rank 0 inside the processes, the other rank sat in its process group's start
    until torchrun killed it 30 s later. (The launched processes train: test_trainer_vllm.py's
    two-rank run goes through ``--nproc-per-node``.)"""
    out = tmp_path / "run"
    out.mkdir()
    run = overrides(out, "trainer.total_steps=1", "trainer.val_every=0", "trainer.save_every=0")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        done = _otbrl("otbrl", "train", "--nproc-per-node", "2", *run)
    finally:
        holder.kill()
        holder.wait()
    said = _otbrl_lines(done.stderr)
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(said) == 1 and "is in use by" in said[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr


def test_the_processes_take_the_launcher_s_claim(overrides, tmp_path, monkeypatch):
    """Rank 0 of a launched run takes the claim the launcher made (the directory, the verified
    checkpoint it chose to resume from) instead of claiming again, which its lock would refuse."""
    from otbrl.config import load_config
    from otbrl.run.claim import CLAIMED, claim_run_dir, claimed_for_children

    cfg = load_config(None, overrides(tmp_path / "run"))
    held = claim_run_dir(cfg, rank=0)
    try:
        held.resume_from = tmp_path / "run" / "checkpoints" / "step_2"  # as if it chose one
        monkeypatch.setenv(CLAIMED, claimed_for_children(held)[CLAIMED])
        taken = claim_run_dir(cfg, rank=0)  # no "in use by" refusal: the launcher holds it
        assert (taken.path, taken.resume_from) == (held.path, held.resume_from)
        assert not taken.owner
    finally:
        held.release()


HOLDER = """
import sys, time
from otbrl.store.files import lock_file
fd = lock_file(f"{sys.argv[1]}/run.lock", wait=False)
print("ready", flush=True)
time.sleep(600)
"""


def test_under_torchrun_rank_0_alone_says_it_and_explains_the_report(overrides, tmp_path):
    """A user's own ``torchrun``: its report cannot be stopped from inside, so rank 0 says the
    error once and one line on what the report below is; the other ranks say nothing. Rank 0
    starts 3 s after rank 1 here (a ``sitecustomize``): rank 1 exited at once, and torchrun
    stopped rank 0 before it had said anything ("otbrl: interrupted", seen under load)."""
    late = tmp_path / "late"
    late.mkdir()
    (late / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(3)\n"
    )
    path = os.pathsep.join(filter(None, [str(late), os.environ.get("PYTHONPATH")]))
    run = overrides(tmp_path / "run", "actor.lr=-1")
    done = _otbrl(
        "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "otbrl",
        "train", *run, PYTHONPATH=path,
    )  # fmt: skip
    said = _otbrl_lines(done.stderr)
    assert done.returncode != 0
    errors = [line for line in said if "config error" in line]
    assert len(errors) == 1 and "'actor.lr'" in errors[0], done.stderr[-3000:]
    assert len(said) == 2 and "torchrun's failure report below" in said[1], said


def test_the_flag_is_documented(capsys):
    from otbrl import cli

    assert cli.main(["train", "--help"]) == 0
    assert "--nproc-per-node" in capsys.readouterr().out
    assert Path(cli.__file__).parent.joinpath("launch.py").is_file()
