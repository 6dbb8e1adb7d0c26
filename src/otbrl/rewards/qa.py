"""Question-answering exact match: the Search-R1 reward (Jin et al. 2025) verl scores its
``searchR1_*`` data sources with."""

from __future__ import annotations

import re
import string

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_qa_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no ASCII punctuation, no articles, single
    spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def qa_targets(ground_truth) -> list[str]:
    """The accepted answers: a str, a list of str, or verl's ``{"target": str | list}``."""
    if isinstance(ground_truth, dict):
        if "target" not in ground_truth:
            raise ValueError(
                f"ground_truth: expected {{'target': answers}}, got keys {sorted(ground_truth)}"
            )
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, str):
        return [ground_truth]
    return [str(t) for t in ground_truth]


def search_r1_exact_match(data_source: str, solution_str: str, ground_truth, extra_info) -> float:
    """1.0 when the last ``<answer>...</answer>`` equals one of the accepted answers after
    normalisation (0.25 if the response also has more than 10 opening or closing answer tags,
    against tag spamming), else 0.0."""
    found = _ANSWER_TAG.findall(solution_str)
    if not found:
        return 0.0
    answer = normalize_qa_answer(found[-1].strip())
    if not any(normalize_qa_answer(t) == answer for t in qa_targets(ground_truth)):
        return 0.0
    spammed = solution_str.count("<answer>") > 10 or solution_str.count("</answer>") > 10
    return 0.25 if spammed else 1.0
