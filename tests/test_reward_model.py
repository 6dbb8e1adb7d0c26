"""The learned reward model: its scores equal a direct AutoModelForSequenceClassification
forward of each conversation, and they add, weighted, to the trained reward only."""

import json

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForSequenceClassification,
)

from otbrl.config import ConfigError, load_config
from otbrl.data import get_task
from otbrl.models import build_tiny_model
from otbrl.rewards.config import RewardConfig, RewardModelConfig
from otbrl.rewards.reward_model import RewardModel, check_reward_model_dir
from otbrl.rollout import SamplingParams
from otbrl.run.plan import plan_run
from otbrl.run.sampling import Scoring, sample_batch
from run_utils import read_metrics
from test_rewards_shaping import ScriptedSampler


def make_reward_model_dir(root):
    """A tiny random one-label classifier saved with the built-in task's tokenizer and chat
    template, as a user's reward model directory would be."""
    size = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    lm = build_tiny_model(root / "lm", **size, num_key_value_heads=2, intermediate_size=64)
    tokenizer = AutoTokenizer.from_pretrained(lm)
    config = LlamaConfig.from_pretrained(lm, num_labels=1)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(root / "rm")
    tokenizer.save_pretrained(root / "rm")
    return root / "rm"


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return make_reward_model_dir(tmp_path_factory.mktemp("rm"))


def _rows_and_answers(n=5):
    rows = get_task("arithmetic").rows("train", n, seed=0)
    answers = ["1", "23", "456", "", "99999"][:n]  # different lengths: the batch is padded
    return rows, answers


def test_scores_equal_a_direct_forward(rm_dir):
    rows, answers = _rows_and_answers()
    rm = RewardModel(rm_dir, micro_batch_size=2)
    got = rm.score(rows, answers)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tok = AutoTokenizer.from_pretrained(rm_dir)
    want = []
    for row, answer in zip(rows, answers):  # one conversation at a time: no padding at all
        messages = [*row["prompt"], {"role": "assistant", "content": answer}]
        ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            want.append(model(torch.tensor([ids])).logits[0, 0].item())
    assert got.dtype == torch.float32 and got.shape == (len(rows),)
    assert got.tolist() == pytest.approx(want, abs=1e-5)
    assert len(set(want)) == len(want)  # the scores tell the answers apart
    assert not any(p.requires_grad for p in rm.model.parameters())


def test_trained_reward_adds_the_weighted_score(rm_dir):
    rows, _ = _rows_and_answers(1)
    tok = AutoTokenizer.from_pretrained(rm_dir)
    digits = tok.encode(rows[0]["reward_model"]["ground_truth"], add_special_tokens=False)
    answers = [[*digits, tok.eos_token_id], [*digits, *digits, tok.eos_token_id]]
    rm = RewardModel(rm_dir)
    params = SamplingParams(n=2, max_tokens=16, stop_token_ids=(tok.eos_token_id,))
    weighted = RewardConfig(model=RewardModelConfig(path=str(rm_dir), weight=0.5))
    scoring = Scoring("exact_match", weighted, reward_model=rm)
    sample = sample_batch(ScriptedSampler(answers), tok, rows, params, scoring=scoring)
    texts = [tok.decode(a[:-1]) for a in answers]
    learned = rm.score(sample.rows, texts)
    placed = sample.batch["token_level_scores"].sum(dim=1)
    assert sample.scores == [1.0, 0.0]  # the rule reward, what validation counts
    assert placed.tolist() == pytest.approx((torch.tensor([1.0, 0.0]) + 0.5 * learned).tolist())
    assert sample.metrics["reward/model_mean"] == pytest.approx(learned.mean().item())
    assert scoring.for_validation().reward_model is None


def test_the_plan_checks_the_directory_before_loading(rm_dir, tiny_run, tmp_path):
    overrides = tiny_run(tmp_path / "run")
    plan = plan_run(load_config(None, [*overrides, f"reward.model.path={rm_dir}"]))
    assert plan.spec.uses("reward_model") and "rm_scores" in plan.spec.needs
    assert plan.spec.outputs("reward_model") == {"scores"}
    two = tmp_path / "two_labels"
    two.mkdir()
    config = json.loads((rm_dir / "config.json").read_text())
    config["id2label"] = {"0": "a", "1": "b"}
    (two / "config.json").write_text(json.dumps(config))
    for path, why in ((two, "2 labels"), (tmp_path, "no config.json")):
        with pytest.raises(ConfigError, match=why) as err:
            plan_run(load_config(None, [*overrides, f"reward.model.path={path}"]))
        assert err.value.key == "reward.model.path"
    lm = build_tiny_model(tmp_path / "lm")
    with pytest.raises(ValueError, match="AutoModelForSequenceClassification"):
        check_reward_model_dir(lm)
    with pytest.raises(ConfigError, match=r"'reward\.model\.path' is not") as err:
        load_config(None, ["reward.model.weight=2"])
    assert err.value.key == "reward.model.weight"


def test_a_run_trains_on_the_reward_model(rm_dir, tiny_run, tmp_path):
    """Two RL steps with the reward model and overlong shaping: both reach the step's
    metrics (built, loaded and wired by the run itself)."""
    from otbrl.run.trainer import Trainer

    torch.set_num_threads(1)
    overrides = tiny_run(tmp_path / "run")
    extra = ["trainer.total_steps=2", "trainer.save_every=0", f"reward.model.path={rm_dir}",
             "reward.model.weight=0.1", "reward.overlong_buffer.len=2"]  # fmt: skip
    cfg = load_config(None, [*overrides, *extra])
    trainer = Trainer(cfg)
    trainer.fit()
    step = next(line for line in read_metrics(tmp_path / "run") if line["step"] == 1)
    assert "reward/model_mean" in step and "timing/reward_model" in step
    assert step["reward/overlong_penalty_mean"] <= 0.0
