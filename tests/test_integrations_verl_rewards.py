"""verl's own reward functions still give the stored scores (runs in .venv-verl; skips
without verl). ``test_rewards_verl_parity.py`` compares otbrl with the same file."""

import json
import sys
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
    changed = []
    for case in (c for c in CASES if c["family"] == family):
        now = generator.verl_score(
            family, case["data_source"], case["solution_str"], case["ground_truth"]
        )
        if now != case["verl"]:
            changed.append((case["data_source"], case["solution_str"][:60], case["verl"], now))
    assert not changed, changed
