"""Helpers of the tests that run ``otbrl``: the overrides of a seconds-long ``otbrl train`` run,
its tiny model and small parquet files, its metrics, and the one-line errors it refuses with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from otbrl import cli
from otbrl.data import get_task, write_parquet_rows
from otbrl.models import build_tiny_model
from tiny_models import ONE_LAYER

# measurements of the machine: they differ between two runs of the same config
VOLATILE = ("timing/", "throughput/", "memory/")


def train_overrides(model, out_dir, *extra) -> list[str]:
    """The ``otbrl train`` overrides the tests' runs share, then ``extra`` (a later value of a
    key wins): ``model``, the run in ``out_dir`` logged to ``metrics.jsonl``, 4 prompts x 4
    samples of at most 4 tokens a step."""
    return [
        f"model.path={model}",
        f"trainer.output_dir={out_dir}",
        "trainer.logger=[jsonl]",
        "data.train_batch_size=4",
        "rollout.n=4",
        "data.max_response_length=4",
        *extra,
    ]


def data_files(train, val, reward=None) -> list[str]:
    """The overrides that train on ``train``, validate on ``val`` (parquet files) and, with
    ``reward`` (a ``.py`` file), score with its ``score`` function."""
    files = [f"data.train_files=[{train}]", f"data.val_files=[{val}]"]
    return files if reward is None else [*files, f"reward.function={reward}:score"]


def tiny_run_factory(root: Path):
    """Build the model and data under ``root``; returns ``overrides(out_dir, *extra)``: a
    4-step run (4 prompts x 4 samples, 2 optimizer steps per RL step), saved every 2 steps."""
    model = build_tiny_model(root / "model", **ONE_LAYER)
    task = get_task("arithmetic")
    train = write_parquet_rows(task.rows("train", 32, seed=0), root / "train.parquet")
    val = write_parquet_rows(task.rows("val", 8, seed=0), root / "val.parquet")
    run = ["trainer.total_steps=4", "trainer.save_every=2", "trainer.val_every=2"]
    batches = ["actor.ppo_mini_batch_size=2", "actor.micro_batch_size=4"]

    def overrides(out_dir, *extra):
        return train_overrides(model, out_dir, *data_files(train, val), *run, *batches, *extra)

    return overrides


def vllm_run_overrides(model_dir, data, out_dir, *extra) -> list[str]:
    """A 3-step ``rollout.name=vllm`` run on ``data`` (``length_reward_files``: train, val,
    reward) with ``actor.lr=1e-2``: large steps, so that a missed weight sync or a stale sample
    shows in the log-prob mismatch; then ``extra``."""
    run = ["rollout.name=vllm", "trainer.total_steps=3", "actor.lr=1e-2", "actor.warmup_steps=0"]
    return train_overrides(model_dir, out_dir, *data_files(*data), *run, *extra)


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl``, in order."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stable_metrics(run_dir: Path, volatile=VOLATILE) -> list[dict]:
    """``read_metrics`` without the keys that start with one of ``volatile``: what two runs of
    the same config must agree on."""
    return [
        {k: v for k, v in r.items() if not k.startswith(volatile)} for r in read_metrics(run_dir)
    ]


def refused(argv: list[str], capsys, *fragments: str) -> str:
    """``otbrl <argv>`` exits 2 with one line on stderr (no traceback) that holds every one of
    ``fragments``; returns the line. What the test printed before is dropped first."""
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    return err


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


# A user's environment (Gymnasium's shape, no otbrl import): the answer's length parity is its
# reward, and an even one gets a second try after the user turn ANSWER.
RETRY_ENV = """
class Retry:
    def __init__(self):
        self.tries = 0

    def reset(self, seed=None, options=None):
        return None, {}

    def step(self, action):
        self.tries += 1
        reward = float(len(action) % 2)
        if reward or self.tries >= 2:
            return None, reward, True, False, {}
        return ANSWER, 0.0, False, False, {}


def make(row):
    return Retry()
"""


def retry_env_file(root: Path, answer: str) -> Path:
    """``root/retry_env.py`` with ``make`` = ``RETRY_ENV`` answering ``answer`` (text the
    model's tokenizer can write); returns its path."""
    path = root / "retry_env.py"
    path.write_text(RETRY_ENV.replace("ANSWER", repr(answer)))
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


def spy_advantage(monkeypatch) -> list[dict]:
    """The keyword arguments (tensors cloned) of every ``compute_advantage`` call the trainer
    makes from now on in this test: the step's batch as the estimator got it. A step whose
    policy statistics come from its update's forwards with a group-local estimator
    (``stats_in_update="groups"``) calls it once per micro-batch of whole groups, then once
    over the whole batch: a step's last call is its batch."""
    import torch

    import otbrl.run.trainer as trainer_mod

    seen = []
    real = trainer_mod.compute_advantage

    def spy(name, **kwargs):
        seen.append({k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})
        return real(name, **kwargs)

    monkeypatch.setattr(trainer_mod, "compute_advantage", spy)
    return seen
