"""RL in an environment learns: the built-in guess task (find a secret in 1..15 from ``+`` /
``-`` answers, 4 turns), a small model warm-started on random but consistent searches, then
TIR-OTB steps on the environment's reward alone raise its greedy validation accuracy — a reward
no single answer earns, only a search that reads the observations."""

import pytest
import torch

from otbrl.config import SFTConfig, load_config
from otbrl.data import get_task, write_parquet_rows
from otbrl.envs.builtin import BUILTIN_ENVS
from otbrl.models import build_tiny_model, load_model_and_tokenizer
from otbrl.run.sft import run_sft
from run_utils import read_metrics

SIZE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2)  # fmt: skip
STEPS = 80
VAL_EVERY = 20


def guess_run(tmp_path, seed: int) -> list[tuple[int, float]]:
    """SFT (300 steps on the demonstrations of 4000 rows), then ``STEPS`` TIR-OTB steps with
    ``trainer.seed=seed``: the (step, greedy validation accuracy) pairs, every ``VAL_EVERY``."""
    from otbrl.run.trainer import Trainer

    task = get_task("guess")
    path = build_tiny_model(tmp_path / "model", task="guess", seed=0, **SIZE)
    model, tok = load_model_and_tokenizer(path)
    rows = task.rows("train", 4000, seed=0)
    with torch.random.fork_rng(devices=[]):
        run_sft(
            model, tok, rows, [task.demonstration(r) for r in rows],
            SFTConfig(lr=3e-3, batch_size=64, max_steps=300, warmup_steps=20, grad_clip=1.0),
            seed=0, env=BUILTIN_ENVS["guess"], max_turns=task.max_turns,
        )  # fmt: skip
    model.save_pretrained(path)
    train = write_parquet_rows(task.rows("train", 2000, seed=1), tmp_path / "train.parquet")
    val = write_parquet_rows(task.rows("val", 128, seed=0), tmp_path / "val.parquet")
    cfg = load_config(None, [
        f"model.path={path}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={tmp_path / 'run'}", f"trainer.total_steps={STEPS}",
        f"trainer.val_every={VAL_EVERY}", "trainer.logger=[jsonl]", "data.train_batch_size=32",
        "rollout.n=8", "data.max_response_length=24", "rollout.multi_turn.env=guess",
        "rollout.multi_turn.max_turns=4", "rollout.multi_turn.max_observation_tokens=4",
        "algorithm.adv_estimator=tir_optimal_token_baseline", "actor.lr=1e-3",
        "actor.warmup_steps=5", f"trainer.seed={seed}",
    ])  # fmt: skip
    Trainer(cfg).fit()
    return [(r["step"], r["val/accuracy"]) for r in read_metrics(tmp_path / "run")
            if "val/accuracy" in r]  # fmt: skip


@pytest.mark.slow
def test_rl_in_the_guess_environment_raises_accuracy(tmp_path):
    """Greedy accuracy over the task's 15 secrets moves in steps of ~0.07 (one secret more or
    less found) and not monotonically, so the end is the mean of the last two validations.
    Measured on a 2-core Intel Xeon (AMX) at one thread (as ``make test`` runs it), trainer
    seeds 0-2 of this exact run: 0.492 -> 0.734 / 0.766 / 0.785 (gains 0.24, 0.27, 0.29; the
    sampled training reward 0.51 -> 0.70-0.73 over the run). At 16 prompts a step the gain was
    0.12-0.37, at lr 2e-3 a seed collapsed, and a warm start stopped at a target accuracy (75
    steps) left RL too little to build on. Hence the bound 0.2."""
    curve = guess_run(tmp_path, seed=0)
    assert [s for s, _ in curve] == list(range(0, STEPS + 1, VAL_EVERY))
    before, end = curve[0][1], (curve[-1][1] + curve[-2][1]) / 2
    assert end - before >= 0.2, curve
