"""otbrl.ops: per-token statistics of a softmax policy (log π(y), entropy, Σπ²).

Pure tensor math, no config and no I/O; see ``otbrl.ops.token_stats`` for the shared
policies (ignored labels, NaN rows, output dtypes).
"""

from otbrl.ops.fused_linear import fused_linear_token_stats
from otbrl.ops.token_stats import IGNORE_INDEX, TokenStats, sum_pi_squared, token_stats
from otbrl.ops.vocab_parallel import vocab_parallel_token_stats

__all__ = [
    "IGNORE_INDEX",
    "TokenStats",
    "fused_linear_token_stats",
    "sum_pi_squared",
    "token_stats",
    "vocab_parallel_token_stats",
]
