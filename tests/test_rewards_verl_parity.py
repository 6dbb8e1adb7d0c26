"""otbrl's built-in rewards against verl's own scores on stored cases.

``tests/data/verl_reward_cases.json`` was written by ``tests/data/make_verl_reward_cases.py``
in the verl environment (verl 0.9.1's functions, nothing from otbrl);
``test_integrations_verl_rewards.py`` re-runs verl on it there. A case where otbrl scores
differently on purpose carries ``otbrl`` and ``why`` (docs/rewards.md).
"""

import json
from collections import Counter
from pathlib import Path

import pytest

from otbrl.rewards import (
    DATA_SOURCE_REWARDS,
    compute_score,
    has_builtin_reward,
    sandbox_problem,
)

CASES = json.loads((Path(__file__).parent / "data" / "verl_reward_cases.json").read_text())
FAMILIES = sorted({c["family"] for c in CASES})


def _score(result):
    return result["score"] if isinstance(result, dict) else result


def test_every_family_has_enough_cases_and_outcomes():
    counts = Counter(c["family"] for c in CASES)
    assert set(counts) == {
        "gsm8k",
        "math",
        "dapo",
        "prime_math",
        "geometry3k",
        "search_r1",
        "code",
        "math_verify",
    }
    assert min(counts.values()) >= 30, counts
    for family in FAMILIES:  # right and wrong answers in every family, not one outcome
        outcomes = {_score(c["verl"]) for c in CASES if c["family"] == family}
        assert len(outcomes) >= 2, (family, outcomes)
    # every data source verl's default_compute_score knows is covered (aime* by two names)
    verl_sources = {s for s in DATA_SOURCE_REWARDS if not s.startswith("otbrl/")} - {"gsm8k"}
    sources = {c["data_source"] for c in CASES}
    assert verl_sources <= sources and {"aime2024", "aime_2025"} <= sources
    assert all(has_builtin_reward(s) for s in sources)


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_equal_verls(family):
    if family == "code" and sandbox_problem() is not None:
        pytest.skip(f"code rewards need the sandbox: {sandbox_problem()}")
    if family == "math_verify":
        pytest.importorskip("math_verify")
    backend = "math_verify" if family == "math_verify" else "verl"
    wrong = []
    for case in (c for c in CASES if c["family"] == family):
        got = compute_score(
            case["data_source"], case["solution_str"], case["ground_truth"], math_backend=backend
        )
        want = case.get("otbrl", case["verl"])
        # verl's math_dapo returns {"score", "acc", "pred"}: all three must agree
        same = got == want if isinstance(want, dict) else _score(got) == pytest.approx(want)
        if not same:
            wrong.append((case["data_source"], case["solution_str"][:60], want, got))
    assert not wrong, wrong


def test_deliberate_differences_are_differences():
    """Each documented difference really differs from verl, and says why."""
    different = [c for c in CASES if "otbrl" in c]
    assert different and all(c["why"] and c["otbrl"] != _score(c["verl"]) for c in different)
