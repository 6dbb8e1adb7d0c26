"""The demo's first steps log the same metrics, in range, on any machine.

What a step computes is checked bit for bit by ``benchmarks/regression.py``, which runs these
same short demo runs on the working tree and on a base commit side by side on one machine:
bit-exact values hold on one CPU, one thread count, one library build — never across the
machines users clone onto (an AMX Xeon and an AVX-512 EPYC, both ``AVX512`` to torch, differed
at step 0). What holds everywhere is checked here: every step's metric *names* (a metric that
disappears or appears is a change of behaviour: ``tests/data/demo_metric_names.json``), the
step and validation schedule, and each value's range (finite, fractions in [0, 1]).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from otbrl.cli import main

_spec = importlib.util.spec_from_file_location(
    "otbrl_regression_tool", Path(__file__).resolve().parents[1] / "benchmarks" / "regression.py"
)
_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tool)
RUNS, demo_argv, differences, read_metrics = (
    _tool.RUNS, _tool.demo_argv, _tool.differences, _tool.read_metrics
)  # fmt: skip

NAMES = Path(__file__).parent / "data" / "demo_metric_names.json"
# the demo runs checked here; benchmarks/regression.py also runs chain_sum, whose warm start alone
# takes ~50 s on 2 cores (136-token responses): a developer's tool, not make test's budget
TESTED = ("arithmetic", "tool_arithmetic")
# fractions of something
IN_UNIT = ("val/accuracy", "train/response_clip_ratio", "policy/clip_frac", "tool/call_rate")


@pytest.mark.parametrize("task", TESTED)
def test_demo_first_steps_log_the_recorded_metric_names_in_range(task, tmp_path, one_thread):
    assert main(demo_argv(task, tmp_path / task, tmp_path / "cache")) == 0
    got = read_metrics(tmp_path / task)
    want = json.loads(NAMES.read_text())[task]
    assert sorted(got, key=int) == sorted(want, key=int), "the logged steps changed"
    for step, names in want.items():
        assert sorted(got[step]) == names, f"step {step}: metric names changed"
    for step, metrics in got.items():
        for key, value in metrics.items():
            assert not isinstance(value, float) or math.isfinite(value), (step, key, value)
            if key in IN_UNIT:
                assert 0.0 <= value <= 1.0, (step, key, value)


def test_the_bit_for_bit_comparison_flags_any_change():
    """``benchmarks/regression.py``'s comparison: equal runs pass, one changed bit, a missing
    metric or step is reported, NaN equals NaN."""
    base = {"1": {"a": 0.1, "b": float("nan")}, "2": {"a": 1.0}}
    assert differences(base, json.loads(json.dumps(base))) == []
    assert differences(base, {"1": {"a": 0.1, "b": float("nan")}, "2": {"a": 1.0}}) == []
    changed = {"1": {"a": math.nextafter(0.1, 1), "b": float("nan")}, "2": {"a": 1.0}}
    assert differences(base, changed) == [f"step 1 a: base 0.1 new {math.nextafter(0.1, 1)!r}"]
    assert differences(base, {"1": {"a": 0.1}, "2": {"a": 1.0}}) == ["step 1 b: base nan new None"]
    assert differences(base, {"1": base["1"]}) == ["step 2: only in base"]


def test_the_tested_runs_are_the_regression_tool_s():
    assert set(TESTED) <= set(RUNS) and set(TESTED) <= set(json.loads(NAMES.read_text()))
