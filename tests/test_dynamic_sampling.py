"""DAPO's dynamic sampling (``algorithm.dynamic_sampling``): a step trains only groups whose
rewards differ, counts its rounds, fills up with groups without signal when its rounds run out,
resumes exactly; the groups it keeps are rebuilt through the batch contract's one constructor;
the estimators it is refused with are the ones that give an all-equal group a signal."""

from __future__ import annotations

import pytest
import torch

import otbrl.run.trainer as trainer_mod
from otbrl import cli
from otbrl.algos.advantages import ESTIMATORS, compute_advantage
from otbrl.config import load_config
from otbrl.data import get_task, pad_token_id, write_parquet_rows
from otbrl.models import build_tiny_model, load_model_and_tokenizer
from otbrl.rollout import HFRollout, SamplingParams
from otbrl.run.sampling import Scoring, merge_groups, sample_batch, signal_groups
from run_utils import (
    data_files,
    read_metrics,
    refused,
    spy_advantage,
    stable_metrics,
    tiny_run_factory,
    train_overrides,
)
from tiny_models import ONE_LAYER, steer_to_calls

pytestmark = pytest.mark.usefixtures("one_thread")

# Prompts with an even answer: the response's length parity (it varies inside most groups);
# odd answers: always 0 — a group without signal, whatever the policy writes.
HALF_REWARD = """
def score(data_source, solution_str, ground_truth, extra_info):
    if int(ground_truth) % 2 == 0:
        return float(len(solution_str) % 2)
    return 0.0
"""
CONSTANT_REWARD = """
def score(data_source, solution_str, ground_truth, extra_info):
    return 1.0
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``overrides(out_dir, *extra)``: the tests' 4-step tiny run with dynamic sampling, scored
    by ``HALF_REWARD``; and the directory of the reward files."""
    root = tmp_path_factory.mktemp("dynamic")
    (root / "half.py").write_text(HALF_REWARD)
    (root / "constant.py").write_text(CONSTANT_REWARD)
    factory = tiny_run_factory(root)

    def overrides(out, *extra):
        reward = f"reward.function={root / 'half.py'}:score"
        return factory(out, "algorithm.dynamic_sampling=true", reward, *extra)

    return overrides, root


def test_a_step_trains_the_groups_with_signal_and_counts_its_rounds(run, tmp_path, monkeypatch):
    overrides, _ = run
    seen = spy_advantage(monkeypatch)
    out = tmp_path / "run"
    cfg = load_config(None, overrides(out, "trainer.total_steps=3", "trainer.save_every=0"))
    trainer = trainer_mod.Trainer(cfg)
    trainer.fit()
    steps = [r for r in read_metrics(out) if "policy/loss" in r]
    assert len(seen) == len(steps) == 3
    drawn = 0
    for kwargs, r in zip(seen, steps, strict=True):
        rewards = kwargs["token_level_rewards"].sum(dim=1).view(-1, 4)  # rollout.n = 4
        assert rewards.shape[0] == 4  # data.train_batch_size groups, every step
        assert kwargs["index"].tolist() == [g for g in range(4) for _ in range(4)]
        rounds = r["dynamic_sampling/rounds"]
        assert rounds == int(rounds) and 1 <= rounds <= 10
        assert r["dynamic_sampling/samples_per_trained"] == rounds
        assert 0 < r["dynamic_sampling/kept_frac"] <= 1
        if r["dynamic_sampling/filled_frac"] == 0:
            assert (rewards.max(1).values > rewards.min(1).values).all()  # every group: signal
        drawn += rounds * 4
    # the data stream moved on by every round's prompts: none is drawn twice in an epoch
    assert trainer.source.state_dict()["position"] == drawn % 32


def test_a_step_short_after_its_rounds_fills_up_and_says_so(run, tmp_path, monkeypatch):
    """One round: the odd-answer prompts' groups never carry signal, so steps fill up; the
    filled groups enter the estimator with empty masks and every group that trains differs."""
    overrides, _ = run
    seen = spy_advantage(monkeypatch)
    out = tmp_path / "run"
    extra = ["algorithm.max_sample_rounds=1", "trainer.total_steps=3", "trainer.save_every=0"]
    trainer_mod.Trainer(load_config(None, overrides(out, *extra))).fit()
    steps = [r for r in read_metrics(out) if "policy/loss" in r]
    filled_total = 0
    for kwargs, r in zip(seen, steps, strict=True):
        rewards = kwargs["token_level_rewards"].sum(dim=1).view(4, 4)
        trained = kwargs["response_mask"].view(4, -1).sum(dim=1) > 0  # per group
        signal = rewards.max(1).values > rewards.min(1).values
        assert torch.equal(trained, signal)  # a filled group trains no token
        assert r["dynamic_sampling/filled_frac"] == float((~signal).sum()) / 4
        assert r["dynamic_sampling/rounds"] == 1
        filled_total += int((~signal).sum())
    assert filled_total > 0  # the data has odd answers in the first 12 prompts


def test_a_step_without_signal_trains_nothing(run, tmp_path, capsys):
    """Every group filled up: the weights do not move, although the entropy bonus would give
    any trained row a gradient and AdamW's weight decay would move them without one; the first
    such step says so in one line with what to change (it used to say nothing)."""
    overrides, root = run
    out = tmp_path / "run"
    args = overrides(
        out, f"reward.function={root / 'constant.py'}:score", "algorithm.max_sample_rounds=3",
        "trainer.total_steps=2", "trainer.save_every=0", "actor.entropy_coeff=0.01",
        "actor.weight_decay=0.1",
    )  # fmt: skip
    trainer = trainer_mod.Trainer(load_config(None, args))
    before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    capsys.readouterr()
    trainer.fit()
    said = [line for line in capsys.readouterr().err.splitlines() if "dynamic sampling:" in line]
    assert len(said) == 1 and "step 1 found no group" in said[0], said
    assert "algorithm.max_sample_rounds" in said[0]
    for key, value in trainer.policy.model.state_dict().items():
        assert torch.equal(value, before[key]), key
    for r in [r for r in read_metrics(out) if "policy/loss" in r]:
        assert r["dynamic_sampling/rounds"] == 3
        assert r["dynamic_sampling/kept_frac"] == 0 and r["dynamic_sampling/filled_frac"] == 1
        assert r["policy/grad_norm"] == 0 and r["policy/skipped_steps"] == 0


def test_dynamic_sampling_resumes_where_it_stopped(run, tmp_path):
    overrides, _ = run
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert cli.main(["train", *overrides(full)]) == 0
    assert cli.main(["train", *overrides(cut, "trainer.total_steps=2")]) == 0
    assert cli.main(["train", *overrides(cut, "trainer.resume=auto")]) == 0
    later = [r for r in stable_metrics(full) if r["step"] > 2]
    assert [r for r in stable_metrics(cut) if r["step"] > 2] == later
    assert sum(r.get("dynamic_sampling/rounds", 0) for r in later) >= 2


def test_keys_and_estimators_it_is_refused_with(run, tmp_path, capsys, no_model_loading):
    overrides, root = run
    key = "algorithm.dynamic_sampling"
    for estimator in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        refused(["train", *overrides(tmp_path, f"algorithm.adv_estimator={estimator}")],
                capsys, key, estimator)  # fmt: skip
    teacher = f"algorithm.distill.teacher_path={root / 'model'}"
    refused(["train", *overrides(tmp_path, teacher)], capsys, key, "teacher")
    no = [f"reward.function={root / 'half.py'}:score"]
    refused(["train", *run[0](tmp_path, "algorithm.dynamic_sampling=false",
                              "algorithm.max_sample_rounds=3", *no)],
            capsys, "algorithm.max_sample_rounds")  # fmt: skip


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_group_relative_means_an_all_equal_group_gets_no_signal(name):
    """The flag dynamic sampling trusts, checked against each estimator's output: a group of
    equal rewards beside a group of different ones gets exactly zero advantages from the
    group-relative estimators, and a signal from the others."""
    g = torch.Generator().manual_seed(0)
    rows, length = 8, 6
    mask = torch.ones(rows, length)
    mask[1, 4:] = 0  # lengths differ inside the equal group
    mask[6, 3:] = 0
    rewards = torch.zeros(rows, length)
    last = mask.sum(1).long() - 1
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])  # group 0: all equal
    rewards[torch.arange(rows), last] = scores
    probs = torch.rand(rows, length, generator=g) * 0.9 + 0.05
    adv, _ = compute_advantage(
        name, token_level_rewards=rewards, response_mask=mask, index=torch.arange(rows) // 4,
        old_log_probs=probs.log(), sum_pi_squared=probs**2 + 0.01,
        values=torch.randn(rows, length, generator=g),
    )  # fmt: skip
    equal = adv[:4][mask[:4].bool()]
    if ESTIMATORS[name].group_relative:
        assert (equal == 0).all(), equal
    else:
        assert equal.abs().max() > 1e-3
    # one row longer than the rest of its equal group: OTB's zero tail leaves its return on
    # the tokens past the second-longest row (baseline 0 there), and nothing else
    mask[1:4, 4:] = 0
    rewards = torch.zeros(rows, length)
    rewards[torch.arange(rows), mask.sum(1).long() - 1] = scores
    adv, _ = compute_advantage(
        name, token_level_rewards=rewards, response_mask=mask, index=torch.arange(rows) // 4,
        old_log_probs=probs.log(), sum_pi_squared=probs**2 + 0.01,
        values=torch.randn(rows, length, generator=g),
    )  # fmt: skip
    if ESTIMATORS[name].group_relative:
        tail = torch.zeros(4, length)
        if "optimal_token_baseline" in name:  # OTB and TIR-OTB, handle_zero_tail by default
            tail[0, 4:] = 1.0  # the return of row 0's reward 1
        assert torch.equal(adv[:4] * mask[:4], tail), adv[:4]


def test_merge_groups_rebuilds_the_batch_its_groups_came_from(tiny_dir):
    model, tok = load_model_and_tokenizer(tiny_dir)
    rows = get_task("arithmetic").rows("train", 3, seed=0)
    rows[1] = {**rows[1], "prompt": [{"role": "user", "content": "1+2="}]}  # a shorter prompt
    params = SamplingParams(n=2, max_tokens=4, seed=0)
    scoring = Scoring(lambda *args: float(len(args[1]) % 2))
    sample = sample_batch(HFRollout(model, tok), tok, rows, params, scoring=scoring)
    pad = pad_token_id(tok)
    whole = merge_groups([(sample, [0, 1, 2])], 2, pad_id=pad)
    assert whole.batch.keys() == sample.batch.keys()
    for key, value in sample.batch.items():
        assert torch.equal(whole.batch[key], value), key
    assert whole.scores == sample.scores and whole.responses == sample.responses
    # a subset, out of two samples (the same twice): each row as it was, uids renumbered
    part = merge_groups([(sample, [2]), (sample, [1])], 2, pad_id=pad, uid_offset=10)
    assert part.batch["uid"].tolist() == [10, 10, 11, 11]
    for row, source in enumerate([4, 5, 2, 3]):
        for key in ("responses", "response_mask", "token_level_scores", "rollout_log_probs"):
            assert torch.equal(part.batch[key][row], sample.batch[key][source]), key
        got = part.batch["input_ids"][row][part.batch["attention_mask"][row].bool()]
        want = sample.batch["input_ids"][source][sample.batch["attention_mask"][source].bool()]
        assert torch.equal(got, want)
    assert part.rows == [sample.rows[i] for i in (4, 5, 2, 3)]
    assert signal_groups(sample, 2) == [
        g for g in range(3) if len({sample.scores[2 * g], sample.scores[2 * g + 1]}) > 1
    ]


def test_with_tools_the_kept_groups_keep_their_observation_holes(run, tmp_path, monkeypatch):
    _, root = run
    task = get_task("tool_arithmetic")
    model = build_tiny_model(tmp_path / "model", task="tool_arithmetic", **ONE_LAYER)
    files = data_files(
        write_parquet_rows(task.rows("train", 16, seed=0), tmp_path / "train.parquet"),
        write_parquet_rows(task.rows("val", 4, seed=0), tmp_path / "val.parquet"),
        root / "half.py",
    )
    seen = spy_advantage(monkeypatch)
    cfg = load_config(
        None,
        train_overrides(
            model, tmp_path / "run", *files, "trainer.total_steps=1", "trainer.val_every=0",
            "data.max_response_length=24", "rollout.multi_turn.tools=[calculator]",
            "rollout.multi_turn.max_observation_tokens=4", "algorithm.dynamic_sampling=true",
            "algorithm.adv_estimator=tir_optimal_token_baseline",
        ),
    )  # fmt: skip
    trainer = trainer_mod.Trainer(cfg)
    steer_to_calls(trainer.policy.model, trainer.tokenizer)
    trainer.fit()
    kwargs = seen[-1]  # the whole batch (one forward: its micro-batches came first)
    mask = kwargs["response_mask"]
    real = mask.flip(-1).cummax(-1).values.flip(-1).bool()
    assert (real & (mask == 0)).any(), "no observation tokens: the test proves nothing"
    (step,) = [r for r in read_metrics(tmp_path / "run") if "policy/loss" in r]
    assert step["dynamic_sampling/rounds"] >= 1 and "tool/calls_per_sample" in step
