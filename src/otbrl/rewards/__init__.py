"""otbrl.rewards: built-in rewards, per-data_source selection, user reward files."""

from otbrl.rewards.builtin import (
    BUILTIN_REWARDS,
    DATA_SOURCE_REWARDS,
    RewardFunction,
    exact_match,
    extract_gsm8k_answer,
    gsm8k,
    gsm8k_flexible,
    reward_for_data_source,
)
from otbrl.rewards.scoring import RewardError, resolve_reward_function, score_responses

__all__ = [
    "BUILTIN_REWARDS",
    "DATA_SOURCE_REWARDS",
    "RewardError",
    "RewardFunction",
    "exact_match",
    "extract_gsm8k_answer",
    "gsm8k",
    "gsm8k_flexible",
    "resolve_reward_function",
    "reward_for_data_source",
    "score_responses",
]
