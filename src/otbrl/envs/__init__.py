"""otbrl.envs (floor 2, no torch): environments in Gymnasium's shape over text — the protocol
and its checks (``protocol``), calling them under a timeout, plain or ``async`` (``runner``), the
tool loop as an environment (``tools``) and the built-in ones (``builtin``). The agent loop that
runs them over a rollout backend lives in ``otbrl.rollout.agent``."""

from otbrl.envs.protocol import (
    OBSERVATION_ROLES,
    EnvError,
    EnvStep,
    check_reset,
    check_step,
    observation_messages,
    reset_seed,
    resolve_env,
)
from otbrl.envs.runner import EnvRunner
from otbrl.envs.tools import ToolEnv, tool_env_factory

__all__ = [
    "OBSERVATION_ROLES",
    "EnvError",
    "EnvRunner",
    "EnvStep",
    "ToolEnv",
    "check_reset",
    "check_step",
    "observation_messages",
    "reset_seed",
    "resolve_env",
    "tool_env_factory",
]
