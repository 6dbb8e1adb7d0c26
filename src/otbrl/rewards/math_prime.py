"""The NuminaMath reward (verl's ``prime_math``) and geometry3k's, on the PRM800K grader.

``prime_math``: the answer is pulled out of the response (``answer:`` / ``the answer is`` /
the last ``\\boxed{}`` / the last ``is`` / ``=``), graded by ``grade_answer``, and on failure by
``math_equal``: numbers within a relative 1e-4 (also read as a percentage), intervals,
tuples, points, matrices, symbolic equality. 1.0 or 0.0.

``geometry3k``: 0.9 × (the last ``\\boxed{}`` graded by mathruler's dialect of PRM800K) +
0.1 × (the response has the ``<think>...</think> ... \\boxed{...}`` format).

Model text is never ``eval``-ed (``otbrl.rewards.math_grader``). sympy's LaTeX parser is
not used: it needs ``antlr4`` 4.11, which verl's own environment does not have (omegaconf
pins 4.9.3), so verl's scores never come from it either.
"""

from __future__ import annotations

import contextlib
import math
import re
from math import isclose

from otbrl.rewards.math_grader import grade_answer, parse_expr, safe_arithmetic


def _to_number(s) -> tuple[bool, float | None]:
    """(True, value) when ``s`` reads as a number (``{,}`` or ``,`` separators allowed)."""
    text = str(s)
    try:
        return True, float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return False, None


def _with_pi(text: str, pi: float):
    """``2\\pi`` -> ``2*pi``, ``\\pi`` -> ``1*pi``, evaluated when that leaves plain
    arithmetic (the text unchanged otherwise)."""
    idx = text.find("\\pi")
    while idx != -1:
        factor = f"*{pi}" if idx > 0 and text[idx - 1].isdigit() else f"1*{pi}"
        text = text[:idx] + factor + text[idx + 3 :]
        idx = text.find("\\pi", idx + 1)
    with contextlib.suppress(ValueError, ArithmeticError, TypeError):
        return safe_arithmetic(text)
    return text


def _prepare(answer, pi: float):
    """``$5`` -> ``5``, ``5%`` -> ``5``, ``101_2`` -> ``101`` (the digits of a base-n
    numeral, as an int; ``ValueError`` when they are not a number), ``\\pi`` evaluated."""
    if not isinstance(answer, str):
        return answer
    if re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer):
        return answer.replace("\\%", "").replace("%", "")
    if "_" in answer:
        return int(float(answer.split("_")[0]))
    if "\\pi" in answer:
        return _with_pi(answer, pi)
    return answer


_INTERVALS = (
    ("Interval(", "[", "]"),
    ("Interval.Ropen(", "[", ")"),
    ("Interval.Lopen(", "(", "]"),
    ("Interval.open(", "(", ")"),
)


def _sympy_interval_to_text(prediction: str) -> str:
    for prefix, left, right in _INTERVALS:
        m = re.match(f"^{re.escape(prefix)}(.*)\\)$", prediction)
        if m:
            return f"{left}{m.group(1)}{right}"
    return prediction


def _all_equal(preds, refs) -> bool:
    """Same length and ``math_equal`` item by item."""
    return len(preds) == len(refs) and all([math_equal(p, r) for p, r in zip(preds, refs)])


def math_equal(prediction, reference, tolerance: float = 1e-4, pi: float = math.pi) -> bool:
    """Are two answers equal: as text, as numbers (``reference`` also read ×100 or ÷100), as
    intervals / tuples / points / matrices element-wise, or symbolically (sympy)."""
    prediction, reference = _prepare(prediction, pi), _prepare(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    (p_ok, p_num), (r_ok, r_num) = _to_number(prediction), _to_number(reference)
    if p_ok and r_ok:
        return any(
            isclose(item, p_num, rel_tol=tolerance) for item in (r_num / 100, r_num, r_num * 100)
        )
    if not prediction and prediction not in (0, False):
        return False
    reference, prediction = str(reference).strip(), str(prediction).strip()
    prediction = _sympy_interval_to_text(prediction)
    pred_s, ref_s = prediction, reference
    square = prediction.startswith("[") and prediction.endswith("]")
    round_ = prediction.startswith("(") and prediction.endswith(")")
    if (square and not reference.startswith("(")) or (round_ and not reference.startswith("[")):
        pred_s, ref_s = pred_s.strip("[]()"), ref_s.strip("[]()")
    for ch in "{}()":
        pred_s, ref_s = pred_s.replace(ch, ""), ref_s.replace(ch, "")
    if pred_s == ref_s:
        return True
    if (
        prediction
        and reference
        and prediction[0] in "(["
        and prediction[-1] in ")]"
        and prediction[0] == reference[0]
        and prediction[-1] == reference[-1]
        and _all_equal(prediction[1:-1].split(","), reference[1:-1].split(","))
    ):
        return True
    if "," in prediction and "," in reference:
        preds = [p.strip() for p in prediction.split(",")]
        refs = [r.strip() for r in reference.split(",")]
        if len(preds) == len(refs):
            return _all_equal(preds, refs)
    # reference[0] on an empty reference raises, as the original does (scored 0 by the caller)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        preds = prediction[prediction.find("(") + 1 : -1].split(",")
        if _all_equal(preds, reference[1:-1].split(",")):
            return True
    if r"\begin{pmatrix}" in reference and prediction.startswith("Matrix"):
        with contextlib.suppress(Exception):  # sympy's errors on a malformed Matrix(...)
            if _all_equal(list(parse_expr(prediction)), reference.split()[1:-1:2]):
                return True
    elif (
        r"\begin{pmatrix}" in reference and prediction.startswith("[") and prediction.endswith("]")
    ):
        rows = safe_arithmetic(prediction)  # not arithmetic: raises, the answer is wrong
        if isinstance(rows, list):
            body = reference
            for affix in (r"\\begin{pmatrix}", r"\begin{pmatrix}"):
                body = body.removeprefix(affix)
            for affix in (r"\\end{pmatrix}", r"\end{pmatrix}"):
                body = body.removesuffix(affix)
            refs = [row.split("&") if "&" in row else row for row in body.split("\\")]
            with contextlib.suppress(Exception):
                if _all_equal(rows, refs):
                    return True
    return _symbolic_equal(prediction, reference, tolerance)


def _symbolic_equal(a: str, b: str, tolerance: float) -> bool:
    import sympy

    def parsed(s):
        try:
            return parse_expr(s)
        except Exception:  # sympy raises assorted errors on text that is not an expression
            return s

    a, b = parsed(a), parsed(b)
    with contextlib.suppress(Exception):
        if sympy.simplify(a - b) == 0:
            return True
    if isinstance(a, str) or isinstance(b, str):
        return False  # unparsable text is never handed to sympify (it evaluates Python)
    with contextlib.suppress(Exception):
        if isclose(sympy.N(a), sympy.N(b), rel_tol=tolerance):
            return True
    return False


def _boxed_inner(text: str) -> str | None:
    """The stripped content of the last ``\\boxed`` (or ``\\fbox``) group, from its first
    brace to the brace that closes it; None without one."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth, left = 0, None
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
            left = i if left is None else left
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[left + 1 : i].strip() if left is not None else None
    return None


def extract_prime_answer(response: str) -> str:
    """The answer the NuminaMath reward grades: after the last ``answer:`` / ``answer is`` /
    ``answers are``, before ``is the answer``..., the last ``\\boxed{}``, the text before the
    last ``". "``, then after the last ``is `` / ``=`` / ``: `` / ``get ``..."""
    for marker in ("answer:", "answer is", "answers are"):
        idx = response.lower().rfind(marker)
        if idx != -1:
            response = response[idx + len(marker) :].strip()
    for marker in ("is answer", "is the answer", "are answers", "are the answers"):
        idx = response.lower().rfind(marker)
        if idx != -1:
            response = response[:idx].strip()
    boxed = _boxed_inner(response)
    if boxed:
        response = boxed
    if ". " in response and response.lower().rfind(". ") != -1:
        response = response[: response.lower().rfind(". ")].strip()
    for marker in (
        "be ",
        "is ",
        "are ",
        "=",
        ": ",
        "get ",
        "be\n",
        "is\n",
        "are\n",
        ":\n",
        "get\n",
    ):
        idx = response.lower().rfind(marker)
        if idx != -1:
            response = response[idx + len(marker) :].strip()
    return response


def prime_math(data_source: str, solution_str: str, ground_truth: str, extra_info) -> float:
    """verl's NuminaMath reward: 1.0 when the extracted answer grades equal to the ground
    truth (PRM800K, then ``math_equal``; with ``\\pi`` read as π or as 3.14), else 0.0."""
    output, truth = str(solution_str), str(ground_truth)
    answer = extract_prime_answer(output)
    if grade_answer(answer, truth):
        return 1.0
    try:
        if "\\pi" in answer or "\\pi" in truth:
            return float(any([math_equal(answer, truth, pi=pi) for pi in (math.pi, 3.14)]))
        return float(math_equal(answer, truth))
    except Exception:  # as the original: an answer the checks choke on is wrong
        return 0.0


def mathruler_boxed(text: str) -> str:
    """The stripped content of the last ``\\boxed{...}``, or the text ``"None"``."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return "None"
    content, depth = text[start + len("\\boxed{") :], 0
    for i, ch in enumerate(content):
        depth += (ch == "{") - (ch == "}")
        if depth == -1:
            return content[:i].strip()
    return "None"


_GEO_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def geometry3k(data_source: str, solution_str: str, ground_truth: str, extra_info) -> float:
    """0.9 × accuracy of the last ``\\boxed{}`` (mathruler's grader) + 0.1 × format."""
    accuracy = float(grade_answer(mathruler_boxed(solution_str), ground_truth, mathruler=True))
    fmt = 1.0 if _GEO_FORMAT.fullmatch(solution_str) else 0.0
    return (1.0 - 0.1) * accuracy + 0.1 * fmt
