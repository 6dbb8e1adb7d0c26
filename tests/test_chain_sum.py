"""The long-response task ``chain_sum`` is learnable by RL: a short ``otbrl train`` run from its
warm start improves validation accuracy (the reward checks every step of the chain).

The warm start is shipped (``tests/data/chain_sum_warm_start``, 1.3 MB): the built-in model's
cached SFT on the task (``otbrl sft data.task=chain_sum``, seed 0: 625 steps to greedy accuracy
0.454, ~17 min on two cores, which a test cannot pay), stored in bf16 and trained here in fp32.
"""

import shutil
from pathlib import Path

import pytest

from otbrl import cli
from otbrl.report.metrics_log import read_metrics

WARM_START = Path(__file__).parent / "data" / "chain_sum_warm_start"

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_short_rl_run_improves_on_the_warm_start(tmp_path):
    model = shutil.copytree(WARM_START, tmp_path / "model")
    run = tmp_path / "run"
    code = cli.main(
        [
            "train",
            f"model.path={model}",
            "data.task=chain_sum",  # its preset: 136-token response budget, the tiny sizes
            "rollout.n=4",
            "data.train_batch_size=16",
            "actor.lr=1e-4",
            "trainer.total_steps=8",
            "trainer.val_every=8",
            "data.val_size=100",
            f"trainer.output_dir={run}",
            "trainer.logger=[jsonl]",
        ]
    )
    assert code == 0
    records = list(read_metrics(run))
    accuracy = [r["val/accuracy"] for r in records if "val/accuracy" in r]
    lengths = [r["train/response_length_mean"] for r in records if "policy/loss" in r]
    assert len(accuracy) == 2 and min(lengths) > 48  # long responses, as the task promises
    assert accuracy[1] >= accuracy[0] + 0.15, accuracy
