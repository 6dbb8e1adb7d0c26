"""otbrl.rewards: built-in rewards (otbrl's tasks and every data source verl scores),
per-data_source selection, user reward files, the code sandbox."""

from otbrl.rewards.builtin import (
    BUILTIN_REWARDS,
    CODE_SOURCES,
    DATA_SOURCE_PREFIXES,
    DATA_SOURCE_REWARDS,
    MATH_BACKENDS,
    RewardFunction,
    compute_score,
    exact_match,
    extract_gsm8k_answer,
    gsm8k,
    gsm8k_flexible,
    has_builtin_reward,
    reward_for_data_source,
)
from otbrl.rewards.sandbox import SandboxConfig, SandboxUnavailable, sandbox_problem
from otbrl.rewards.scoring import RewardError, resolve_reward_function, score_responses

__all__ = [
    "BUILTIN_REWARDS",
    "CODE_SOURCES",
    "DATA_SOURCE_PREFIXES",
    "DATA_SOURCE_REWARDS",
    "MATH_BACKENDS",
    "RewardError",
    "RewardFunction",
    "SandboxConfig",
    "SandboxUnavailable",
    "compute_score",
    "exact_match",
    "extract_gsm8k_answer",
    "gsm8k",
    "gsm8k_flexible",
    "has_builtin_reward",
    "resolve_reward_function",
    "reward_for_data_source",
    "sandbox_problem",
    "score_responses",
]
