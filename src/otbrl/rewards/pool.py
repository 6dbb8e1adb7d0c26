"""Scoring in worker processes, so that slow verifiers (sympy, code in the sandbox, a user's
remote call) run while the trainer computes the policy's statistics.

``RewardPool(settings).submit(responses, rows)`` splits the batch into one contiguous
chunk per worker and returns at once; ``Pending.result()`` waits and gives what
``score_responses`` would have given in this process. Workers are spawned (not forked: the
trainer holds threads and, on a GPU, a CUDA context), start once per run and load a user's
reward file once each; ``reward.function`` therefore travels as its spec
(``path/file.py:fn``), not as a function object.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor

from otbrl.errors import ConfigError
from otbrl.rewards.config import RewardConfig
from otbrl.rewards.scoring import score_each, summarize
from otbrl.settings import check_settings


class Pending:
    """Scores on their way: ``result()`` -> ``(scores, info)`` as ``score_responses``, plus
    ``timing/reward`` (submission to the last result) and ``timing/reward_wait`` (how long
    ``result`` blocked the caller)."""

    def __init__(self, futures: list[Future], started: float):
        self._futures = futures
        self._started = started

    def result(self) -> tuple[list[float], dict[str, float]]:
        """Wait for every chunk; a ``RewardError`` of a worker is raised here unchanged."""
        waiting = time.perf_counter()
        outcomes = [f.result() for f in self._futures]
        done = time.perf_counter()
        scores, info = summarize(outcomes)
        info["timing/reward"] = done - self._started
        info["timing/reward_wait"] = done - waiting
        return scores, info


class RewardPool:
    """``settings.workers`` spawned processes scoring with the run's reward settings
    (``RewardConfig.scoring_options``: ``function`` travels as its spec string). Raises
    ``ConfigError`` naming the key when a setting is out of its declared range or
    ``reward.workers`` is 0."""

    def __init__(self, settings: RewardConfig):
        check_settings(settings, "reward.")
        if settings.workers < 1:
            raise ConfigError(
                f"'reward.workers': a pool needs at least one worker, got {settings.workers}",
                "reward.workers",
            )
        self.workers = settings.workers
        self.options = settings.scoring_options()
        context = multiprocessing.get_context("spawn")
        self._executor = ProcessPoolExecutor(max_workers=self.workers, mp_context=context)

    def submit(self, responses: Sequence[str], rows: Sequence[dict]) -> Pending:
        """Start scoring; returns at once."""
        if len(responses) != len(rows):
            raise ValueError(f"rows: expected {len(responses)} rows, got {len(rows)}")
        started = time.perf_counter()
        size = max(1, -(-len(responses) // self.workers))  # ceil: at most one chunk per worker
        futures = [
            self._executor.submit(
                score_each,
                list(responses[i : i + size]),
                list(rows[i : i + size]),
                offset=i,
                **self.options,
            )
            for i in range(0, len(responses), size)
        ]
        return Pending(futures, started)

    def close(self) -> None:
        """Stop the workers (waits for running chunks)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
