"""Scoring in worker processes, so that slow verifiers (sympy, code in the sandbox, a user's
remote call) run while the trainer computes the policy's statistics.

``RewardPool(settings).submit(responses, rows)`` splits the batch into one contiguous
chunk per worker and returns at once; ``Pending.result()`` waits and gives what
``score_responses`` would have given in this process. Workers are spawned (not forked: the
trainer holds threads and, on a GPU, a CUDA context), start once per run and load a user's
reward file once each; ``reward.function`` therefore travels as its spec
(``path/file.py:fn``), not as a function object, with the file's SHA-256 taken when the pool
starts: a worker loads the file only if it is still that file (an edit made mid-run is an
error naming it, never a reward that silently changes) and keeps what it loaded for the rest of
the run, as the trainer keeps the function it loaded at the start.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor

from otbrl.errors import ConfigError
from otbrl.rewards.config import RewardConfig
from otbrl.rewards.scoring import resolve_reward_function, score_each, summarize
from otbrl.settings import check_settings
from otbrl.user_code import file_sha256, spec_file

_LOADED: dict[tuple[str, str], Callable] = {}  # in a worker: (spec, SHA-256) -> function


def _score_chunk(responses, rows, *, offset: int, pins: dict[str, str], **options):
    """``score_each`` in a worker, with a user's reward file loaded once and only as it was
    when the pool started (``pins``: resolved path -> SHA-256)."""
    spec, file = options["function"], spec_file(options["function"])
    if file is not None and str(file) in pins:
        key = (spec, pins[str(file)])
        if key not in _LOADED:
            now = file_sha256(file)
            if now != pins[str(file)]:
                raise ValueError(
                    f"reward.function: {file} changed since the run started (SHA-256 "
                    f"{pins[str(file)][:12]}… then, {now[:12]}… now); the run scores with the "
                    "file it started with: restore it, or stop and resume the run to use the edit"
                )
            _LOADED[key] = resolve_reward_function(spec)
        options["function"] = _LOADED[key]
    return score_each(responses, rows, offset=offset, **options)


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
        file = spec_file(self.options["function"])
        self._pins = {str(file): file_sha256(file)} if file is not None and file.is_file() else {}
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
                _score_chunk,
                list(responses[i : i + size]),
                list(rows[i : i + size]),
                offset=i,
                pins=self._pins,
                **self.options,
            )
            for i in range(0, len(responses), size)
        ]
        return Pending(futures, started)

    def close(self) -> None:
        """Stop the workers (waits for running chunks)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
