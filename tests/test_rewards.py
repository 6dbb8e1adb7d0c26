import math

import pytest

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


def test_exact_match_strips_whitespace_only():
    assert exact_match("s", " 46\n", "46", {}) == 1.0
    assert exact_match("s", "46", " 46 ", {}) == 1.0
    assert exact_match("s", "4 6", "46", {}) == 0.0
    assert exact_match("s", "460", "46", {}) == 0.0
    assert exact_match("s", "", "46", {}) == 0.0


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


def test_errors_in_user_code_are_wrapped_with_index_and_name(user_file):
    picky = resolve_reward_function(f"{user_file}:picky")
    rows = [_row("a"), _row("a"), _row("a")]
    with pytest.raises(RewardError, match=r"'picky' failed on sample 1 .*KeyError") as info:
        score_responses(["a", "boom", "boom"], rows, function=picky)
    assert isinstance(info.value.__cause__, KeyError)
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
