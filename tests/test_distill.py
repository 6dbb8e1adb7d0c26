"""On-policy distillation (``algorithm.distill``): the teacher's log-probs of the sampled tokens
against a float64 forward of the teacher, the rewards against the signal written out per token,
a teacher equal to the student giving no signal and no gradient (full and LoRA students), a
teacher that does not share the tokenizer refused before any model loads, and distillation
with tools, with pure distillation's learning and with resume."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import otbrl.run.trainer as trainer_mod
from otbrl import cli
from otbrl.config import load_config
from otbrl.data import get_task, write_parquet_rows
from otbrl.models import build_tiny_model
from run_utils import (
    data_files,
    read_metrics,
    refused,
    spy_advantage,
    stable_metrics,
    tiny_run_factory,
    train_overrides,
)
from tiny_models import ONE_LAYER, sharpened_policy, steer_to_calls

SHARPEN = 40.0

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``overrides(out_dir, *extra)`` of the tests' 4-step tiny run, and its model directory."""
    root = tmp_path_factory.mktemp("distill")
    return tiny_run_factory(root), root / "model"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """Another architecture (qwen2, two layers) with the student's tokenizer, its logits spread
    (``sharpened_policy``) so that it is far from the near-uniform random student."""
    root = tmp_path_factory.mktemp("teacher")
    model, *_ = sharpened_policy(root, "qwen2", scale=SHARPEN, eos_boost=0.0, prompts=1)
    model.save_pretrained(root)
    return root


def _float64_log_probs(model_dir, batch: dict, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each response token ``[B, Lr]``, in float64, from a plain HF
    forward of the whole (prompt + response) sequence."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    responses = batch["responses"]
    lr = responses.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    # position t predicts token t + 1: the logits of the response tokens end one before the end
    logits = logits[:, -lr - 1 : -1].double() / temperature
    return logits.log_softmax(-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def test_the_teacher_scores_the_sampled_tokens_and_the_rewards_carry_its_signal(
    run, teacher, tmp_path, monkeypatch
):
    overrides, _ = run
    seen = spy_advantage(monkeypatch)
    cfg = load_config(
        None,
        overrides(
            tmp_path / "run", f"algorithm.distill.teacher_path={teacher}",
            "algorithm.distill.coef=0.5", "rollout.temperature=0.8", "trainer.total_steps=1",
            "algorithm.adv_estimator=grpo",
        ),
    )  # fmt: skip
    trainer_mod.Trainer(cfg).fit()
    (kwargs,) = seen
    mask = kwargs["response_mask"]
    keep = mask.bool()
    reference = _float64_log_probs(teacher, kwargs, temperature=0.8)
    teacher_lp = kwargs["teacher_log_probs"]
    assert teacher_lp.shape == mask.shape
    torch.testing.assert_close(teacher_lp[keep].double(), reference[keep], atol=2e-5, rtol=0)
    # the rewards: the task's score (on the last token) + 0.5 (log π_teacher − log π) per token
    expected = kwargs["token_level_scores"].double().clone()
    old = kwargs["old_log_probs"].double()
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                expected[i, t] += 0.5 * (float(teacher_lp[i, t]) - float(old[i, t]))
    torch.testing.assert_close(kwargs["token_level_rewards"].double(), expected, atol=1e-6, rtol=0)
    (step,) = [r for r in read_metrics(tmp_path / "run") if "policy/loss" in r]
    reverse_kl = float(((old - teacher_lp.double()) * mask).sum() / mask.sum())
    assert step["distill/reverse_kl"] == pytest.approx(reverse_kl, abs=1e-5)
    teacher_mean = float((teacher_lp.double() * mask).sum() / mask.sum())
    assert step["distill/teacher_log_prob"] == pytest.approx(teacher_mean, abs=1e-5)
    assert step["distill/reverse_kl"] > 0.1  # a teacher far from the student: a real signal
    assert "timing/teacher" in step


@pytest.mark.parametrize("student", ["full", "lora"])
def test_a_teacher_equal_to_the_student_gives_no_signal_and_no_gradient(run, tmp_path, student):
    overrides, model = run
    lora = ["model.lora.rank=4"] if student == "lora" else []  # fresh adapters: B = 0
    out = tmp_path / student
    args = overrides(
        out, f"algorithm.distill.teacher_path={model}", "algorithm.distill.task_reward=false",
        "trainer.total_steps=2", *lora,
    )  # fmt: skip
    assert cli.main(["train", *args]) == 0
    steps = [r for r in read_metrics(out) if "policy/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["distill/reverse_kl"] == 0.0
        assert r["train/advantage_mean"] == 0.0
        assert r["policy/grad_norm"] == 0.0
        assert math.isfinite(r["distill/teacher_log_prob"]) and r["distill/teacher_log_prob"] < 0
        assert "train/reward_mean" in r  # still scored and logged


def test_a_teacher_with_another_vocabulary_is_refused_before_loading(
    run, tmp_path, capsys, no_model_loading
):
    overrides, _ = run
    other = build_tiny_model(tmp_path / "other", task="tool_arithmetic", **ONE_LAYER)
    key = "algorithm.distill.teacher_path"
    refused(["train", *overrides(tmp_path / "a", f"{key}={other}")], capsys, key, "tokenizer")
    refused(["train", *overrides(tmp_path / "b", f"{key}={tmp_path}")], capsys, key)
    # its keys need a teacher; the coefficient must be positive
    refused(["train", *overrides(tmp_path / "c", "algorithm.distill.coef=2")], capsys,
            "algorithm.distill.coef", "teacher_path")  # fmt: skip
    refused(["train", *overrides(tmp_path / "d", f"{key}={other}", "algorithm.distill.coef=0")],
            capsys, "algorithm.distill.coef")  # fmt: skip
    refused(["variance", *overrides(tmp_path / "e", f"{key}={other}")], capsys, key)


def test_pure_distillation_moves_the_student_towards_the_teacher(run, teacher, tmp_path):
    """The signal built for the test: a teacher far from the student, no task reward, large
    steps — the reverse KL the student samples at falls."""
    overrides, _ = run
    out = tmp_path / "run"
    args = overrides(
        out, f"algorithm.distill.teacher_path={teacher}", "algorithm.distill.task_reward=false",
        "trainer.total_steps=12", "actor.lr=3e-2", "actor.warmup_steps=0", "trainer.val_every=0",
        "trainer.save_every=0", "algorithm.adv_estimator=reinforce_plus_plus",
        "algorithm.gamma=0",
    )  # fmt: skip
    assert cli.main(["train", *args]) == 0
    kl = [r["distill/reverse_kl"] for r in read_metrics(out) if "policy/loss" in r]
    assert len(kl) == 12
    # measured here: 5.9 over the first three steps, 2.7 over the last three
    assert sum(kl[-3:]) / 3 < 0.6 * sum(kl[:3]) / 3, [round(x, 2) for x in kl]


def test_a_distilled_run_evaluates_without_its_teacher(run, tmp_path, capsys):
    """``otbrl eval`` of a run directory takes the run's saved config, teacher included: the
    teacher is not needed to evaluate the student, and may be gone."""
    overrides, _ = run
    teacher = build_tiny_model(tmp_path / "teacher", seed=3, **ONE_LAYER)
    out = tmp_path / "run"
    args = overrides(out, f"algorithm.distill.teacher_path={teacher}", "trainer.total_steps=2")
    assert cli.main(["train", *args]) == 0
    shutil.rmtree(teacher)
    capsys.readouterr()
    assert cli.main(["eval", f"model.path={out}"]) == 0
    assert "step_2" in capsys.readouterr().out


def test_distillation_resumes_where_it_stopped(run, teacher, tmp_path):
    overrides, _ = run
    distill = [f"algorithm.distill.teacher_path={teacher}", "algorithm.distill.coef=0.3"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert cli.main(["train", *overrides(full, *distill)]) == 0
    assert cli.main(["train", *overrides(cut, *distill, "trainer.total_steps=2")]) == 0
    assert cli.main(["train", *overrides(cut, *distill, "trainer.resume=auto")]) == 0
    later = [r for r in stable_metrics(full) if r["step"] > 2]
    assert [r for r in stable_metrics(cut) if r["step"] > 2] == later
    assert all("distill/reverse_kl" in r for r in later if "policy/loss" in r)


def test_with_tools_observation_tokens_carry_no_signal(tmp_path, monkeypatch):
    """A multi-turn step: the teacher scores every token with the observations in context (its
    float64 forward agrees), and only the policy's own tokens get its signal."""
    task = get_task("tool_arithmetic")
    student = build_tiny_model(tmp_path / "student", task="tool_arithmetic", **ONE_LAYER)
    teacher = build_tiny_model(tmp_path / "teacher", task="tool_arithmetic", seed=1, **ONE_LAYER)
    files = data_files(
        write_parquet_rows(task.rows("train", 8, seed=0), tmp_path / "train.parquet"),
        write_parquet_rows(task.rows("val", 4, seed=0), tmp_path / "val.parquet"),
    )
    seen = spy_advantage(monkeypatch)
    cfg = load_config(
        None,
        train_overrides(
            student, tmp_path / "run", *files, "trainer.total_steps=1", "trainer.val_every=0",
            "data.max_response_length=24", "rollout.multi_turn.tools=[calculator]",
            "rollout.multi_turn.max_turns=3", "rollout.multi_turn.max_observation_tokens=4",
            "algorithm.adv_estimator=tir_optimal_token_baseline",
            f"algorithm.distill.teacher_path={teacher}",
        ),
    )  # fmt: skip
    trainer = trainer_mod.Trainer(cfg)
    steer_to_calls(trainer.policy.model, trainer.tokenizer)
    trainer.fit()
    kwargs = seen[-1]  # the whole batch (one forward: its micro-batches came first)
    mask = kwargs["response_mask"]
    real = mask.flip(-1).cummax(-1).values.flip(-1).bool()  # up to each row's last token
    holes = real & (mask == 0)
    assert holes.any(), "no observation tokens: the test proves nothing"
    reference = _float64_log_probs(teacher, kwargs, temperature=1.0)
    keep = mask.bool()
    torch.testing.assert_close(
        kwargs["teacher_log_probs"][keep].double(), reference[keep], atol=2e-5, rtol=0
    )
    signal = kwargs["token_level_rewards"] - kwargs["token_level_scores"]
    assert (signal[holes] == 0).all()
    assert (signal[keep] != 0).any()
