"""Scoring in worker processes equals scoring in the trainer's, and it overlaps with the
caller's work; batched reward functions."""

import os
import time

import pytest

from otbrl.data import get_task
from otbrl.models import build_tokenizer
from otbrl.rewards import RewardError, score_responses
from otbrl.rewards.config import OverlongBufferConfig, RewardConfig
from otbrl.rewards.pool import RewardPool
from otbrl.rollout import SamplingParams
from otbrl.run.sampling import Scoring, sample_batch
from test_rewards_shaping import ScriptedSampler

USER = """
import time

def partial(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "boom":
        raise KeyError("no such key")
    return {"score": len(set(solution_str) & set(ground_truth)) / 3, "overlap": 1.0}

def slow(data_source, solution_str, ground_truth, extra_info):
    time.sleep(0.3)
    return 1.0

def as_lists(data_sources, solution_strs, ground_truths, extra_infos):
    return [partial(*args) for args in zip(data_sources, solution_strs, ground_truths, extra_infos)]

def too_few(data_sources, solution_strs, ground_truths, extra_infos):
    return [0.0]
"""


def _row(source, truth):
    return {"data_source": source, "reward_model": {"ground_truth": truth}, "extra_info": {}}


BATCH = [  # built-in scorers of several families, dict results among them
    ("Answer: 34", _row("math_dapo", "34")),
    ("Answer: 3", _row("aime2024", "34")),
    ("so #### 72", _row("openai/gsm8k", "72")),
    ("\\boxed{0.5}", _row("lighteval/MATH", "\\frac{1}{2}")),
    ("The answer is \\boxed{1/2}", _row("numina_cn_k12", "\\frac{1}{2}")),
    ("<answer>Paris</answer>", _row("searchR1_nq", ["Paris", "paris"])),
    ("<think>x</think>\\boxed{3}", _row("hiyouga/geometry3k", "3")),
]


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pool") / "rewards.py"
    path.write_text(USER)
    return path


# zero on errors, 30 s per call, a 2-token overlong buffer
SHAPED = RewardConfig(on_error="zero", timeout_s=30, overlong_buffer=OverlongBufferConfig(len=2))


@pytest.fixture(scope="module")
def pool():
    pool = RewardPool(RewardConfig(workers=2, on_error="zero", timeout_s=30))
    yield pool
    pool.close()


def _untimed(info):
    return {k: v for k, v in info.items() if not k.startswith("timing/")}


def test_pool_equals_in_process(pool):
    responses, rows = [r for r, _ in BATCH] * 2, [row for _, row in BATCH] * 2
    want = score_responses(responses, rows, on_error="zero", timeout_s=30)
    scores, info = pool.submit(responses, rows).result()
    assert scores == want[0] and _untimed(info) == want[1]
    assert {"reward/acc"} <= set(info) and info["timing/reward"] > 0


def test_user_functions_batched_and_errors(user_file):
    rows = [_row("mine", "abc")] * 5
    responses = ["abc", "ab", "boom", "x", "cab"]
    spec = f"{user_file}:partial"
    want = score_responses(responses, rows, function=spec, on_error="zero")
    assert want[0] == [1.0, 2 / 3, 0.0, 0.0, 1.0] and want[1]["reward/errors"] == 1.0
    batched = score_responses(
        responses[:2] + responses[3:], rows[:4], function=f"{user_file}:as_lists", batched=True
    )
    assert batched[0] == [1.0, 2 / 3, 0.0, 1.0] and batched[1]["reward/overlap"] == 1.0
    with pytest.raises(RewardError, match=r"'too_few' failed on samples 0\.\.4 .*1 results"):
        score_responses(responses, rows, function=f"{user_file}:too_few", batched=True)
    zero = score_responses(
        responses, rows, function=f"{user_file}:too_few", batched=True, on_error="zero"
    )
    assert zero[0] == [0.0] * 5 and zero[1]["reward/errors"] == 5.0
    # on_error=raise: the worker's error, sample index kept
    pool = RewardPool(RewardConfig(workers=1, function=spec))
    try:
        with pytest.raises(RewardError, match=r"'partial' failed on sample 2 .*KeyError"):
            pool.submit(responses, rows).result()
        # batched in the pool: one call per worker chunk, same scores
        pool.options.update(function=f"{user_file}:as_lists", batched=True)
        scores, info = pool.submit(responses[:2], rows[:2]).result()
        assert scores == [1.0, 2 / 3] and info["reward/overlap"] == 1.0
    finally:
        pool.close()


def test_scoring_overlaps_with_the_callers_work(user_file):
    pool = RewardPool(RewardConfig(workers=2, function=f"{user_file}:slow"))
    try:
        pool.submit(["warm"] * 2, [_row("mine", "x")] * 2).result()  # workers started
        pending = pool.submit(["a"] * 4, [_row("mine", "x")] * 4)  # 2 × 0.3 s per worker
        time.sleep(0.9)  # the policy's forward
        scores, info = pending.result()
    finally:
        pool.close()
    assert scores == [1.0] * 4
    assert info["timing/reward"] >= 0.6 and info["timing/reward_wait"] < 0.3


def test_deferred_sampling_step_equals_the_direct_one(pool):
    task = get_task("arithmetic")
    tok = build_tokenizer(task.alphabet)
    rows = task.rows("train", 2, seed=0)
    answers = [[*tok.encode(x, add_special_tokens=False), tok.eos_token_id] for x in ("4", "17")]
    params = SamplingParams(n=2, max_tokens=8, stop_token_ids=(tok.eos_token_id,))
    direct = sample_batch(
        ScriptedSampler(answers),
        tok,
        rows,
        params,
        scoring=Scoring(settings=SHAPED),
    )
    pooled = Scoring(settings=SHAPED, pool=pool)
    deferred = sample_batch(ScriptedSampler(answers), tok, rows, params, scoring=pooled, defer=True)
    assert "token_level_scores" not in deferred.batch and deferred.scores == []
    done = deferred.resolve()
    assert done.scores == direct.scores
    assert done.batch["token_level_scores"].equal(direct.batch["token_level_scores"])
    assert _untimed(done.metrics) == _untimed(direct.metrics)
    assert "timing/reward_wait" in done.metrics and "timing/rollout" in done.metrics


def test_config_keys_are_checked():
    from otbrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="is true but") as err:
        load_config(None, ["reward.batched=true"])
    assert err.value.key == "reward.batched"
    with pytest.raises(ConfigError, match=r"'reward\.workers' must be >= 0"):
        load_config(None, ["reward.workers=-1"])
    assert load_config(None, ["reward.workers=2"]).reward.workers == 2


def test_an_edit_to_the_reward_file_mid_run_never_changes_the_reward(tmp_path):
    """Finding 9: a worker keeps the reward file it loaded; a worker that loads it after an
    edit fails with the file's name (it had re-imported the edited file on a new mtime)."""
    path = tmp_path / "reward.py"
    path.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    rows = [_row("mine", "x")] * 2
    pool = RewardPool(RewardConfig(workers=1, function=f"{path}:score"))
    try:
        assert pool.submit(["a", "b"], rows).result()[0] == [1.0, 1.0]
        path.write_text(path.read_text().replace("1.0", "0.0"))
        os.utime(path, (time.time() + 5, time.time() + 5))  # a new mtime for sure
        assert pool.submit(["a", "b"], rows).result()[0] == [1.0, 1.0]  # as it started
    finally:
        pool.close()
    path.write_text(path.read_text().replace("0.0", "1.0"))
    pool = RewardPool(RewardConfig(workers=1, function=f"{path}:score"))
    try:
        path.write_text(path.read_text().replace("1.0", "0.5"))  # before any worker loaded it
        with pytest.raises(ValueError, match=r"reward\.function: .*reward\.py changed since"):
            pool.submit(["a"], rows[:1]).result()
    finally:
        pool.close()
