"""The built-in calculator behind a latency drawn from a log-normal (median 0.2 s, p99 ~3 s):
a stand-in for a tool that calls a remote service. Named ``calculator``, so it replaces the
built-in in ``rollout.multi_turn.tools=[benchmarks/slow_calculator.py:calculator]``."""

from __future__ import annotations

import math
import random
import time

from otbrl.tools.calculator import calculator as _calculator

MEDIAN_S = 0.2
P99_S = 3.0
SIGMA = math.log(P99_S / MEDIAN_S) / 2.326  # the normal's 99th percentile is 2.326 σ
_draws = random.Random(0)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, slowly.

    Args:
        expression: the arithmetic expression, e.g. 12*34
    """
    time.sleep(MEDIAN_S * math.exp(SIGMA * _draws.gauss(0.0, 1.0)))
    return _calculator(expression)
