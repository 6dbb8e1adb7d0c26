"""Where every random draw of a run comes from: one seed, the step and the rank.

Every sample is a function of (``trainer.seed``, step, data-parallel rank), which is what makes
a killed run resume exactly and a multi-process run reproducible.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_seed(seed: int, step: int, rank: int = 0, round_: int = 0) -> int:
    """The sampling seed of one step (or repeat) on one data-parallel rank, in one round of
    dynamic sampling: every sample is a function of (seed, step, rank, round), which makes runs
    resume exactly."""
    return seed * 1_000_003 + step + rank * 1_000_000_007 + round_ * 1_000_000_000_039
