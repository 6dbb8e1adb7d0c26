"""otbrl.run.trainer end to end on a tiny random-init model (CPU, seconds per run)."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import otbrl.run.trainer as trainer_mod
from otbrl import cli
from otbrl.config import ConfigError, load_config
from otbrl.data import get_task, write_parquet_rows
from otbrl.run.plan import plan_run
from run_utils import data_files, read_metrics, train_overrides

REQUIRED = (
    "train/reward_mean",
    "train/response_length_mean",
    "policy/entropy_mean",
    "policy/sum_pi_squared_mean",
    "policy/grad_norm",
    "policy/clip_frac",
    "policy/approx_kl",
    "throughput/tokens_per_s",
    "timing/rollout",
    "timing/reward",
    "timing/old_stats",
    "timing/adv",
    "timing/update",
    "memory/peak_gb",
)


@pytest.fixture(scope="module")
def arith_files(tmp_path_factory):
    """Small parquet train/val files: Trainer start-up stays cheap (no 7k-row task)."""
    root = tmp_path_factory.mktemp("data")
    task = get_task("arithmetic")
    return (
        write_parquet_rows(task.rows("train", 32, seed=0), root / "train.parquet"),
        write_parquet_rows(task.rows("val", 16, seed=0), root / "val.parquet"),
    )


def tiny_overrides(model_dir, out_dir, *extra):
    """3 steps (2 optimizer steps each), validation at steps 0, 2 and 3."""
    data = ["data.task=arithmetic", "data.val_size=16"]  # the data when no files are given
    run = ["trainer.total_steps=3", "trainer.val_every=2"]
    batches = ["actor.ppo_mini_batch_size=2", "actor.micro_batch_size=4"]
    return train_overrides(model_dir, out_dir, *data, *run, *batches, *extra)


def test_smoke_run_metrics_and_outputs(tiny_dir, tmp_path):
    cfg = load_config(None, tiny_overrides(tiny_dir, tmp_path / "run"))
    summary = trainer_mod.Trainer(cfg).fit()
    records = read_metrics(tmp_path / "run")
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        for key in REQUIRED:
            assert key in record, key
        assert any(k.startswith("variance_proxy/") for k in record)
        for key, value in record.items():
            assert value is not None and math.isfinite(value), key
    assert "val/accuracy" in steps[1] and "val/accuracy" in steps[2]
    assert records[0]["step"] == 0 and "val/accuracy" in records[0]
    # the state's size once, with the first step: fp32 weights and AdamW's two fp32 moments
    # (+ a step counter per tensor); the peak is at least the process's weights
    weights = 4 * sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_dir).parameters()
    )
    assert steps[0]["memory/params_gb"] * 1e9 == pytest.approx(weights)
    assert steps[0]["memory/optimizer_gb"] * 1e9 >= 2 * weights
    assert steps[0]["memory/optimizer_gb"] * 1e9 <= 2 * weights + 4 * 1000
    assert not any("memory/params_gb" in r for r in steps[1:])
    assert all(r["memory/peak_gb"] * 1e9 > weights for r in steps)
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in ("initial_val_accuracy", "final_val_accuracy", "steps", "wall_seconds"):
        assert key in on_disk
    assert on_disk["adv_estimator"] == "optimal_token_baseline" == summary["adv_estimator"]
    assert on_disk["steps"] == 3
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0


def test_sum_pi_squared_reaches_the_estimator(tiny_dir, arith_files, tmp_path, monkeypatch):
    seen = []
    real = trainer_mod.compute_advantage

    def spy(name, **kwargs):
        seen.append((name, kwargs))
        return real(name, **kwargs)

    monkeypatch.setattr(trainer_mod, "compute_advantage", spy)
    overrides = tiny_overrides(
        tiny_dir, tmp_path / "otb", "trainer.total_steps=1", *data_files(*arith_files)
    )
    cfg = load_config(None, overrides)
    trainer = trainer_mod.Trainer(cfg)
    assert "sum_pi_squared" in trainer.plan.spec.needs
    stats_seen = []
    compute = trainer.policy.compute

    def stats_spy(batch, outputs):
        stats_seen.append(compute(batch, outputs))
        return stats_seen[-1]

    monkeypatch.setattr(trainer.policy, "compute", stats_spy)
    trainer.fit()
    name, kwargs = seen[-1]
    assert name == "optimal_token_baseline"
    # the estimator got the very tensor the actor's forward produced
    assert kwargs["sum_pi_squared"] is stats_seen[-1]["sum_pi_squared"]
    spp, mask = kwargs["sum_pi_squared"], kwargs["response_mask"].bool()
    assert ((spp[mask] > 0) & (spp[mask] <= 1 + 1e-6)).all()
    # and the advantages depend on it: rewards that differ inside each group, then two Σπ²
    rewards = torch.zeros_like(kwargs["token_level_rewards"])
    last = kwargs["response_mask"].sum(-1).long() - 1
    rewards[torch.arange(rewards.shape[0]), last] = (torch.arange(rewards.shape[0]) % 2).float()
    args = dict(kwargs, token_level_rewards=rewards)
    with_real, _ = real(name, **args)
    with_ones, _ = real(name, **dict(args, sum_pi_squared=torch.ones_like(spp)))
    assert (with_real - with_ones).abs().max() > 1e-3


def test_auto_skips_sum_pi_squared_when_nobody_needs_it(tiny_dir):
    base = [f"model.path={tiny_dir}", "data.task=arithmetic"]
    cfg = load_config(None, [*base, "algorithm.adv_estimator=grpo"])
    assert "sum_pi_squared" not in plan_run(cfg).spec.needs
    cfg = load_config(
        None, [*base, "algorithm.adv_estimator=grpo", "actor.calculate_sum_pi_squared=true"]
    )
    assert "sum_pi_squared" in plan_run(cfg).spec.needs
    cfg = load_config(None, [*base, "actor.calculate_sum_pi_squared=false"])
    with pytest.raises(ConfigError, match=r"actor\.calculate_sum_pi_squared"):
        plan_run(cfg)
    cfg = load_config(None, [*base, "algorithm.adv_estimator=optimal_token_baselin"])
    with pytest.raises(ConfigError, match="did you mean 'optimal_token_baseline'"):
        plan_run(cfg)


def test_hf_dir_and_parquet_two_steps(tiny_dir, tmp_path):
    task = get_task("arithmetic")
    rows = task.rows("train", 32, seed=1)
    for row in rows[1::2]:  # the data_source picks the reward per row
        row["data_source"] = "openai/gsm8k"
    train = write_parquet_rows(rows, tmp_path / "train.parquet")
    val = write_parquet_rows(task.rows("val", 8, seed=1), tmp_path / "val.parquet")
    overrides = tiny_overrides(
        tiny_dir,
        tmp_path / "pq",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "trainer.total_steps=2",
        "model.use_remove_padding=true",
        "actor.use_fused_kernels=true",
        "actor.use_kl_loss=true",
    )
    summary = trainer_mod.Trainer(load_config(None, [*overrides, "trainer.save_every=2"])).fit()
    records = read_metrics(tmp_path / "pq")
    assert records[-1]["step"] == 2 and "policy/kl_loss" in records[-1]
    assert 0.0 <= summary["final_val_accuracy"] <= 1.0
    # the checkpoint exports to a directory the plain HF Auto classes load
    out = tmp_path / "exported"
    assert cli.main(["export", str(tmp_path / "pq" / "checkpoints" / "step_2"), str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer)
    assert (
        cli.main(
            ["plot", str(tmp_path / "pq"), str(tmp_path / "pq"), "--out", str(tmp_path / "o.png")]
        )
        == 0
    )
    assert (tmp_path / "o.png").stat().st_size > 0


def test_unknown_data_source_without_reward_function(tiny_dir, tmp_path):
    rows = get_task("arithmetic").rows("train", 8, seed=0)
    for row in rows:
        row["data_source"] = "my/unknown_source"
    path = write_parquet_rows(rows, tmp_path / "u.parquet")
    cfg = load_config(
        None,
        tiny_overrides(
            tiny_dir, tmp_path / "u", f"data.train_files=[{path}]", "trainer.total_steps=1"
        ),
    )
    # found when the data is checked, before any model loads, not when the row is sampled
    with pytest.raises(ConfigError, match=r"'my/unknown_source' \(8 rows\)"):
        plan_run(cfg)


RAISING = """
def score(data_source, solution_str, ground_truth, extra_info):
    if solution_str.endswith("1"):
        raise RuntimeError("boom")
    return float(solution_str == ground_truth)

def always(data_source, solution_str, ground_truth, extra_info):
    raise RuntimeError("boom")
"""


@pytest.mark.parametrize("policy", ["raise", "zero"])
def test_reward_function_that_raises(tiny_dir, arith_files, tmp_path, policy):
    path = tmp_path / "my_reward.py"
    path.write_text(RAISING)
    cfg = load_config(
        None,
        tiny_overrides(
            tiny_dir,
            tmp_path / policy,
            f"reward.function={path}:always",
            f"reward.on_error={policy}",
            "trainer.total_steps=1",
            "trainer.val_every=0",
            *data_files(*arith_files),
        ),
    )
    trainer = trainer_mod.Trainer(cfg)
    if policy == "raise":
        with pytest.raises(Exception, match="always") as info:
            trainer.fit()
        assert "boom" in str(info.value) or "boom" in str(info.value.__cause__)
    else:
        trainer.fit()
        record = read_metrics(tmp_path / policy)[-1]
        assert record["reward/errors"] == 16  # every sample of the step failed and scored 0
        assert record["train/reward_mean"] == 0.0


def test_wall_time_limit_stops_after_a_final_validation(tiny_dir, arith_files, tmp_path):
    overrides = tiny_overrides(
        tiny_dir,
        tmp_path / "w",
        "trainer.total_steps=50",
        "trainer.val_every=10",
        "trainer.max_wall_seconds=0.001",
        *data_files(*arith_files),
    )
    summary = trainer_mod.Trainer(load_config(None, overrides)).fit()
    records = read_metrics(tmp_path / "w")
    assert summary["steps"] == 1 and records[-1]["step"] == 1
    assert "val/accuracy" in records[-1] and records[-1]["trainer/stopped_at_wall_limit"] == 1.0


def _cells() -> list[tuple[str, str, bool]]:
    """Each estimator once, the loss aggregations and KL on/off dealt round them so every one
    of those runs too: an estimator does not see the aggregation (its pairs are tested against
    their references in test_losses / test_off_policy), so the full product (56 runs, 100 s)
    would test the same wiring 8 times over."""
    from otbrl.algos import ESTIMATORS
    from otbrl.algos.loss_math import LOSS_AGG_MODES

    cells = [
        (estimator, LOSS_AGG_MODES[i % len(LOSS_AGG_MODES)], bool(i % 2))
        for i, estimator in enumerate(sorted(ESTIMATORS))
    ]
    assert {m for _, m, _ in cells} == set(LOSS_AGG_MODES) and {k for *_, k in cells} == {0, 1}
    return cells


@pytest.mark.parametrize(("estimator", "mode", "kl"), _cells())
def test_every_estimator_and_loss_trains_two_steps(
    estimator, mode, kl, tiny_dir, arith_files, tmp_path
):
    """Nothing registered can fail mid-run: each estimator (gae with its critic), each loss
    aggregation, KL loss on and off, two full steps with finite metrics."""
    overrides = tiny_overrides(
        tiny_dir,
        tmp_path / "run",
        f"algorithm.adv_estimator={estimator}",
        f"actor.loss_agg_mode={mode}",
        f"actor.use_kl_loss={str(kl).lower()}",
        "trainer.total_steps=2",
        "trainer.val_every=0",
        *data_files(*arith_files),
    )
    trainer = trainer_mod.Trainer(load_config(None, overrides))
    assert ("critic" in trainer.engines) == (estimator == "gae")
    trainer.fit()
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["policy/skipped_steps"] == 0
        assert ("policy/kl_loss" in record) == kl
        assert ("critic/value_loss" in record) == (estimator == "gae")
        for key, value in record.items():
            assert value is not None and math.isfinite(value), (key, record)


def test_batch_sizes_default_to_what_fits(tiny_dir, arith_files, tmp_path):
    """`data.train_batch_size=4 rollout.n=2` and no other batch key: one optimizer step of the
    whole batch, micro-batches capped (not required to divide)."""
    run = ["trainer.total_steps=2", "trainer.val_every=0", *data_files(*arith_files)]
    batches = ["rollout.n=2", "actor.micro_batch_size=3"]  # and no other batch key
    overrides = train_overrides(tiny_dir, tmp_path / "run", *run, *batches)
    assert cli.main(["train", *overrides]) == 0
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    # one optimizer step per RL step: warmup 20 -> lr 2/21 then 3/21 of actor.lr
    # (a model directory on its own files: the defaults for real models, lr 1e-6)
    assert records[-1]["policy/lr"] == pytest.approx(1e-6 * 3 / 21)


COUNTING_REWARD = """
import os
with open(os.environ["OTBRL_TEST_IMPORTS"], "a") as f:
    f.write("imported\\n")

def score(data_source, solution_str, ground_truth, extra_info):
    return float(solution_str == ground_truth)
"""


def test_reward_module_is_imported_once(tiny_dir, arith_files, tmp_path):
    """`otbrl train reward.function=file.py:fn` executes the file once per process."""
    import os
    import subprocess
    import sys

    reward = tmp_path / "counting.py"
    reward.write_text(COUNTING_REWARD)
    log = tmp_path / "imports.log"
    overrides = tiny_overrides(
        tiny_dir,
        tmp_path / "run",
        f"reward.function={reward}:score",
        "trainer.total_steps=1",
        *data_files(*arith_files),
    )
    env = {**os.environ, "OTBRL_TEST_IMPORTS": str(log), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "otbrl", "train", *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert log.read_text().splitlines() == ["imported"]
