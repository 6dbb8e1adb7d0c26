"""DAPO's overlong reward shaping, against the formula as the DAPO paper writes it."""

import pytest
import torch

from otbrl.config import ConfigError, load_config
from otbrl.data import get_task
from otbrl.models import build_tokenizer
from otbrl.rewards.config import OverlongBufferConfig, RewardConfig
from otbrl.rewards.shaping import overlong_penalty
from otbrl.rollout import Completion, SamplingParams
from otbrl.run.sampling import Scoring, sample_batch


def dapo_length_reward(length: int, max_length: int, cache: int, penalty: float) -> float:
    """DAPO (Yu et al. 2025), eq. 13, scaled by the penalty factor: the reference."""
    if length <= max_length - cache:
        return 0.0
    if length <= max_length:
        return ((max_length - cache) - length) / cache * penalty
    return -penalty


@pytest.mark.parametrize(
    ("max_length", "cache", "penalty"), [(16, 4, 1.0), (9, 9, 0.5), (5, 1, 2.0)]
)
def test_penalty_is_the_papers_formula(max_length, cache, penalty):
    lengths = torch.arange(0, max_length + 1)
    got = overlong_penalty(lengths, max_length=max_length, buffer_len=cache, penalty=penalty)
    want = [dapo_length_reward(int(n), max_length, cache, penalty) for n in lengths]
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    assert got[-1].item() == pytest.approx(-penalty) and (got <= 0).all()


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_length=4, buffer_len=0, penalty=1.0)
    with pytest.raises(ValueError, match="lengths"):
        overlong_penalty(torch.ones(2, 2), max_length=4, buffer_len=2, penalty=1.0)


class ScriptedSampler:
    """Answers every prompt with the given token lists (EOS-ended or cut at the budget)."""

    tools = None

    def __init__(self, answers):
        self.answers = answers

    def prompt_rows(self, rows):
        return list(rows)

    def generate(self, prompts, params, *, max_tokens=None, rows=None):
        return [
            [
                Completion(
                    ids, [0.0] * len(ids), "length" if len(ids) == params.max_tokens else "stop"
                )
                for ids in self.answers
            ]
            for _ in prompts
        ]


def test_sampling_step_shapes_the_trained_reward_only():
    task = get_task("arithmetic")
    tok = build_tokenizer(task.alphabet)
    row = task.rows("train", 1, seed=0)[0]
    answer = row["reward_model"]["ground_truth"]
    digits = tok.encode(answer, add_special_tokens=False)
    eos = tok.eos_token_id
    # the answer; then trailing zeros (wrong answers): 2, 4, and 7 (cut at the budget, no EOS)
    zero = tok.encode("0", add_special_tokens=False)
    answers = [
        [*digits, eos],
        [*digits, *zero * 2, eos],
        [*digits, *zero * 4, eos],
        [*digits, *zero * 7],
    ]
    params = SamplingParams(n=len(answers), max_tokens=len(digits) + 7, stop_token_ids=(eos,))
    shaped = RewardConfig(overlong_buffer=OverlongBufferConfig(len=4, penalty=0.5))
    scoring = Scoring("exact_match", shaped)
    sample = sample_batch(ScriptedSampler(answers), tok, [row], params, scoring=scoring)
    lengths = [len(a) for a in answers]
    want_penalty = [dapo_length_reward(n, params.max_tokens, 4, 0.5) for n in lengths]
    placed = sample.batch["token_level_scores"].sum(dim=1)
    assert placed.tolist() == pytest.approx([s + p for s, p in zip(sample.scores, want_penalty)])
    assert sample.metrics["reward/overlong_penalty_mean"] == pytest.approx(
        sum(want_penalty) / len(want_penalty)
    )
    assert sample.scores[0] == 1.0  # validation accuracy counts the unshaped reward
    plain = sample_batch(
        ScriptedSampler(answers), tok, [row], params, scoring=Scoring("exact_match")
    )
    assert "reward/overlong_penalty_mean" not in plain.metrics
    assert plain.batch["token_level_scores"].sum(dim=1).tolist() == pytest.approx(sample.scores)


def test_config_keys_are_checked():
    with pytest.raises(ConfigError, match="must be smaller than the response budget"):
        load_config(None, ["reward.overlong_buffer.len=4", "data.max_response_length=4"])
    with pytest.raises(ConfigError, match=r"'reward\.overlong_buffer\.len' is 0"):
        load_config(None, ["reward.overlong_buffer.penalty=0.5"])
    with pytest.raises(ConfigError, match=r"'reward\.overlong_buffer\.penalty' must be >= 0"):
        load_config(None, ["reward.overlong_buffer.len=2", "reward.overlong_buffer.penalty=-1"])
    cfg = load_config(None, ["reward.overlong_buffer.len=2", "data.max_response_length=8"])
    assert cfg.reward.overlong_buffer.len == 2
