"""RL on the built-in tool task raises the tool-call rate: a small model taught the call format
and the direct answers (which it cannot get right: 4-digit × 2-digit products) by a short SFT,
then a few dozen TIR-OTB steps from the exact-match reward alone."""

import pytest

from otbrl.config import load_config
from otbrl.data import get_task, write_parquet_rows
from run_utils import read_metrics
from tiny_models import VLLM_SIZE, taught_tool_model

SIZE = {**VLLM_SIZE, "num_hidden_layers": 2}  # hidden 64, 2 heads, 2 layers
STEPS = 16


def tool_run(tmp_path, seed: int) -> list[dict]:
    """SFT then ``STEPS`` TIR-OTB steps with ``trainer.seed=seed``: the run's metrics rows."""
    from otbrl.run.trainer import Trainer

    task = get_task("tool_arithmetic")
    path = tmp_path / "model"
    taught_tool_model(path, task, rows=4000, steps=300, **SIZE)
    train = write_parquet_rows(task.rows("train", 2000, seed=1), tmp_path / "train.parquet")
    val = write_parquet_rows(task.rows("val", 64, seed=0), tmp_path / "val.parquet")
    cfg = load_config(
        None,
        [
            f"model.path={path}",
            f"data.train_files=[{train}]",
            f"data.val_files=[{val}]",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"trainer.total_steps={STEPS}",
            "trainer.val_every=0",
            "trainer.logger=[jsonl]",
            "data.train_batch_size=16",
            "data.max_response_length=32",
            "rollout.n=8",
            "rollout.multi_turn.tools=[calculator]",
            "rollout.multi_turn.max_turns=3",
            "rollout.multi_turn.max_observation_tokens=16",
            "algorithm.adv_estimator=tir_optimal_token_baseline",
            "actor.lr=1e-3",
            "actor.warmup_steps=5",
            f"trainer.seed={seed}",
        ],
    )
    Trainer(cfg).fit()
    return read_metrics(tmp_path / "run")


@pytest.mark.slow
def test_rl_on_the_tool_task_raises_the_tool_call_rate(tmp_path):
    """The signal is built in: the SFT leaves a model that calls the calculator on about half
    of its samples and never answers right without it, so every group has reward variance and
    only calls earn reward. Measured on a 2-core AMD EPYC, trainer seeds 0-4 under ATen's avx512,
    avx2 and default kernels (15 runs of 40 steps): the call rate's 5-step mean went 0.56-0.64
    at the start to 0.96-1.00 by step 8 and stayed there (gain 0.36-0.43); the reward's went
    0.45-0.59 -> 0.74-0.96. Hence 16 steps, and a bound with 0.2 of room."""
    records = tool_run(tmp_path, seed=0)
    rate = [r["tool/call_rate"] for r in records if "tool/call_rate" in r]
    assert len(rate) == STEPS
    first, last = sum(rate[:5]) / 5, sum(rate[-5:]) / 5
    assert last >= first + 0.15, rate
    reward = [r["train/reward_mean"] for r in records if "train/reward_mean" in r]
    assert sum(reward[-5:]) > sum(reward[:5]), reward
