"""Resolving the configured reward function and scoring a batch of responses with it."""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from otbrl.rewards.builtin import BUILTIN_REWARDS, RewardFunction, reward_for_data_source
from otbrl.rewards.sandbox import SandboxConfig
from otbrl.user_code import load_user_function

logger = logging.getLogger(__name__)
ON_ERROR = ("raise", "zero")
# extra entries of a reward's dict that are counted over the batch (the rest are averaged)
COUNTED = frozenset({"sandbox_violations"})


class RewardError(RuntimeError):
    """A reward function raised or returned something that is not a finite number."""


class RewardTimeout(BaseException):
    """A reward call ran past its time limit. A ``BaseException``, so that a reward function's
    own ``except Exception`` cannot swallow it."""


def resolve_reward_function(spec: str | None) -> RewardFunction | None:
    """Turn a configured reward into a function.

    Args:
        spec: ``None`` (choose per row by ``data_source``), a built-in name (``exact_match``,
            ``gsm8k``, ``gsm8k_flexible``) or ``"path/to/file.py:function"``.

    Returns:
        The function, or ``None`` for ``spec=None``.
    """
    if spec is None:
        return None
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"reward function: expected a name or 'path/file.py:fn', got {spec!r}")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(
            f"reward function: {spec!r} is neither a built-in ({sorted(BUILTIN_REWARDS)}) "
            f"nor 'path/to/file.py:function'"
        )
    return load_user_function(spec, "reward function")


class Outcome(NamedTuple):
    """Scores of a run of samples before they are summarised: the scores, each sample's extra
    dict entries, and the error and timeout counts (``score_each``; a pool worker returns one
    per chunk)."""

    scores: list[float]
    entries: list[dict[str, float]]
    errors: int
    timeouts: int


def score_responses(
    responses: Sequence[str], rows: Sequence[dict], **options: Any
) -> tuple[list[float], dict[str, float]]:
    """Score each response against its row's ground truth: ``score_each`` over the whole batch
    (its keyword ``options``: ``function``, ``on_error``, ``timeout_s``, ``math_backend``,
    ``sandbox``, ``batched``), summarized.

    Returns:
        ``(scores, info)``: B floats and ``{"reward/errors": count, "reward/timeouts": count}``
        (timeouts are errors too), plus the batch mean of each other numeric entry a function
        returned in a dict (``reward/<key>``; the count for ``sandbox_violations``).
    """
    return summarize([score_each(responses, rows, **options)])


def summarize(outcomes: Sequence[Outcome]) -> tuple[list[float], dict[str, float]]:
    """Consecutive chunks' outcomes -> ``score_responses``'s ``(scores, info)``."""
    scores = [x for o in outcomes for x in o.scores]
    info = {
        "reward/errors": float(sum(o.errors for o in outcomes)),
        "reward/timeouts": float(sum(o.timeouts for o in outcomes)),
    }
    extras: dict[str, list[float]] = {}
    for entries in (e for o in outcomes for e in o.entries):
        for key, value in entries.items():
            extras.setdefault(key, []).append(value)
    for key, values in extras.items():
        info[f"reward/{key}"] = float(sum(values) if key in COUNTED else sum(values) / len(values))
    return scores, info


def score_each(
    responses: Sequence[str],
    rows: Sequence[dict],
    *,
    function: RewardFunction | str | None = None,
    on_error: str = "raise",
    timeout_s: float | None = None,
    math_backend: str = "verl",
    sandbox: SandboxConfig | None = None,
    batched: bool = False,
    offset: int = 0,
) -> Outcome:
    """Score each response against its row's ground truth (``score_responses`` before the
    summary).

    Args:
        responses: B decoded responses.
        rows: B schema rows (``data_source``, ``reward_model.ground_truth``, ``extra_info``);
            with n samples per prompt, repeat each row n times.
        function: the reward for every row (a callable, or a spec for
            ``resolve_reward_function``); ``None`` picks the built-in for each row's
            ``data_source`` (an unknown one is a ``ValueError`` naming it, whatever
            ``on_error`` says: that is a configuration problem, not a bad sample).
        on_error: ``"raise"`` (a ``RewardError`` naming the sample index and function) or
            ``"zero"`` (the sample scores 0.0 and is counted).
        timeout_s: the longest one sample's scoring may take (None or 0: no limit); a call
            that runs longer is an error handled by ``on_error``. In the main thread a
            ``SIGALRM`` timer interrupts the call; elsewhere the call runs in a helper thread
            that is abandoned (Python cannot stop a thread) when it runs late.
        math_backend, sandbox: how the built-in rewards score MATH rows and run code
            (``reward_for_data_source``); unused with ``function``.
        batched: ``function`` takes lists — ``fn(data_sources, solution_strs, ground_truths,
            extra_infos)`` — and returns one result per sample (verl's batched convention);
            one call for the batch, ``timeout_s`` × B long at most.
        offset: the index of the first sample in the whole batch, for error messages (a pool
            scores chunks).

    Returns:
        an ``Outcome``: B scores, each sample's extra entries, the error and timeout counts
        (timeouts are errors too). A function may return a number (NumPy scalars and 0-d
        tensors included), a bool, or a dict with a ``"score"`` entry; the dict's other
        numeric entries become ``reward/<key>``: the batch mean (over the samples that
        reported it), or the count for ``sandbox_violations``. A list ground truth means
        "any of these": the sample gets the best score over its items (and that item's
        entries); a batched function gets the ground truths as they are.
    """
    _check_score_args(responses, rows, on_error, timeout_s)
    if isinstance(function, str):
        function = resolve_reward_function(function)
    if batched:
        if function is None:
            raise ValueError("batched: a batched reward needs reward.function")
        return _score_batched(function, responses, rows, on_error, timeout_s, offset)
    if function is None:
        functions = [
            reward_for_data_source(
                row.get("data_source"), math_backend=math_backend, sandbox=sandbox
            )
            for row in rows
        ]
    else:
        functions = [function] * len(rows)
    return _score_one_by_one(functions, responses, rows, on_error, timeout_s, offset)


def _check_score_args(responses, rows, on_error, timeout_s) -> None:
    """``score_each``'s arguments (``ValueError`` naming the argument)."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error: expected one of {list(ON_ERROR)}, got {on_error!r}")
    if timeout_s is not None and not (isinstance(timeout_s, int | float) and timeout_s >= 0):
        raise ValueError(f"timeout_s: expected None or seconds >= 0, got {timeout_s!r}")
    if len(responses) != len(rows):
        raise ValueError(
            f"rows: expected {len(responses)} rows (one per response), got {len(rows)}"
        )


def _score_one_by_one(functions, responses, rows, on_error, timeout_s, offset) -> Outcome:
    """One call per sample (``functions[i]`` scores sample i), each under the deadline; a
    failure is that sample's alone (``on_error``)."""
    scores: list[float] = []
    entries: list[dict[str, float]] = []
    errors = timeouts = 0
    for i, (response, row, fn) in enumerate(zip(responses, rows, functions)):
        try:
            score, extra = _with_deadline(timeout_s, _call, fn, response, row)
        except (Exception, RewardTimeout) as e:
            timeouts += isinstance(e, RewardTimeout)
            _handle(
                e,
                fn,
                f"sample {offset + i} (data_source {row.get('data_source')!r})",
                on_error,
                timeout_s,
                first=errors == 0,
            )
            errors += 1
            score, extra = 0.0, {}
        scores.append(score)
        entries.append(extra)
    return Outcome(scores, entries, errors, timeouts)


def _score_batched(fn, responses, rows, on_error, timeout_s, offset) -> Outcome:
    """One call of a batched function for all samples; a failure fails them all."""
    n = len(responses)

    def call():
        results = fn(
            [row.get("data_source") for row in rows],
            list(responses),
            [row["reward_model"]["ground_truth"] for row in rows],
            [row.get("extra_info") or {} for row in rows],
        )
        results = list(results)
        if len(results) != n:
            raise ValueError(f"returned {len(results)} results for {n} samples")
        return [_number(r) for r in results]

    try:
        numbers = _with_deadline(timeout_s * n if timeout_s else None, call)
    except (Exception, RewardTimeout) as e:
        _handle(
            e,
            fn,
            f"samples {offset}..{offset + n - 1} (one batched call)",
            on_error,
            timeout_s,
            first=True,
        )
        return Outcome([0.0] * n, [{}] * n, n, n * isinstance(e, RewardTimeout))
    return Outcome([x for x, _ in numbers], [e for _, e in numbers], 0, 0)


def _handle(e, fn, what: str, on_error: str, timeout_s, *, first: bool) -> None:
    """Raise the failure as a ``RewardError`` naming the function and the samples, or (with
    ``on_error="zero"``) log the first of the batch."""
    if isinstance(e, RewardTimeout):
        why = f"ran longer than the time limit (reward.timeout_s={timeout_s:g} s)"
    else:
        why = f"{type(e).__name__}: {e}{_where(e, fn)}"
    error = RewardError(f"reward function {_name(fn)!r} failed on {what}: {why}")
    if on_error == "raise":
        fix = "; reward.on_error=zero scores such samples 0 and counts them (reward/errors)"
        raise RewardError(f"{error}{fix}") from e
    if first:
        logger.warning("%s (scored 0; later failures in this batch are only counted)", error)


def _where(e: BaseException, fn) -> str:
    """`` (at file.py:line)``: where in ``fn``'s file ``e`` was raised (its innermost frame
    there), else its innermost frame outside otbrl (a library the function called), or ""."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frames = [(f.f_code.co_filename, line) for f, line in traceback.walk_tb(e.__traceback__)]
    own = getattr(getattr(fn, "__code__", None), "co_filename", None)
    for keep in (lambda name: name == own, lambda name: not name.startswith(package)):
        found = [(name, line) for name, line in frames if keep(name)]
        if found:
            return f" (at {found[-1][0]}:{found[-1][1]})"
    return ""


def _call(fn: RewardFunction, response: str, row: dict) -> tuple[float, dict[str, float]]:
    ground_truth = row["reward_model"]["ground_truth"]
    truths = ground_truth if isinstance(ground_truth, list | tuple) else [ground_truth]
    if not truths or not all(isinstance(t, str) for t in truths):
        raise TypeError(
            f"ground_truth must be a str or a non-empty list of str, got {ground_truth!r} "
            "(otbrl.data.normalize_ground_truth turns numbers into text)"
        )
    extra = row.get("extra_info") or {}
    results = [_number(fn(row.get("data_source"), response, t, extra)) for t in truths]
    return max(results, key=lambda r: r[0])


def _number(result) -> tuple[float, dict[str, float]]:
    """The score, and the other numeric entries of a dict result."""
    entries = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise TypeError(f"returned a dict without a 'score' entry (keys {sorted(result)})")
        entries = {
            str(k): float(v)
            for k, v in result.items()
            if k != "score" and isinstance(v, int | float) and math.isfinite(v)
        }
        result = result["score"]
    if getattr(result, "ndim", None) == 0 and callable(getattr(result, "item", None)):
        result = result.item()  # a NumPy scalar or a 0-d tensor
    if not isinstance(result, int | float):  # bool is an int
        raise TypeError(f"returned {type(result).__name__}, expected a number")
    if not math.isfinite(result):
        raise ValueError(f"returned {result!r}, expected a finite number")
    return float(result), entries


def _with_deadline(seconds: float | None, call: Callable, *args):
    """``call(*args)``, raising ``RewardTimeout`` if it runs longer than ``seconds``."""
    if not seconds:
        return call(*args)
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "setitimer"
    ):
        return _in_thread(seconds, call, *args)

    def expire(signum, frame):
        raise RewardTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    start = time.monotonic()
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return call(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:  # someone else's timer was running: give it its remaining time back
            left = max(outer - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, interval)


def _in_thread(seconds: float, call: Callable, *args):
    box: dict[str, object] = {}

    def run():
        try:
            box["value"] = call(*args)
        except BaseException as e:  # handed to the caller's thread below
            box["error"] = e

    worker = threading.Thread(target=run, name="otbrl-reward", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise RewardTimeout
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
