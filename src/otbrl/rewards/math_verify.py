"""The ``math-verify`` backend (``reward.math_backend=math_verify``) for the MATH sources:
Hugging Face's parser and verifier instead of string normalisation, as verl's
``math_verify.compute_score`` calls them (the ground truth wrapped in ``\\boxed{}``; the
response read as an expression or as LaTeX; 1.0 when any reading verifies, else 0.0).

``pip install 'otbrl[rewards]'`` brings ``math-verify``. Its own time limits use
``SIGALRM`` (main thread only, and they would replace otbrl's reward timer), so they are off
here: ``reward.timeout_s`` bounds a call, as for every reward.
"""

from __future__ import annotations


def math_verify_score(data_source: str, solution_str: str, ground_truth: str, extra_info) -> float:
    """1.0 when ``math-verify`` finds the response equal to the ground truth, else 0.0 (also
    when either cannot be parsed)."""
    try:
        from math_verify.grader import verify
        from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig, parse
    except ImportError as e:
        raise ImportError(
            "reward.math_backend=math_verify needs the math-verify package: "
            "pip install 'otbrl[rewards]'"
        ) from e
    gold = parse("\\boxed{" + ground_truth + "}", (LatexExtractionConfig(),), parsing_timeout=None)
    pred = parse(
        solution_str, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=None
    )
    if not gold or not pred:
        return 0.0
    try:
        return max(
            1.0 if any(verify(g, p, timeout_seconds=None) for g in gold) else 0.0 for p in pred
        )
    except Exception:  # sympy errors inside a comparison: not equal, as verl scores them
        return 0.0
