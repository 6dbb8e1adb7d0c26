"""RL on the built-in tool task raises the tool-call rate: a small model taught the call format
and the direct answers (which it cannot get right: 4-digit × 2-digit products) by a short SFT,
then a few dozen TIR-OTB steps from the exact-match reward alone."""

import json

import pytest
import torch

from otbrl.config import load_config
from otbrl.data import get_task, write_parquet_rows
from otbrl.models import build_tiny_model, load_model_and_tokenizer
from otbrl.run.sft import run_sft
from otbrl.tools import resolve_tools

SIZE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
SIZE["num_key_value_heads"] = 2
STEPS = 40


@pytest.mark.slow
def test_rl_on_the_tool_task_raises_the_tool_call_rate(tmp_path):
    from otbrl.run.trainer import Trainer

    task = get_task("tool_arithmetic")
    path = build_tiny_model(tmp_path / "model", task="tool_arithmetic", seed=0, **SIZE)
    model, tok = load_model_and_tokenizer(path)
    rows = task.rows("train", 4000, seed=0)
    with torch.random.fork_rng(devices=[]):
        run_sft(
            model, tok, rows, [task.demonstration(r) for r in rows],
            lr=3e-3, batch_size=64, max_steps=300, seed=0, tools=resolve_tools(["calculator"]),
        )  # fmt: skip
    model.save_pretrained(path)
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
            "rollout.multi_turn.max_tool_response_tokens=16",
            "algorithm.adv_estimator=tir_optimal_token_baseline",
            "actor.lr=1e-3",
            "actor.warmup_steps=5",
        ],
    )
    Trainer(cfg).fit()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    rate = [r["tool/call_rate"] for r in records if "tool/call_rate" in r]
    assert len(rate) == STEPS
    first, last = sum(rate[:5]) / 5, sum(rate[-5:]) / 5
    assert last >= first + 0.15, rate
    reward = [r["train/reward_mean"] for r in records if "train/reward_mean" in r]
    assert sum(reward[-5:]) > sum(reward[:5]), reward
