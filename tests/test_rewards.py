import math
import signal
import threading
import time

import numpy as np
import pytest
import torch

from otbrl.rewards import (
    RewardError,
    exact_match,
    extract_gsm8k_answer,
    gsm8k,
    gsm8k_flexible,
    resolve_reward_function,
    reward_for_data_source,
    score_responses,
)


def _row(truth, source="otbrl/arithmetic", extra=None):
    return {
        "prompt": [{"role": "user", "content": "q"}],
        "data_source": source,
        "reward_model": {"ground_truth": truth},
        "extra_info": extra or {},
    }


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        (" 46\n", "46", 1.0),
        ("46", " 46 ", 1.0),
        ("4 6", "46", 0.0),
        ("460", "46", 0.0),
        ("", "46", 0.0),
    ],
)
def test_exact_match_strips_whitespace_only(response, truth, score):
    assert exact_match("s", response, truth, {}) == score


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("so 3 + 4 = 7\n#### 7", "7", "7"),
        ("#### 1,234", "1234", "1234"),
        ("#### $12.50", "12.5", "12.5"),
        ("#### -3", "-3", "-3"),
        ("#### 5 then #### 6", "6", "6"),
        ("#### 72.0", "72", "72"),
        ("the answer is 72 apples, not 70.", None, "70"),
        ("no numbers here", None, None),
    ],
)
def test_gsm8k_extraction(text, strict, flexible):
    assert extract_gsm8k_answer(text) == strict
    assert extract_gsm8k_answer(text, flexible=True) == flexible


def test_gsm8k_scores():
    assert gsm8k("openai/gsm8k", "work... #### 1,000", "1000", {}) == 1.0
    assert gsm8k("openai/gsm8k", "work... #### 999", "1000", {}) == 0.0
    assert gsm8k("openai/gsm8k", "the answer is 1000", "1000", {}) == 0.0
    assert gsm8k_flexible("openai/gsm8k", "the answer is 1000", "1000", {}) == 1.0
    assert gsm8k_flexible("openai/gsm8k", "#### 3 and later 1000", "1000", {}) == 0.0


def test_selection_by_data_source():
    responses = ["46", "so #### 46", "so #### 46", "46"]
    rows = [_row("46"), _row("46", "openai/gsm8k"), _row("46"), _row("46", "openai/gsm8k")]
    scores, info = score_responses(responses, rows)
    # Arithmetic is exact match; gsm8k needs the #### marker.
    assert scores == [1.0, 1.0, 0.0, 0.0]
    assert info == {"reward/errors": 0.0, "reward/timeouts": 0.0}
    assert reward_for_data_source("openai/gsm8k") is gsm8k


def test_unknown_data_source_names_the_value():
    with pytest.raises(ValueError, match="'my/new_set'"):
        score_responses(["1"], [_row("1", "my/new_set")], on_error="zero")
    # An explicit function makes any data_source fine.
    assert score_responses(["1"], [_row("1", "my/new_set")], function="exact_match")[0] == [1.0]


def test_resolve_builtin_and_none():
    assert resolve_reward_function(None) is None
    assert resolve_reward_function("gsm8k") is gsm8k
    with pytest.raises(ValueError, match="neither a built-in"):
        resolve_reward_function("gsm9k")
    with pytest.raises(TypeError, match="reward function"):
        resolve_reward_function(3)


USER_FILE = """
CALLS = []

def length_reward(data_source, solution_str, ground_truth, extra_info):
    CALLS.append(extra_info.get("k"))
    return {"score": len(solution_str) / 10, "extra": 1}

def picky(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "boom":
        raise KeyError("no such key")
    return solution_str == ground_truth

def returns_nan(data_source, solution_str, ground_truth, extra_info):
    return float("nan")

def returns_text(data_source, solution_str, ground_truth, extra_info):
    return "1.0"

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def test_user_function_from_file(user_file):
    fn = resolve_reward_function(f"{user_file}:length_reward")
    scores, info = score_responses(
        ["abc", "abcde"], [_row("x", extra={"k": 1}), _row("y")], function=fn
    )
    assert scores == [0.3, 0.5] and info["reward/errors"] == 0.0
    picky = resolve_reward_function(f"{user_file}:picky")
    assert score_responses(["a", "b"], [_row("a"), _row("a")], function=picky)[0] == [1.0, 0.0]


def test_user_file_errors_are_clear(user_file, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_reward_function(f"{tmp_path / 'nope.py'}:fn")
    with pytest.raises(ValueError, match=r"has no 'missing'.*length_reward"):
        resolve_reward_function(f"{user_file}:missing")
    with pytest.raises(TypeError, match="not callable"):
        resolve_reward_function(f"{user_file}:NOT_A_FUNCTION")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match=r"importing .* failed: ModuleNotFoundError"):
        resolve_reward_function(f"{broken}:fn")
    leaving = tmp_path / "leaving.py"  # exit() at import ended the run silently on main
    leaving.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ValueError, match=r"importing .* failed: SystemExit: 3"):
        resolve_reward_function(f"{leaving}:fn")


def test_errors_in_user_code_are_wrapped_with_index_and_name(user_file):
    picky = resolve_reward_function(f"{user_file}:picky")
    rows = [_row("a"), _row("a"), _row("a")]
    with pytest.raises(RewardError, match=r"'picky' failed on sample 1 .*KeyError") as info:
        score_responses(["a", "boom", "boom"], rows, function=picky)
    assert isinstance(info.value.__cause__, KeyError)
    # where in the user's file, and the switch that keeps the run going (it named neither)
    line = USER_FILE.splitlines().index('        raise KeyError("no such key")') + 1
    assert f"(at {user_file}:{line})" in str(info.value), str(info.value)
    assert "reward.on_error=zero" in str(info.value)
    scores, info = score_responses(["a", "boom", "boom"], rows, function=picky, on_error="zero")
    assert scores == [1.0, 0.0, 0.0] and info["reward/errors"] == 2.0


@pytest.mark.parametrize("name", ["returns_nan", "returns_text"])
def test_bad_return_values_are_errors(user_file, name):
    fn = resolve_reward_function(f"{user_file}:{name}")
    with pytest.raises(RewardError, match=f"'{name}' failed on sample 0"):
        score_responses(["a"], [_row("a")], function=fn)
    scores, info = score_responses(["a"], [_row("a")], function=fn, on_error="zero")
    assert scores == [0.0] and info["reward/errors"] == 1.0 and not math.isnan(scores[0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="on_error"):
        score_responses(["a"], [_row("a")], on_error="ignore")
    with pytest.raises(ValueError, match="rows"):
        score_responses(["a", "b"], [_row("a")])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (np.float32(0.25), 0.25),
        (np.float64(0.5), 0.5),
        (np.int64(1), 1.0),
        (np.bool_(True), 1.0),
        (np.array(0.75), 0.75),  # 0-d array
        (torch.tensor(0.125), 0.125),  # 0-d tensor
        (torch.tensor(True), 1.0),
        ({"score": np.float32(0.5)}, 0.5),
    ],
)
def test_numpy_scalars_and_0d_tensors_are_numbers(value, expected):
    scores, info = score_responses(["a"], [_row("a")], function=lambda *args: value)
    assert scores == [expected] and info["reward/errors"] == 0


@pytest.mark.parametrize("value", [torch.tensor([0.5]), np.array([1.0, 0.0]), "0.5", None])
def test_arrays_and_other_types_are_still_errors(value):
    with pytest.raises(RewardError, match="expected a number"):
        score_responses(["a"], [_row("a")], function=lambda *args: value)


def _sleepy(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "slow":
        time.sleep(30)
    return 1.0


def _swallowing(data_source, solution_str, ground_truth, extra_info):
    try:  # user code that catches everything must not hide the time limit
        time.sleep(30)
    except Exception:
        return 1.0
    return 1.0


@pytest.mark.parametrize("thread", [False, True])
def test_a_reward_past_its_time_limit_is_an_error(thread):
    rows = [_row("a")] * 3

    def run():
        start = time.monotonic()
        out = score_responses(
            ["fast", "slow", "fast"], rows, function=_sleepy, on_error="zero", timeout_s=0.3
        )
        return out, time.monotonic() - start

    if thread:  # not the main thread: no SIGALRM there, the call is abandoned instead
        box = {}
        worker = threading.Thread(target=lambda: box.update(result=run()))
        worker.start()
        worker.join(20)
        (scores, info), elapsed = box["result"]
    else:
        (scores, info), elapsed = run()
    assert scores == [1.0, 0.0, 1.0]
    assert info == {"reward/errors": 1.0, "reward/timeouts": 1.0}
    assert elapsed < 5
    with pytest.raises(RewardError, match=r"'_sleepy' failed on sample 0 .*reward.timeout_s=0.3 s"):
        score_responses(["slow"], rows[:1], function=_sleepy, timeout_s=0.3)


def test_the_time_limit_cannot_be_swallowed_and_restores_the_outer_timer():
    """A caller's own SIGALRM timer (pytest-timeout's here, or none) gets its handler and its
    remaining time back."""
    previous = signal.getsignal(signal.SIGALRM)
    outer, _ = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    scores, info = score_responses(
        ["x"], [_row("a")], function=_swallowing, on_error="zero", timeout_s=0.2
    )
    elapsed = time.monotonic() - start
    assert scores == [0.0] and info["reward/timeouts"] == 1.0 and elapsed < 5
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    assert left == 0.0 if outer == 0.0 else outer - elapsed - 1 < left <= outer
    assert signal.getsignal(signal.SIGALRM) is previous
    # no limit, and fast calls under a limit, behave as before
    assert score_responses(["a"], [_row("a")], timeout_s=None)[0] == [1.0]
    assert score_responses(["a"], [_row("a")], timeout_s=5.0)[0] == [1.0]
    with pytest.raises(ValueError, match="timeout_s"):
        score_responses(["a"], [_row("a")], timeout_s=-1)
