"""The long-response task ``chain_sum`` end to end: its demonstrations teach a fresh built-in
model to walk a chain, and a short RL run with the task's own reward (read from the parquet
export's ``data_source``) then improves on that warm start.

The full task (10-26 items, 46-162-token responses) takes ~15 min of SFT on two cores: the
study's warm start (docs/when-does-otb-help.md §5). This test runs the same code on chains of
3-5 items (the same class, alphabet, format and reward) so that it fits in a minute."""

import pytest
import torch

from otbrl.config import SFTConfig, load_config
from otbrl.data import ChainSumTask, write_parquet_rows
from otbrl.models import build_tiny_model, load_model_and_tokenizer
from otbrl.report.metrics_log import read_metrics
from otbrl.run.sft import run_sft
from otbrl.run.trainer import Trainer
from run_utils import data_files, train_overrides

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_short_rl_run_improves_on_the_warm_start(tmp_path):
    task = ChainSumTask(min_items=3, max_items=5, n_train=4000, n_val=64)
    path = build_tiny_model(tmp_path / "model", task="chain_sum", num_hidden_layers=2, seed=0)
    model, tokenizer = load_model_and_tokenizer(path)
    rows = task.rows("train", 2000, seed=0)
    val = task.rows("val")
    torch.manual_seed(0)
    warm = run_sft(
        model,
        tokenizer,
        rows,
        [task.demonstration(r) for r in rows],
        SFTConfig(lr=3e-3, warmup_steps=20, grad_clip=1.0, max_steps=400, target_accuracy=0.3),
        eval_rows=val,
        max_new_tokens=task.max_response_chars + 1,
    )
    assert warm["reached_target"], warm["accuracy"]
    model.save_pretrained(path)
    train = write_parquet_rows(task.rows("train", 512, seed=1), tmp_path / "train.parquet")
    valid = write_parquet_rows(val, tmp_path / "val.parquet")
    cfg = load_config(
        None,
        train_overrides(
            path,
            tmp_path / "run",
            *data_files(train, valid),
            f"data.max_response_length={task.max_response_chars + 1}",
            "data.train_batch_size=16",
            "rollout.n=4",
            "actor.lr=3e-4",
            "actor.ppo_mini_batch_size=8",
            "trainer.total_steps=30",
            "trainer.val_every=30",
        ),
    )
    Trainer(cfg).fit()
    accuracy = [r["val/accuracy"] for r in read_metrics(tmp_path / "run") if "val/accuracy" in r]
    assert len(accuracy) == 2
    assert accuracy[1] >= accuracy[0] + 0.15, accuracy
