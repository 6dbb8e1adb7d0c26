"""Built-in reward functions and their selection by ``data_source``.

Every reward function has the signature ``fn(data_source, solution_str, ground_truth,
extra_info) -> float`` and scores one decoded response against the row's ground truth.
"""

from __future__ import annotations

import re
from collections.abc import Callable

RewardFunction = Callable[[str, str, str, dict], float]

_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+")
# GSM8K's answer convention: the final answer follows "####".
_HASH_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+)")


def exact_match(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
    """1.0 when the response equals the ground truth after stripping surrounding whitespace."""
    return float(solution_str.strip() == str(ground_truth).strip())


def extract_gsm8k_answer(text: str, *, flexible: bool = False) -> str | None:
    """The final answer of a GSM8K-style response, normalised (no ``,``/``$``/trailing ``.0``).

    Strict: the number after the last ``####``. Flexible: falls back to the last number in the
    text when there is no ``####`` answer. ``None`` when nothing is found.
    """
    found = _HASH_ANSWER.findall(text)
    if not found and flexible:
        found = _NUMBER.findall(text)
    return _normalise_number(found[-1]) if found else None


def gsm8k(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
    """1.0 when the ``#### answer`` of the response equals the ground truth number."""
    answer = extract_gsm8k_answer(solution_str)
    return float(answer is not None and answer == _normalise_number(str(ground_truth)))


def gsm8k_flexible(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict
) -> float:
    """Like ``gsm8k``, but a response without ``####`` is scored on its last number."""
    answer = extract_gsm8k_answer(solution_str, flexible=True)
    return float(answer is not None and answer == _normalise_number(str(ground_truth)))


def _normalise_number(text: str) -> str:
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def digit_sum(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
    """1.0 when the response is digits 1-9 (surrounding whitespace stripped) summing to the
    ground truth; the ``digit_sum`` task's reward."""
    text = solution_str.strip()
    return float(
        bool(text) and set(text) <= set("123456789") and sum(map(int, text)) == int(ground_truth)
    )


BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "exact_match": exact_match,
    "digit_sum": digit_sum,
    "gsm8k": gsm8k,
    "gsm8k_flexible": gsm8k_flexible,
}

# The reward a row gets when no reward function is configured, keyed by its data_source.
DATA_SOURCE_REWARDS: dict[str, RewardFunction] = {
    "otbrl/arithmetic": exact_match,
    "otbrl/digit_sum": digit_sum,
    "otbrl/tool_arithmetic": exact_match,
    "openai/gsm8k": gsm8k,
    "gsm8k": gsm8k,
}


def reward_for_data_source(data_source: str) -> RewardFunction:
    """The built-in reward for ``data_source``; ``ValueError`` naming it when there is none."""
    try:
        return DATA_SOURCE_REWARDS[data_source]
    except (KeyError, TypeError):
        raise ValueError(
            f"data_source: no built-in reward for {data_source!r} (known: "
            f"{sorted(DATA_SOURCE_REWARDS)}); set reward.function to a built-in name "
            f"({sorted(BUILTIN_REWARDS)}) or to path/to/file.py:function"
        ) from None
