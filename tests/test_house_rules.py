"""Who decides, read from the source: the run's build and its trainer read no raw configuration
(every decision is ``resolve``'s, in the ``RunSpec``), and no code outside ``otbrl.algos``
compares an estimator by its name (what the trainer acts on is a flag on the estimator's
registration: ``needs``, ``group_relative``, ``response_space``). A sibling of
``tests/test_imports.py``: the last rounds fixed both and later changes brought them back,
because nothing held the line."""

from __future__ import annotations

import ast
from pathlib import Path

from otbrl.algos.advantages import ESTIMATORS

SRC = Path(__file__).resolve().parents[1] / "src" / "otbrl"
# the modules that turn the spec into objects and follow it: no raw config in them
SPEC_FOLLOWERS = ("run/build.py", "run/trainer.py", "run/sources.py")


def _config_reads(path: Path) -> list[str]:
    """``cfg.<anything>`` and ``<anything>.cfg`` in ``path``, as ``line: text``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        on_cfg = isinstance(node.value, ast.Name) and node.value.id == "cfg"
        if on_cfg or node.attr == "cfg":
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_build_and_the_trainer_read_no_raw_config():
    reads = {name: _config_reads(SRC / name) for name in SPEC_FOLLOWERS}
    assert not any(reads.values()), (
        f"a decision read from the raw config (make it a RunSpec field set in resolve): {reads}"
    )


def _name_comparisons(path: Path, names: set[str]) -> list[str]:
    """Comparisons (``==``, ``!=``, ``in``, ``not in``) of anything with a string in ``names``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        consts = [
            c.value
            for operand in operands
            for c in ast.walk(operand)
            if isinstance(c, ast.Constant) and isinstance(c.value, str)
        ]
        if any(c in names for c in consts):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_estimator_is_compared_by_name_outside_algos():
    names = set(ESTIMATORS)
    found = [
        line
        for path in sorted(SRC.rglob("*.py"))
        if "algos" not in path.relative_to(SRC).parts
        for line in _name_comparisons(path, names)
    ]
    assert not found, (
        "an estimator compared by its name (declare the fact it stands for on its "
        f"registration, otbrl.algos.advantages.register_estimator): {found}"
    )


def test_the_checks_see_what_they_look_for(tmp_path):
    """Each check finds a planted offence: they are not vacuous."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def f(cfg, self):\n"
        "    a = cfg.trainer.seed\n"
        "    b = self.cfg\n"
        "    return a == 'grpo' or b in ('rloo',)\n"
    )
    assert len(_config_reads(planted)) == 2  # cfg.trainer(.seed), self.cfg
    assert len(_name_comparisons(planted, {"grpo", "rloo"})) == 2
