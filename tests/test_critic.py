"""The critic: a value model from the policy's weights, trained with the clipped value loss, so
PPO with GAE trains end to end."""

from __future__ import annotations

import json

import pytest
import torch

from otbrl.config import load_config
from otbrl.models import build_tiny_model, load_model_and_tokenizer, load_value_model

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, **SMALL)


def test_value_model_starts_from_the_policy_weights(tiny_dir):
    policy, _ = load_model_and_tokenizer(tiny_dir)
    value = load_value_model(tiny_dir)
    assert value.config.num_labels == 1 and value.score.out_features == 1
    decoder = dict(policy.model.named_parameters())
    for name, param in value.model.named_parameters():
        assert torch.equal(param, decoder[name]), name
    value.train()  # no dropout before the head: training and scoring see the same values
    ids = torch.randint(0, policy.config.vocab_size, (2, 5))
    torch.testing.assert_close(value(input_ids=ids).logits, value(input_ids=ids).logits)
    with pytest.raises(ValueError, match=r"config\.json"):
        load_value_model(tiny_dir / "nope")


def test_critic_follows_the_model_path_and_config(tiny_dir, tmp_path):
    from otbrl.run.trainer import Trainer

    other = build_tiny_model(tmp_path / "critic", seed=5, **SMALL)
    cfg = load_config(
        None,
        [
            f"model.path={tiny_dir}",
            "data.task=arithmetic",
            f"critic.model_path={other}",
            "critic.lr=0.01",
            "algorithm.adv_estimator=grpo",
            "critic.enable=true",  # a critic trains even when the estimator does not use it
            f"trainer.output_dir={tmp_path / 'run'}",
            "data.val_size=8",
        ],
    )
    trainer = Trainer(cfg)
    critic = trainer.engines["critic"]
    assert critic.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    from_other = load_value_model(other).model.embed_tokens.weight
    assert torch.equal(critic.model.model.embed_tokens.weight, from_other)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ppo_with_gae_learns_the_builtin_task(tmp_path):
    """`otbrl train algorithm.adv_estimator=gae` from the built-in warm start: greedy
    validation accuracy gains at least 0.15 within 120 steps and ends above where it started,
    and the trained critic explains more of the returns' variance than its fresh head. Measured
    on a 2-core AMD EPYC (warm start at sft.lr=1e-3: 0.37): 0.37 -> 0.70 by step 80; explained
    variance −0.59 at step 1, +0.02..0.03 from step 20 on (the per-token success of this task is
    hard to predict: the critic learns the baseline, little more)."""
    from otbrl.run.trainer import Trainer

    cfg = load_config(
        None,
        [
            "algorithm.adv_estimator=gae",
            "actor.ppo_mini_batch_size=16",
            "trainer.total_steps=120",
            "trainer.val_every=40",
            "data.val_size=300",
            "trainer.logger=[jsonl]",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"sft.cache_dir={tmp_path / 'cache'}",
        ],
    )
    summary = Trainer(cfg).fit()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    accuracy = {r["step"]: r["val/accuracy"] for r in records if "val/accuracy" in r}
    checks = [accuracy[k] for k in sorted(accuracy)]
    assert sorted(accuracy) == [0, 40, 80, 120]
    assert max(checks[1:]) - checks[0] >= 0.15, accuracy
    assert summary["final_val_accuracy"] > summary["initial_val_accuracy"], summary
    explained = [r["critic/explained_variance"] for r in records if "critic/value_loss" in r]
    assert len(explained) == 120
    # the trained critic beats its fresh head by a scale-free measure: its value loss grows
    # with the reward variance p(1 − p) while p < 0.5, so losses of different steps do not
    # compare (CI failed on that)
    assert sum(explained[-20:]) / 20 > explained[0] + 0.3, explained[:5] + explained[-20:]
    assert sum(explained[-20:]) / 20 > -0.05, explained[-20:]


def test_explained_variance_matches_a_float64_reference():
    from otbrl.algos.metrics import explained_variance

    g = torch.Generator().manual_seed(0)
    returns = torch.randn(6, 5, generator=g)
    values = returns + 0.5 * torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    values[mask == 0] = float("nan")  # masked positions cannot leak in
    r, v = returns[mask > 0].double(), values[mask > 0].double()
    want = 1 - (r - v).var(unbiased=False) / r.var(unbiased=False)
    got = explained_variance(values, returns, mask)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert float(explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    assert float(explained_variance(values, torch.ones(6, 5), mask)) == 0.0
