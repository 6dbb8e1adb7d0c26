"""Rows in verl's schema are scored by their data_source without a reward.function, checked
before any model loads; model text never runs in the math graders."""

import sys

import pytest

from otbrl.config import ConfigError, load_config
from otbrl.data import get_task, normalize_ground_truth, write_parquet_rows
from otbrl.rewards import compute_score, score_responses
from otbrl.rewards.math_grader import safe_arithmetic, safe_sympy_text
from otbrl.run import plan as plan_mod
from otbrl.run.plan import plan_run

CODE_TRUTH = '{"inputs": ["2\\n", "3\\n"], "outputs": ["4\\n", "6\\n"]}'
VERL_ROWS = [  # (data_source, ground truth as stored, a right response, a wrong one)
    ("math_dapo", "34", "Answer: 34", "Answer: 35"),
    ("aime2024", "7", "so\nAnswer: 7", "Answer: 8"),
    ("lighteval/MATH", "\\frac{1}{2}", "\\boxed{\\dfrac12}", "\\boxed{2}"),
    ("numina_cn_k12", "\\frac{1}{2}", "The answer is \\boxed{0.5}", "\\boxed{0.6}"),
    ("hiyouga/geometry3k", "3", "<think>.</think>\\boxed{3}", "<think>.</think>\\boxed{4}"),
    (
        "searchR1_nq",
        {"target": ["Paris", "paris, france"]},
        "<answer>the Paris</answer>",
        "<answer>Lyon</answer>",
    ),
    ("apps", CODE_TRUTH, "```python\nprint(int(input())*2)\n```", "```python\nprint(4)\n```"),
]


def _rows():
    base = get_task("arithmetic").rows("train", 1, seed=0)[0]
    return [
        {**base, "data_source": s, "reward_model": {"ground_truth": t}, "extra_info": {"i": i}}
        for i, (s, t, _, _) in enumerate(VERL_ROWS)
    ]


def _files(tmp_path) -> str:
    """The rows in two parquet files (a column has one type: Search-R1's dict ground truths
    live in a file of their own, as in verl's data)."""
    rows = _rows()
    qa = [r for r in rows if isinstance(r["reward_model"]["ground_truth"], dict)]
    rest = [r for r in rows if r not in qa]
    first = write_parquet_rows(rest * 5, tmp_path / "verl.parquet")
    second = write_parquet_rows(qa * 5, tmp_path / "search.parquet")
    return f"data.train_files=[{first},{second}]"


def test_verl_rows_validate_and_score_by_data_source(tiny_run, tmp_path, monkeypatch):
    monkeypatch.setattr(plan_mod, "sandbox_problem", lambda: None)
    overrides = tiny_run(tmp_path / "run")
    cfg = load_config(None, [*overrides, _files(tmp_path), "data.train_batch_size=4"])
    loaded = plan_run(cfg).train_rows
    rows = sorted(
        {r["extra_info"]["i"]: r for r in loaded}.values(), key=lambda r: r["extra_info"]["i"]
    )
    assert rows[5]["reward_model"]["ground_truth"] == ["Paris", "paris, france"]
    right = [r for _, _, r, _ in VERL_ROWS]
    wrong = [w for _, _, _, w in VERL_ROWS]
    scores, info = score_responses(right + wrong, rows + rows)
    assert scores[: len(rows)] == [1.0] * len(rows)
    # DAPO scores a wrong answer -1; geometry3k keeps its 0.1 for the format; code: 1 of 2
    assert scores[len(rows) :] == [-1.0, -1.0, 0.0, 0.0, 0.1, 0.0, 0.5]
    # dapo_math's dict entries become metrics: acc is the mean over the 4 dapo samples
    assert info["reward/acc"] == 0.5 and info["reward/sandbox_violations"] == 0.0


def test_code_rows_without_a_sandbox_are_refused_before_loading(tiny_run, tmp_path, monkeypatch):
    monkeypatch.setattr(plan_mod, "sandbox_problem", lambda: "no namespaces on this OS")
    overrides = tiny_run(tmp_path / "run")
    args = [*overrides, _files(tmp_path), "data.train_batch_size=4"]
    with pytest.raises(ConfigError, match=r"5 rows .* no namespaces on this OS") as err:
        plan_run(load_config(None, args))
    assert err.value.key == "reward.code.allow_unsandboxed"
    plan = plan_run(load_config(None, [*args, "reward.code.allow_unsandboxed=true"]))
    # allowed: said once, at the start of the run (the plan's notes)
    warned = [n for n in plan.notes if "UNSANDBOXED" in n]
    assert len(warned) == 1 and "5 rows" in warned[0] and "no namespaces on this OS" in warned[0]


def test_math_verify_backend_needs_its_package(tiny_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails
    overrides = tiny_run(tmp_path / "run")
    with pytest.raises(ConfigError, match="math-verify") as err:
        plan_run(load_config(None, [*overrides, "reward.math_backend=math_verify"]))
    assert err.value.key == "reward.math_backend"
    with pytest.raises(ConfigError, match=r"'reward\.math_backend' must be one of"):
        load_config(None, [*overrides, "reward.math_backend=sympy"])


def test_search_r1_ground_truth_and_bad_dicts():
    assert normalize_ground_truth({"target": ["a", 1.0]}) == ["a", "1"]
    with pytest.raises(ValueError, match="must be a str, a number or a list"):
        normalize_ground_truth({"answer": "a"}, "row 3")
    assert compute_score("searchR1_nq", "<answer>A</answer>", {"target": "a"}) == 1.0


def test_model_text_is_never_executed(tmp_path):
    """verl's graders eval() and sympify model text; here such text is just a wrong answer."""
    marker = tmp_path / "ran"
    payloads = [
        f"__import__('pathlib').Path('{marker}').touch()",
        f"exec(bytes([{','.join(str(b) for b in f'open({str(marker)!r},chr(119))'.encode())}]))",
        f"(lambda: open('{marker}', 'w'))()",
    ]
    for payload in payloads:
        for truth in ("2", "\\pi", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"):
            for text in (f"\\boxed{{{payload}}}", f"\\boxed{{{payload}\\pi}}", f"[{payload}]"):
                assert compute_score("numina_olympiads", text, truth) == 0.0
                assert compute_score("hiyouga/geometry3k", text, truth) == 0.0
        assert not safe_sympy_text(payload)
    assert not marker.exists()
    assert safe_sympy_text("2*sqrt(x) + pi") and safe_arithmetic("[1, 2**3, -4/2]") == [1, 8, -2.0]
    with pytest.raises(ValueError, match="exponent"):
        safe_arithmetic("9**9**9")


def test_a_huge_return_value_is_not_parsed_in_the_trainer(monkeypatch):
    """A program's ``repr`` comes back to the trainer's process: megabytes of it were parsed
    with ``ast.literal_eval`` (3 MB: 3 s, 1 GB). One far longer than the expected value cannot
    match it and is refused unparsed; a matching one still is parsed and matches."""
    import ast

    from otbrl.rewards import code as code_mod

    parsed = []
    real = ast.literal_eval
    monkeypatch.setattr(code_mod.ast, "literal_eval", lambda s: parsed.append(len(s)) or real(s))
    assert not code_mod.call_output_matches("[" + "1, " * 1_000_000 + "1]", "[1, 2, 3]")
    assert parsed == []
    assert code_mod.call_output_matches("(1, 2, 3)", "[1, 2, 3]") and parsed == [9]
    assert code_mod.call_output_matches("{1: 'é'}", '{"1": "\\u00e9"}')
