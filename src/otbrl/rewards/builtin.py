"""Built-in reward functions and their selection by ``data_source``.

Every reward function has the signature ``fn(data_source, solution_str, ground_truth,
extra_info) -> float`` and scores one decoded response against the row's ground truth.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from otbrl.rewards.code import prime_code
from otbrl.rewards.math_answers import dapo_math, hendrycks_math
from otbrl.rewards.math_prime import geometry3k, prime_math
from otbrl.rewards.math_verify import math_verify_score
from otbrl.rewards.qa import search_r1_exact_match
from otbrl.rewards.reasoning_gym import reasoning_gym_score
from otbrl.rewards.sandbox import SandboxConfig

RewardFunction = Callable[[str, str, str, dict], float]

_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+")
# GSM8K's answer convention: the final answer follows "####".
_HASH_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+)")


def exact_match(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
    """1.0 when the response equals the ground truth after stripping surrounding whitespace."""
    return float(solution_str.strip() == str(ground_truth).strip())


def zero(data_source: str, solution_str: str, ground_truth, extra_info: dict) -> float:
    """0.0 for every response: with an environment (``rollout.multi_turn.env``) its rewards
    alone are the trajectory's."""
    return 0.0


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


_CHAIN_STEP = re.compile(r"((?:[a-z][0-9]){1,2})=([0-9]);")


def chain_sum(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
    """The ``chain_sum`` task's reward: 1.0 when the response walks every item of the prompt
    (``extra_info["items"]``, ``"a3b7c5"``) in order, one or two items per step, each written
    total the running sum modulo 10, and ends with ``####`` and the ground truth.

    Every step is checked, not only the answer: a reward on the answer alone pays for chains
    whose slips cancel (``+1`` at one step, ``-1`` at another), and RL then learns slips. Without
    ``items`` (a row from elsewhere) only the answer is checked, as ``gsm8k`` would."""
    text = solution_str.strip()
    steps, marker, answer = text.rpartition("####")
    if not marker or answer != str(ground_truth).strip():
        return 0.0
    items = (extra_info or {}).get("items")
    if not isinstance(items, str):
        return 1.0
    written = "".join(m.group(0) for m in _CHAIN_STEP.finditer(steps))
    if written != steps:  # anything between or around the steps
        return 0.0
    total, walked = 0, ""
    for match in _CHAIN_STEP.finditer(steps):
        pairs = match.group(1)
        walked += pairs
        total = (total + sum(int(d) for d in pairs[1::2])) % 10
        if match.group(2) != str(total):
            return 0.0
    return float(walked == items and answer == str(total))


BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "exact_match": exact_match,
    "digit_sum": digit_sum,
    "chain_sum": chain_sum,
    "gsm8k": gsm8k,
    "gsm8k_flexible": gsm8k_flexible,
    "hendrycks_math": hendrycks_math,
    "dapo_math": dapo_math,
    "prime_math": prime_math,
    "prime_code": prime_code,
    "geometry3k": geometry3k,
    "search_r1_exact_match": search_r1_exact_match,
    "zero": zero,
}

_MATH = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
_NUMINA = (
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
)
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
_SEARCH = (
    "searchR1_nq",
    "searchR1_triviaqa",
    "searchR1_popqa",
    "searchR1_hotpotqa",
    "searchR1_2wikimultihopqa",
    "searchR1_musique",
    "searchR1_bamboogle",
)

# The reward a row gets when no reward function is configured, keyed by its data_source:
# otbrl's tasks, and every source verl 0.9.1's default_compute_score knows (docs/rewards.md).
DATA_SOURCE_REWARDS: dict[str, RewardFunction] = {
    "otbrl/arithmetic": exact_match,
    "otbrl/digit_sum": digit_sum,
    "otbrl/tool_arithmetic": exact_match,
    "otbrl/chain_sum": chain_sum,
    "otbrl/guess": zero,  # the guess environment's rewards are the whole reward
    "openai/gsm8k": gsm8k,
    "gsm8k": gsm8k,
    **dict.fromkeys(_MATH, hendrycks_math),
    **dict.fromkeys(("math_dapo", "math", "math_dapo_reasoning"), dapo_math),
    **dict.fromkeys(_NUMINA, prime_math),
    **dict.fromkeys(CODE_SOURCES, prime_code),
    "hiyouga/geometry3k": geometry3k,
    **dict.fromkeys(_SEARCH, search_r1_exact_match),
}
# data_source prefixes, checked after the exact names: AIME years ("aime2024", "aime_2025"...)
DATA_SOURCE_PREFIXES: dict[str, RewardFunction] = {
    "aime": dapo_math,
    "reasoning_gym/": reasoning_gym_score,  # the dataset's own score_answer, on the row's entry
}
MATH_BACKENDS = ("verl", "math_verify")


def has_builtin_reward(data_source) -> bool:
    """Whether ``data_source`` has a built-in reward (an exact name or a known prefix)."""
    return isinstance(data_source, str) and (
        data_source in DATA_SOURCE_REWARDS or data_source.startswith(tuple(DATA_SOURCE_PREFIXES))
    )


def reward_for_data_source(
    data_source: str, *, math_backend: str = "verl", sandbox: SandboxConfig | None = None
) -> RewardFunction:
    """The built-in reward for ``data_source``; ``ValueError`` naming it when there is none.

    ``math_backend="math_verify"`` scores the MATH sources (``lighteval/MATH``,
    ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``) with the
    ``math-verify`` package instead of string normalisation; ``sandbox``: the limits code
    sources run under (default ``SandboxConfig()``).
    """
    if math_backend not in MATH_BACKENDS:
        raise ValueError(
            f"math_backend: expected one of {list(MATH_BACKENDS)}, got {math_backend!r}"
        )
    if not has_builtin_reward(data_source):
        raise ValueError(
            f"data_source: no built-in reward for {data_source!r} (known: "
            f"{sorted(DATA_SOURCE_REWARDS)} and names starting with "
            f"{sorted(DATA_SOURCE_PREFIXES)}); set reward.function to a built-in name "
            f"({sorted(BUILTIN_REWARDS)}) or to path/to/file.py:function"
        )
    fn = DATA_SOURCE_REWARDS.get(data_source)
    if fn is None:
        fn = next(f for p, f in DATA_SOURCE_PREFIXES.items() if data_source.startswith(p))
    if fn is hendrycks_math and math_backend == "math_verify":
        return math_verify_score
    if fn is prime_code and sandbox is not None:
        return functools.partial(prime_code, sandbox=sandbox)
    return fn


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth,
    extra_info=None,
    *,
    math_backend: str = "verl",
    sandbox: SandboxConfig | None = None,
):
    """Score one response as verl's ``default_compute_score`` does, for every data source it
    knows (Sandbox Fusion aside) and otbrl's own: a float, or a dict with ``"score"`` and
    extra entries (``dapo_math``: ``acc``, ``pred``; code: ``sandbox_violations``).

    ``ground_truth`` as verl takes it: a str (code: the test cases' JSON; Search-R1:
    ``{"target": [...]}``). Differences from verl, and why, are in docs/rewards.md's table.
    """
    fn = reward_for_data_source(data_source, math_backend=math_backend, sandbox=sandbox)
    return fn(data_source, solution_str, ground_truth, extra_info or {})
