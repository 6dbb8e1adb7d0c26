"""Code rewards (verl's ``prime_code``, for ``codecontests``, ``apps``, ``codeforces``,
``taco``): the response's last ``python`` block run on the row's test cases in the sandbox.

The ground truth is ``{"inputs": [...], "outputs": [...], "fn_name"?: str}`` (or its JSON).
Score: 1.0 when one run passes every test case; otherwise the fraction of the first 10 cases
that pass when each runs alone (a continuous reward). Outputs are compared as the APPS
harness does: whole text up to surrounding whitespace, then line by line, then as numbers
(``numpy.allclose`` tolerances), then as sets of tokens. The program's outputs come back from
the sandbox; the expected ones never enter it.
"""

from __future__ import annotations

import ast
import json
import math
from concurrent.futures import ThreadPoolExecutor

from otbrl.rewards.sandbox import RunResult, SandboxConfig, run_program

MAX_SEPARATE_CASES = 10  # verl scores partial solutions on the first 10 cases


def extract_python(completion: str) -> str:
    """The code of the last fenced ``python`` block (the whole text when there is none)."""
    return completion.split("```python")[-1].split("```")[0]


def _close(a: float, b: float) -> bool:
    """``numpy.isclose`` with its default tolerances (rtol 1e-5, atol 1e-8)."""
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= 1e-8 + 1e-5 * abs(b)


def _int_like(text) -> bool:
    return isinstance(text, int) or (isinstance(text, str) and text.isdigit())


def _all_int_like(lines: list[str], expected: list[str]) -> bool | None:
    """Whether every pair is two integers; None where pairing them fails (lengths differ and
    every pair up to the shorter end was integers)."""
    for a, b in zip(lines, expected):
        if not (_int_like(a) and _int_like(b)):
            return False
    return True if len(lines) == len(expected) else None


def stdin_output_matches(output: str, expected) -> bool:
    """Does a program's stdout ``output`` match ``expected`` (a str, or lines joined)?"""
    expected = "\n".join(expected) if isinstance(expected, list) else expected
    lines = output.splitlines()
    if "\n".join(lines).strip() == expected.strip():
        return True
    if "\n".join(line.strip() for line in lines).strip() == expected.strip():
        return True
    if lines == [expected]:
        return True
    wanted = [line.strip() for line in expected.split("\n") if line]
    if lines == [wanted] or lines == wanted:
        return True
    lines = [line for line in lines if line]
    if lines == [wanted] or lines == wanted:
        return True
    if _all_int_like(lines, wanted) is False:
        try:
            got, want = [float(x) for x in lines], [float(x) for x in wanted]
        except ValueError:
            pass
        else:
            if len(got) == len(want) and all(_close(g, w) for g, w in zip(got, want)):
                return True
    # as sets of whitespace-separated tokens: only two empty outputs compare equal here
    return lines == [set(w.split()) for w in wanted]


def _int_keys(value):
    try:
        return [{int(k): v for k, v in value.items()}]
    except (ValueError, AttributeError):
        return value


def call_output_matches(output_repr: str, expected_json: str) -> bool:
    """Does a function's return value (``repr``) match the expected JSON value? Tuples count
    as lists; a dict's keys are compared as integers when they are numbers."""
    # a repr far longer than any rendering of the expected value cannot equal it: not parsed
    # (the program's output reaches the trainer's process; 3 MB took 3 s and 1 GB to parse)
    if len(output_repr) > 4 * len(expected_json) + 1024:
        return False
    expected = json.loads(expected_json)
    if isinstance(expected, dict):
        expected = _int_keys(expected)
    if isinstance(expected, list) and expected and isinstance(expected[0], dict):
        expected = _int_keys(expected[0])
    try:
        value = ast.literal_eval(output_repr)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False
    if isinstance(value, tuple):
        value = list(value)
    if value == expected:
        return True
    if isinstance(expected, list) and expected and value == expected[0]:
        return True
    try:
        return isinstance(value[0], tuple) and [list(x) for x in value] == expected[0]
    except (TypeError, IndexError, KeyError):
        return False


def _passed(run: RunResult, outputs: list, fn_name: str | None) -> list[bool]:
    """Per case of the run, whether it passed (cases after the first failure are not run)."""
    passed = []
    for case, expected in zip(run.cases, outputs):
        if case.get("status") != "ok":
            passed.append(False)
            continue
        try:
            if fn_name:
                ok = call_output_matches(case["output"], expected)
            else:
                ok = stdin_output_matches(case["output"], expected)
        except (ValueError, TypeError, KeyError):  # expected outputs that are not valid JSON
            ok = False
        passed.append(ok)
    return passed


def prime_code(
    data_source: str,
    solution_str: str,
    ground_truth,
    extra_info,
    *,
    sandbox: SandboxConfig | None = None,
) -> dict:
    """``{"score": fraction passed, "sandbox_violations": 0 | 1}`` for a code response (see
    the module doc); malformed test cases score 0."""
    config = sandbox or SandboxConfig()
    try:
        cases = ground_truth if isinstance(ground_truth, dict) else json.loads(ground_truth)
        inputs, outputs = list(cases["inputs"]), list(cases["outputs"])
        fn_name = cases.get("fn_name")
    except (ValueError, TypeError, KeyError, AttributeError):
        return {"score": 0.0, "sandbox_violations": 0}
    if len(outputs) < len(inputs):
        return {"score": 0.0, "sandbox_violations": 0}
    inputs = ["\n".join(x) if isinstance(x, list) else str(x) for x in inputs]
    code = extract_python(solution_str)
    together = run_program(code, inputs, fn_name=fn_name, config=config)
    violations = bool(together.violations)
    verdicts = _passed(together, outputs, fn_name)
    if len(verdicts) == len(inputs) and all(verdicts):
        return {"score": 1.0, "sandbox_violations": int(violations)}
    if len(inputs) == 1:  # alone it would run exactly as it just did
        return {"score": 0.0, "sandbox_violations": int(violations)}
    first = list(range(min(len(inputs), MAX_SEPARATE_CASES)))
    with ThreadPoolExecutor(max_workers=max(1, min(config.max_workers, len(first)))) as pool:
        runs = list(
            pool.map(
                lambda i: run_program(code, [inputs[i]], fn_name=fn_name, config=config), first
            )
        )
    passed = sum(all(_passed(r, [outputs[i]], fn_name) or [False]) for i, r in zip(first, runs))
    violations = violations or any(r.violations for r in runs)
    return {"score": passed / max(len(first), 1), "sandbox_violations": int(violations)}
