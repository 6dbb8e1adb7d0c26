"""verl's own reward functions still give the stored scores (runs in .venv-verl; skips
without verl). ``test_rewards_verl_parity.py`` compares otbrl with the same file."""

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("mathruler")  # verl's geometry3k scorer imports it
pytest.importorskip("math_verify")

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(DATA))
import make_verl_reward_cases as generator  # noqa: E402

CASES = json.loads((DATA / "verl_reward_cases.json").read_text())


def test_stored_cases_are_the_generators():
    """The file holds exactly the cases the generator defines (no hand edits)."""
    defined = [(f, e[0]) for f, (_, entries) in generator.FAMILIES.items() for e in entries]
    assert [(c["family"], c["solution_str"]) for c in CASES] == defined


@pytest.mark.parametrize("family", sorted({c["family"] for c in CASES}))
def test_verl_gives_the_stored_scores(family):
    cases = [c for c in CASES if c["family"] == family]

    def now(case):
        return generator.verl_score(
            family, case["data_source"], case["solution_str"], case["ground_truth"]
        )

    # verl's code checks mostly wait on their child processes: four at a time
    with ThreadPoolExecutor(max_workers=4 if family == "code" else 1) as pool:
        scores = list(pool.map(now, cases))
    changed = [
        (c["data_source"], c["solution_str"][:60], c["verl"], s)
        for c, s in zip(cases, scores)
        if s != c["verl"]
    ]
    assert not changed, changed
