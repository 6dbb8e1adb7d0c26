"""`otbrl train` on several processes end to end: the one loop under torchrun (data parallel by
default), and checkpoints that resume on another strategy and world size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dist_utils import check_ok, launch
from tiny_models import TWO_LAYERS

pytestmark = pytest.mark.distributed

SMALL = {**TWO_LAYERS, "num_key_value_heads": 2}  # 4 heads


def _train_worker(rank, world_size, port, overrides):
    from otbrl.config import load_config
    from otbrl.run.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    return Trainer(load_config(None, overrides)).fit()


def _common(model, run):
    return [
        f"model.path={model}",
        "data.task=arithmetic",
        f"trainer.output_dir={run}",
        "data.train_batch_size=4",
        "rollout.n=2",
        "data.val_size=8",
        "trainer.val_every=2",
        "trainer.logger=[jsonl]",
    ]


def _steps(run):
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [line["step"] for line in lines if "policy/loss" in line], lines


def test_tp_checkpoint_resumes_under_fsdp_and_on_one_process(tmp_path):
    from otbrl.cli import main
    from otbrl.models import build_tiny_model

    model = build_tiny_model(tmp_path / "model", **SMALL)
    run = tmp_path / "run"
    common = _common(model, run)
    # the tiny model's vocabulary (19) is odd: TP shards it unevenly (10 + 9)
    tp_run = ["actor.strategy=tp", "actor.tensor_parallel_size=2", "trainer.total_steps=2"]
    check_ok(launch(_train_worker, 2, tmp_path / "w1", [*common, *tp_run, "trainer.save_every=2"]))
    meta = json.loads((run / "checkpoints" / "step_2" / "checkpoint.json").read_text())
    assert meta["world_size"] == 2
    # resume the TP checkpoint with one FSDP process for one more step
    resume = ["actor.strategy=fsdp", "trainer.total_steps=3", "trainer.save_every=3"]
    check_ok(launch(_train_worker, 1, tmp_path / "w2", [*common, *resume]))
    # then on one plain process, no process group at all
    plain = ["actor.strategy=single", "trainer.total_steps=4", "trainer.save_every=4"]
    check_ok(launch(_train_worker, 1, tmp_path / "w3", [*common, *plain]))
    steps, lines = _steps(run)
    assert steps == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(line["policy/entropy_mean"])) for line in lines[1:])
    # export the resumed checkpoint to a plain HF directory and load it
    assert main(["export", str(run / "checkpoints" / "step_4"), str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.vocab_size == 19


def test_torchrun_without_strategy_key_runs_data_parallel(tmp_path):
    """`torchrun --nproc_per_node=2 -m otbrl train` with no strategy key: FSDP2 on 2 ranks; the
    one-process checkpoint of a first segment resumes there."""
    from otbrl.cli import main
    from otbrl.models import build_tiny_model

    model = build_tiny_model(tmp_path / "model", **SMALL)
    run = tmp_path / "run"
    common = _common(model, run)
    assert main(["train", *common, "trainer.total_steps=1", "trainer.save_every=1"]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "otbrl", "train", *common, "trainer.total_steps=2", "trainer.save_every=2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads((run / "checkpoints" / "step_2" / "checkpoint.json").read_text())
    assert meta["world_size"] == 2
    config = (run / "checkpoints" / "step_2" / "config.yaml").read_text()
    assert "strategy: auto" in config
    steps, _ = _steps(run)
    assert steps == [1, 2]


def test_critic_trains_under_tp_and_fsdp_and_resumes_across_them(tmp_path):
    """PPO with GAE on 2 processes: the critic is an engine on the actor's layout (TP, then
    FSDP2), checkpointed and resumed with the actor."""
    from otbrl.models import build_tiny_model

    model = build_tiny_model(tmp_path / "model", **SMALL)
    run = tmp_path / "run"
    common = [*_common(model, run), "algorithm.adv_estimator=gae", "critic.lr=0.01"]
    tp_run = ["actor.tensor_parallel_size=2", "trainer.total_steps=2", "trainer.save_every=2"]
    check_ok(launch(_train_worker, 2, tmp_path / "w1", [*common, *tp_run]))
    assert (run / "checkpoints" / "step_2" / "critic" / "model.safetensors").is_file()
    assert list((run / "checkpoints" / "step_2" / "state" / "critic").glob("shard-*.safetensors"))
    check_ok(launch(_train_worker, 2, tmp_path / "w2", [*common, "trainer.total_steps=3"]))
    steps, lines = _steps(run)
    assert steps == [1, 2, 3]
    for line in lines[1:]:
        assert torch.isfinite(torch.tensor(line["critic/value_loss"])), line
        assert line["critic/skipped_steps"] == 0


# rank 0's groups: the response's length parity (signal in most groups); rank 1's: always 0
RANKED_REWARD = """
import os

def score(data_source, solution_str, ground_truth, extra_info):
    return float(len(solution_str) % 2) if os.environ["RANK"] == "0" else 0.0
"""


def test_dynamic_sampling_ranks_agree_on_their_rounds(tmp_path):
    """Each rank fills its own share with groups that carry signal; sampling is collective
    (the HF backend on an FSDP2-sharded model), so a rank already full samples on with the
    others. Here rank 1 never finds a signal: both ranks sample all 3 rounds every step (the
    ranks' mean is 3), rank 1 fills its share, and both train every step."""
    from otbrl.models import build_tiny_model

    model = build_tiny_model(tmp_path / "model", **SMALL)
    (tmp_path / "ranked.py").write_text(RANKED_REWARD)
    run = tmp_path / "run"
    overrides = [*_common(model, run), "trainer.total_steps=3", "trainer.save_every=0",
                 "algorithm.dynamic_sampling=true", "algorithm.max_sample_rounds=3",
                 "rollout.n=4", f"reward.function={tmp_path / 'ranked.py'}:score"]  # fmt: skip
    check_ok(launch(_train_worker, 2, tmp_path, overrides))
    steps, lines = _steps(run)
    assert steps == [1, 2, 3]
    for line in [line for line in lines if "policy/loss" in line]:
        assert line["dynamic_sampling/rounds"] == 3
        assert line["dynamic_sampling/filled_frac"] >= 0.5  # rank 1's whole share, at least


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "grpo"])
def test_one_forward_on_two_ranks_equals_the_separate_pass(tmp_path, estimator):
    """FSDP2 on 2 ranks: the step whose policy statistics come from the update's forwards
    (OTB: micro-batches of whole groups; GRPO: advantages first) logs the metrics of the step
    with the separate pass (the same samples, the same start)."""
    from otbrl.models import build_tiny_model

    model = build_tiny_model(tmp_path / "model", **SMALL)
    reward = tmp_path / "reward.py"  # scores that vary within a group: a signal to agree on
    reward.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return (sum(map(ord, solution_str)) % 5) / 4.0\n"
    )
    logged = {}
    for one in ("true", "false"):
        run = tmp_path / f"run-{one}"
        extra = ["trainer.total_steps=1", "trainer.val_every=0", f"actor.one_forward={one}"]
        extra += ["actor.calculate_sum_pi_squared=true", f"algorithm.adv_estimator={estimator}"]
        extra += [f"reward.function={reward}:score"]
        check_ok(launch(_train_worker, 2, tmp_path / f"w-{one}", [*_common(model, run), *extra]))
        logged[one] = _steps(run)[1][-1]
    fused, separate = logged["true"], logged["false"]
    assert fused["policy/one_forward"] == 1.0 and separate["policy/one_forward"] == 0.0
    assert separate["policy/grad_norm"] > 0
    steady = [k for k in separate if not k.startswith(("timing/", "throughput/", "memory/"))]
    assert set(steady) - {"policy/one_forward"} <= set(fused)
    for key in steady:
        if key != "policy/one_forward":
            assert fused[key] == pytest.approx(separate[key], rel=1e-5, abs=1e-6), key
