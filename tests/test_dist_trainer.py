"""`otbrl train` with a sharded engine end to end: TP = 2 run, checkpoint, resume on 1 process."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dist_utils import check_ok, launch

pytestmark = pytest.mark.distributed


def _train_worker(rank, world_size, port, overrides):
    from otbrl.config import load_config
    from otbrl.dist_trainer import run_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    return run_distributed(load_config(None, overrides))


def test_tp_run_checkpoints_and_resumes_on_one_process(tmp_path):
    from otbrl.cli import main
    from otbrl.models import build_tiny_model

    model = build_tiny_model(
        tmp_path / "model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    run = tmp_path / "run"
    common = [
        f"model.path={model}",
        f"trainer.output_dir={run}",
        "data.train_batch_size=4",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=4",
        "data.val_size=8",
        "trainer.val_every=2",
        "trainer.logger=[jsonl]",
    ]
    # the tiny model's vocabulary (19) is odd: TP shards it unevenly (10 + 9)
    tp_run = ["actor.engine=tp", "actor.tensor_parallel_size=2", "trainer.total_steps=2"]
    check_ok(launch(_train_worker, 2, tmp_path / "w1", [*common, *tp_run, "trainer.save_every=2"]))
    assert (run / "checkpoints" / "step_2" / "checkpoint.json").is_file()
    assert (run / "checkpoints" / "sharded" / "step_2" / ".metadata").is_file()
    # resume the TP checkpoint with one FSDP process for one more step
    resume = ["actor.engine=fsdp", "trainer.total_steps=3", "trainer.save_every=3"]
    check_ok(launch(_train_worker, 1, tmp_path / "w2", [*common, *resume]))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "policy/loss" in line]
    assert steps == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(line["policy/entropy_mean"])) for line in lines[1:])
    # export the resumed checkpoint to a plain HF directory and load it
    assert main(["export", str(run / "checkpoints" / "step_3"), str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.vocab_size == 19
