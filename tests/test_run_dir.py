"""A run directory belongs to one run: manifest, lock, same-config resume, nothing lost."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from ckpt_utils import flip_byte, truncate
from otbrl.config import ConfigError, load_config
from otbrl.config.keys import RESUME_MAY_DIFFER
from otbrl.run.claim import claim_run_dir
from otbrl.run.trainer import Trainer
from otbrl.store.checkpoint import list_checkpoints, verify_checkpoint
from otbrl.store.rundir import config_sha256
from run_utils import refused, stable_metrics

# tiny models: threads cost more than they give, and stay exact
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tiny_run, tmp_path_factory):
    """The tiny run's overrides, and its run finished: 4 steps, saved at steps 2 and 4."""
    finished = tmp_path_factory.mktemp("rundir") / "finished"
    Trainer(load_config(None, tiny_run(finished))).fit()
    return tiny_run, finished


def copy_run(setup, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(setup[1], run)
    return run


def test_manifest_and_lock_of_a_run(setup):
    _, run = setup
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["config"]["trainer"]["output_dir"] == str(run)
    assert manifest["config_sha256"] == config_sha256(manifest["config"])
    import otbrl

    assert manifest["otbrl_version"] == otbrl.__version__ and manifest["created_at"]
    (start,) = manifest["starts"]
    assert start["pid"] == os.getpid() and "resumed_from" not in start
    holder = json.loads((run / "run.lock").read_text())
    assert holder["pid"] == os.getpid()  # the last holder; released when fit() returned
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_2", "step_4"]


def test_resume_never_twice_loses_no_metrics(setup, tmp_path, capsys, no_model_loading):
    """The issue's case: resume=never on a finished run used to truncate metrics.jsonl and
    overwrite low checkpoints while keeping the old later ones (logged steps 1, 2, 7, 8)."""
    overrides, _ = setup
    run = copy_run(setup, tmp_path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"}
    for _ in range(2):
        argv = ["train", *overrides(run, "trainer.resume=never")]
        refused(argv, capsys, "'trainer.resume'", str(run), "trainer.overwrite")
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"}
    assert after == before


def test_overwrite_moves_the_old_run_aside(setup, tmp_path, capsys):
    overrides, _ = setup
    run = copy_run(setup, tmp_path)
    old_metrics = (run / "metrics.jsonl").read_bytes()
    extra = ("trainer.resume=never", "trainer.overwrite=true", "trainer.total_steps=2")
    Trainer(load_config(None, overrides(run, *extra))).fit()
    (moved,) = tmp_path.glob("run.old-*")
    assert f"moved the previous run in {run} to {moved}" in capsys.readouterr().err
    assert (moved / "metrics.jsonl").read_bytes() == old_metrics  # nothing deleted
    assert [p.name for p in list_checkpoints(moved / "checkpoints")] == ["step_2", "step_4"]
    assert [r["step"] for r in stable_metrics(run)] == [0, 1, 2]
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_2"]
    # the next resume=auto continues the new run, never the old one's step_4
    Trainer(load_config(None, overrides(run))).fit()
    assert [r["step"] for r in stable_metrics(run)] == [0, 1, 2, 3, 4]
    starts = json.loads((run / "run.json").read_text())["starts"]
    assert starts[0]["previous_run_moved_to"] == str(moved)
    assert starts[1]["resumed_from"] == str(run / "checkpoints" / "step_2")


def test_resume_with_another_config_is_refused_before_loading(
    setup, tmp_path, capsys, no_model_loading
):
    overrides, _ = setup
    run = copy_run(setup, tmp_path)
    manifest = (run / "run.json").read_bytes()
    argv = ["train", *overrides(run, "actor.lr=1e-4", "algorithm.adv_estimator=grpo")]
    refused(
        argv, capsys, "another configuration", "actor.lr", "adv_estimator",
        "'optimal_token_baseline' in the run, 'grpo' now",
    )  # fmt: skip
    assert (run / "run.json").read_bytes() == manifest  # nothing written
    # allow-listed keys may change: the claim succeeds and records them
    allowed = ("trainer.total_steps=6", "trainer.save_every=3", "trainer.logger=[jsonl,console]")
    claimed = claim_run_dir(load_config(None, overrides(run, *allowed)))
    try:
        assert claimed.resume_from == run / "checkpoints" / "step_4"
        start = claimed.manifest["starts"][-1]
        assert start["changed"]["trainer.total_steps"] == [4, 6]
        assert set(start["changed"]) <= RESUME_MAY_DIFFER
    finally:
        claimed.release()
    assert "resuming" in capsys.readouterr().err


def test_a_legacy_run_without_manifest_is_compared_with_its_config_yaml(setup, tmp_path):
    overrides, _ = setup
    run = copy_run(setup, tmp_path)
    (run / "run.json").unlink()
    with pytest.raises(ConfigError, match=r"data\.seed \(0 in the run, 3 now\)"):
        claim_run_dir(load_config(None, overrides(run, "data.seed=3")))
    claim_run_dir(load_config(None, overrides(run))).release()
    assert (run / "run.json").is_file()


HOLDER = """
import sys, time
from otbrl.config import load_config
from otbrl.run.claim import claim_run_dir
run = claim_run_dir(load_config(None, [f"trainer.output_dir={sys.argv[1]}"]))
print("ready", flush=True)
time.sleep(600)
"""


def test_second_process_on_a_locked_directory_exits_2(setup, tmp_path, capsys):
    """A run directory held by another process: ``otbrl train`` on it exits 2 with one line
    naming the holder (run here, in this process: the lock is the other process's)."""
    overrides, _ = setup
    run = tmp_path / "busy"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        refused(["train", *overrides(run)], capsys, f"in use by process {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    # the holder died: its stale lock file blocks nobody
    claim_run_dir(load_config(None, overrides(run))).release()


def test_flipped_bytes_fall_back_to_the_previous_checkpoint(setup, tmp_path, capsys):
    overrides, finished = setup
    run = copy_run(setup, tmp_path)
    flip_byte(run / "checkpoints" / "step_4" / "model.safetensors")
    Trainer(load_config(None, overrides(run))).fit()
    err = capsys.readouterr().err
    assert "damaged checkpoint" in err and "'model.safetensors'" in err and "SHA-256" in err
    assert f"resuming from {run / 'checkpoints' / 'step_2'}" in err
    # steps 3 and 4 were redone from step 2: the same metrics as the uninterrupted run
    assert stable_metrics(run) == stable_metrics(finished)
    assert (run / "checkpoints" / "corrupt-step_4").is_dir()  # moved aside, not deleted
    assert verify_checkpoint(run / "checkpoints" / "step_4") == 4
    damaged = json.loads((run / "run.json").read_text())["starts"][-1]["damaged_checkpoints"]
    assert damaged[0]["path"].endswith("step_4") and "model.safetensors" in damaged[0]["error"]


def test_an_old_step_resume_keeps_the_later_branch(setup, tmp_path, capsys):
    """``trainer.resume=<step_2>`` of a run that went on to step 4 starts a new branch (here
    one that ends at step 3): the abandoned step_4 and the logs up to it move to ``branch-*/``.
    On main step_4 stayed where it was, so ``resume=auto`` went back to the abandoned branch
    and retention (by step number) deleted the new branch's checkpoints first."""
    overrides, finished = setup
    run = copy_run(setup, tmp_path)
    start = run / "checkpoints" / "step_2"
    cut = "trainer.total_steps=3"
    Trainer(load_config(None, overrides(run, f"trainer.resume={start}", cut))).fit()
    assert "the later branch (step_4, its logs) moved to branch-" in capsys.readouterr().err
    (branch,) = run.glob("branch-*")
    assert verify_checkpoint(branch / "checkpoints" / "step_4") == 4
    assert stable_metrics(branch) == stable_metrics(finished)  # the abandoned branch's logs
    kept = json.loads((run / "run.json").read_text())["starts"][-1]["branch_kept"]
    assert kept["checkpoints"] == ["step_4"] and kept["path"] == str(branch)
    assert [c.name for c in list_checkpoints(run / "checkpoints")] == ["step_2", "step_3"]
    # resume=auto continues the new branch
    Trainer(load_config(None, overrides(run, "trainer.total_steps=4"))).fit()
    assert "from step_3 (step 3)" in capsys.readouterr().err


def test_explicit_resume_of_a_damaged_checkpoint_names_the_file(
    setup, tmp_path, capsys, no_model_loading
):
    overrides, _ = setup
    run = copy_run(setup, tmp_path)
    step = run / "checkpoints" / "step_4"
    truncate(step / "state" / "trainer_state.safetensors")
    argv = ["train", *overrides(tmp_path / "new", f"trainer.resume={step}")]
    refused(argv, capsys, "'trainer.resume'", "trainer_state.safetensors", "bytes")
    argv = ["train", *overrides(tmp_path / "new", f"trainer.resume={run}")]
    refused(argv, capsys, "complete checkpoint directory")


def test_output_dir_problems_are_one_line_before_loading(setup, tmp_path, capsys, no_model_loading):
    overrides, _ = setup
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    cases = [(a_file, "which is a file"), (a_file / "sub", "cannot be created")]
    if os.geteuid() == 0:  # root writes through permission bits; /sys refuses even root
        if os.path.isdir("/sys/kernel"):
            cases.append(("/sys/kernel", "not writable"))
    else:
        read_only = tmp_path / "read_only"
        read_only.mkdir(mode=0o500)
        cases.append((read_only, "not writable"))
    for out_dir, fragment in cases:
        refused(
            ["train", *overrides(out_dir)], capsys, "'trainer.output_dir'", fragment, str(out_dir)
        )


def test_a_failed_start_leaves_nothing_that_blocks_a_fixed_config(setup, tmp_path):
    """A start that fails before its first step (here: a weights file that does not load)
    leaves a manifest but no run: the corrected command, with another config, is not
    refused."""
    overrides, _ = setup
    run = tmp_path / "run"
    model = next(o.split("=", 1)[1] for o in overrides(run) if o.startswith("model.path="))
    broken = tmp_path / "broken_model"
    shutil.copytree(model, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Exception):  # noqa: B017 — the HF loader's own error
        Trainer(load_config(None, [*overrides(run), f"model.path={broken}"]))
    assert (run / "run.json").is_file()
    claim_run_dir(load_config(None, overrides(run))).release()  # lock released by the failure


def test_lock_conflicts_within_one_process_until_released(setup, tmp_path):
    overrides, _ = setup
    cfg = load_config(None, overrides(tmp_path / "run"))
    first = claim_run_dir(cfg)
    with pytest.raises(ConfigError, match=f"in use by process {os.getpid()}"):
        claim_run_dir(cfg)  # a second descriptor conflicts even within one process
    first.release()
    start = time.monotonic()
    claim_run_dir(cfg).release()
    assert time.monotonic() - start < 5


def test_a_file_system_without_locks_is_named(setup, tmp_path, monkeypatch):
    """``flock`` unsupported (NFS without a lock daemon): on main a misleading 'not writable'."""
    import errno

    import otbrl.store.files as files

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(files.fcntl, "flock", no_locks)
    overrides, _ = setup
    with pytest.raises(ConfigError, match="does not support locks") as err:
        claim_run_dir(load_config(None, overrides(tmp_path / "run")))
    assert err.value.key == "trainer.output_dir"


def test_run_json_keeps_the_hash_of_each_user_file_and_a_resume_says_when_it_changed(
    setup, tmp_path, capsys
):
    """The config names a reward file by path; what ran is its content: each start records
    the SHA-256 of every user code file (reward function, tool files), and a resume after an
    edit says which file changed."""
    import hashlib

    overrides, _ = setup
    reward = tmp_path / "reward.py"
    reward.write_text("def score(s, text, truth, extra):\n    return 1.0\n")
    tools = tmp_path / "tools.py"
    tools.write_text("def echo(x: str) -> str:\n    return x\n")
    args = overrides(
        tmp_path / "run",
        f"reward.function={reward}:score",
        f"rollout.multi_turn.tools=[calculator,{tools}:echo]",
    )
    claim_run_dir(load_config(None, args)).release()
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    (start,) = json.loads((tmp_path / "run" / "run.json").read_text())["starts"]
    assert start["user_files"] == {str(reward): digest(reward), str(tools): digest(tools)}
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')  # a step was logged
    capsys.readouterr()
    reward.write_text("def score(s, text, truth, extra):\n    return 0.5\n")
    claim_run_dir(load_config(None, [*args, "trainer.resume=auto"])).release()
    err = capsys.readouterr().err
    assert f"with {reward} edited since the last start" in err and str(tools) not in err
    starts = json.loads((tmp_path / "run" / "run.json").read_text())["starts"]
    assert (
        starts[1]["user_files"][str(reward)] == digest(reward) != start["user_files"][str(reward)]
    )
