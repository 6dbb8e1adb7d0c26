"""Generate ``verl_reward_cases.json``: responses scored by verl's own reward functions.

Run in the verl environment (``.venv-verl``, with ``mathruler`` and ``math-verify``):

    .venv-verl/bin/python tests/data/make_verl_reward_cases.py

It imports nothing from otbrl. Each case is ``{family, data_source, solution_str,
ground_truth, verl}`` where ``verl`` is what ``verl.utils.reward_score.default_compute_score``
returned (the ``math_verify`` family: ``verl.utils.reward_score.math_verify.compute_score``);
a case where otbrl deliberately scores differently also carries ``otbrl`` and ``why`` (README,
"Rewards"). ``tests/test_rewards_verl_parity.py`` checks otbrl against the file;
``tests/test_integrations_verl_rewards.py`` re-runs verl on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("verl_reward_cases.json")

GSM8K = [
    ("Natalia sold 48 clips... #### 72", "72"),
    ("#### 72", "72"),
    ("#### 71", "72"),
    ("The answer is 72", "72"),
    ("#### 1,000", "1000"),
    ("#### -5", "-5"),
    ("#### 5 and later #### 6", "6"),
    ("#### 5 and later #### 6", "5"),
    ("", "72"),
    ("####", "72"),
    ("#### 7.5", "7.5"),
    ("步骤… 答案 #### 42", "42"),
    ("#### 42 🎉", "42"),
    ("x" * 400 + " #### 9", "9"),
    ("#### 0", "0"),
    ("#### 0.5", "0.5"),
    ("#### 3\n", "3"),
    ("#### 12 apples", "12"),
    ("#### 1,2,3", "123"),
    ("no marker 10", "10"),
    ("#### 10.", "10", 1.0, "a trailing period ends the sentence, not the number"),
    ("#### 72.0", "72", 1.0, "72.0 is the number 72"),
    ("####72", "72", 1.0, "the space after #### is not needed"),
    ("#### $12", "12", 1.0, "a dollar sign before the number is allowed"),
    (
        "#### 9 " + "y" * 400,
        "9",
        1.0,
        "the answer counts wherever it is, not only in the last 300 characters",
    ),
    ("#### 007", "7"),
    ("#### -0", "0", 1.0, "numbers are compared as numbers"),
    ("#### 1.50", "1.5", 1.0, "numbers are compared as numbers"),
    ("#### 2\n#### 3", "3"),
    ("#### 5", "five"),
]

MATH = [
    ("So the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{\\frac12}", "\\frac{1}{2}"),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{1/2}", "\\frac{1}{2}"),
    ("\\boxed{.5}", "0.5"),
    ("\\boxed{3}", "4"),
    ("no box here 3", "3"),
    ("", "3"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{10\\%}", "10"),
    ("\\boxed{90^\\circ}", "90"),
    ("\\boxed{5 \\text{ cm}}", "5"),
    ("\\boxed{\\left( 3, 4 \\right)}", "(3,4)"),
    ("\\boxed{\\sqrt2}", "\\sqrt{2}"),
    ("\\boxed 5$", "5"),
    ("\\boxed{5", "5"),
    ("\\fbox{5}", "5"),
    ("\\boxed{a} then \\boxed{b}", "b"),
    ("\\boxed{a} then \\boxed{b}", "a"),
    ("\\boxed{\\text{(A)}}", "\\text{(A)}"),
    ("\\boxed{π}", "\\pi"),
    ("\\boxed{\\pi}", "\\pi"),
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt3"),
    ("\\boxed{\\$5}", "5"),
    ("\\boxed{5 \\text{ cm} 3 \\text{ m}}", "5"),
    ("\\boxed{\\sqrt}", "\\sqrt"),
    ("\\boxed{\\frac1}", "\\frac{1}{}"),
    ("\\boxed{}", ""),
    ("\\boxed{k=3}", "3"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("答案是 \\boxed{7}", "7"),
]

DAPO = [
    ("Answer: 34", "34"),
    ("... so\nAnswer: 34\n", "34"),
    ("answer : 34", "34"),
    ("Answer: 35", "34"),
    ("Answer: $34$", "34"),
    ("Answer: \\boxed{34}", "34"),
    ("Answer: x = 34", "34"),
    ("Answer: 1,000", "1000"),
    ("Answer: 34 degrees", "34"),
    ("Answer: \\frac12", "\\frac{1}{2}"),
    ("Answer: \\text{yes}", "yes"),
    ("The result is \\boxed{34}", "34"),
    ("The result is \\boxed{34.0}", "34"),
    ("no answer", "34"),
    ("", "34"),
    ("Answer: 3\nAnswer: 4", "4"),
    ("Answer: 3\nAnswer: 4", "3"),
    ("x" * 400 + "Answer: 12", "12"),
    ("Answer: 12" + "x" * 400, "12"),
    ("\\boxed{12}" + " " * 150, "12"),
    ("Answer: an apple", "apple"),
    ("Answer: \\sqrt2", "\\sqrt{2}"),
    ("Answer: 5 cm", "5"),
    ("Answer: 答案", "答案"),
    ("Answer: [INVALID]", "7"),
    ("Answer:    ", "34"),
    ("ANSWER: 8", "8"),
    ("Answer: $\\$5$", "5"),
    ("Answer: 2, 3", "2,3"),
    ("Answer: \\overline{AB}", "AB"),
    ("Answer: 10^\\circ", "10"),
    ("Answer: \\textbf{7}", "7"),
]

PRIME_MATH = [
    ("The answer is \\boxed{0.5}", "\\frac{1}{2}"),
    ("The answer is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("The answer is \\boxed{2/4}", "\\frac{1}{2}"),
    ("So x = 3.", "3"),
    ("Therefore the answer is 12", "12"),
    ("answer: 7", "7"),
    ("\\boxed{3}", "4"),
    ("nothing", "4"),
    ("", "4"),
    ("\\boxed{(1, 2)}", "(1,2)"),
    ("\\boxed{[1, 2]}", "(1,2)"),
    ("\\boxed{1,000}", "1000"),
    ("\\boxed{2\\pi}", "2\\pi"),
    ("\\boxed{6.28}", "2\\pi"),
    ("\\boxed{6.2832}", "2\\pi"),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{50\\%}", "0.5"),
    ("\\boxed{50}", "0.5"),
    ("\\boxed{7 3/4}", "7\\frac{3}{4}"),
    ("\\boxed{5 \\text{ meters}}", "5"),
    ("\\boxed{\\text{Monday}}", "monday"),
    ("\\boxed{x \\in [2, 5)}", "[2,5)"),
    ("\\boxed{1, 2, 3}", "1, 2, 3"),
    ("\\boxed{3, 2, 1}", "1, 2, 3"),
    ("\\boxed{\\$12}", "12"),
    ("\\boxed{10_2}", "2"),
    (
        "\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}",
        "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
    ),
    ("\\boxed{1e3}", "1000"),
    ("\\boxed{∞}", "\\infty"),
    ("答案是 \\boxed{5}", "5"),
    ("\\boxed{3.0001}", "3"),
    ("\\boxed{2.00001}", "2.0"),
    ("\\boxed{a+b}", "b+a"),
    ("\\boxed{\\frac{3}{6}}", "\\frac{1}{2}"),
]

GEO3K = [
    ("<think>angles sum</think> \\boxed{30}", "30"),
    ("<think>x</think>\\boxed{30}", "31"),
    ("\\boxed{30}", "30"),
    ("<think>x</think> 30", "30"),
    ("", "30"),
    ("<think>x</think> \\boxed{\\frac{1}{2}}", "0.5"),
    ("<think>x</think> \\boxed{2\\sqrt{3}}", "2\\sqrt{3}"),
    ("<think>x</think> \\boxed{2 \\sqrt 3}", "2\\sqrt{3}"),
    ("<think>x</think> \\boxed{3.5}", "\\frac{7}{2}"),
    ("<think>x</think> \\boxed{10\\%}", "10"),
    ("<think>x</think> \\boxed{45^\\circ}", "45"),
    ("<think>x</think> \\boxed{12 cm}", "12"),
    ("<think></think>\\boxed{}", "5"),
    ("<think>a\nb</think>\n\\boxed{5}\nend", "5"),
    ("<think>x</think> \\boxed{5", "5"),
    ("<think>x</think> \\boxed{{5}}", "5"),
    ("<think>x</think> \\boxed{5} \\boxed{6}", "6"),
    ("<think>x</think> \\boxed{5} \\boxed{6}", "5"),
    ("<THINK>x</THINK> \\boxed{5}", "5"),
    ("<think>x</think> \\boxed{\\pi}", "\\pi"),
    ("<think>x</think> \\boxed{3.14}", "\\pi"),
    ("<think>x</think> \\boxed{(1,2)}", "(1, 2)"),
    ("<think>x</think> \\boxed{1/3}", "\\frac{1}{3}"),
    ("<think>x</think> \\boxed{2/6}", "\\frac{1}{3}"),
    ("<think>x</think> \\boxed{答案}", "答案"),
    ("<think>x</think> \\boxed{8\\sqrt{2}}", "8 \\sqrt { 2 }"),
    ("<think>x</think> \\boxed{A}", "a"),
    ("<think>x</think> \\boxed{x=4}", "4"),
    ("<think>x</think> \\boxed{1,000}", "1000"),
    ("<think>x</think> \\boxed{0.333}", "\\frac{1}{3}"),
]

SEARCH = [
    ("<answer>Paris</answer>", ["Paris"]),
    ("<answer> the Paris. </answer>", ["paris"]),
    ("<answer>Lyon</answer>", ["Paris"]),
    ("Paris", ["Paris"]),
    ("", ["Paris"]),
    ("<answer>London</answer><answer>Paris</answer>", ["Paris"]),
    ("<answer>Paris</answer><answer>London</answer>", ["Paris"]),
    ("<answer>Paris</answer>" + "</answer>" * 11, ["Paris"]),
    ("<answer>Lyon</answer>" + "</answer>" * 11, ["Paris"]),
    ("<answer>Paris", ["Paris"]),
    ("<answer>\nParis\n</answer>", ["Paris"]),
    ("<answer>Barack Obama</answer>", ["Obama", "Barack Obama"]),
    ("<answer>barack  obama</answer>", ["Barack Obama"]),
    ("<answer>Obama, Barack</answer>", ["Barack Obama"]),
    ("<answer>Zürich</answer>", ["zürich"]),
    ("<answer>東京</answer>", ["東京"]),
    ("<answer>An Apple</answer>", ["apple"]),
    ("<answer>the the</answer>", [""]),
    ("<answer></answer>", [""]),
    ("<answer>1,000</answer>", ["1000"]),
    ("<answer>1 000</answer>", ["1000"]),
    ("<answer>U.S.A.</answer>", ["usa"]),
    ("<answer>rock-and-roll</answer>", ["rock and roll"]),
    ("<answer>It is Paris</answer>", ["Paris"]),
    ("<ANSWER>Paris</ANSWER>", ["Paris"]),
    ("<answer>Paris</answer>" * 11, ["Paris"]),
    ("<answer>Paris</answer>" * 10, ["Paris"]),
    ("<answer>42</answer>", ["42"]),
    ("<answer>forty-two</answer>", ["42"]),
    ("<answer>\tNew\nYork </answer>", ["new york"]),
]

PRINT_DOUBLE = "```python\nn = int(input())\nprint(n * 2)\n```"
STDIN_CASES = json.dumps({"inputs": ["2\n", "3\n", "10\n"], "outputs": ["4\n", "6\n", "20\n"]})
ADD_CASES = json.dumps(
    {"fn_name": "add", "inputs": ["1\n2", "3\n4", "10\n-3"], "outputs": ["3", "7", "7"]}
)
PAIR_CASES = json.dumps({"fn_name": "pair", "inputs": ["1", "2"], "outputs": ["[1, 2]", "[2, 4]"]})
FLOAT_CASES = json.dumps({"inputs": ["1 3\n", "2 3\n"], "outputs": ["0.333333\n", "0.666667\n"]})
LINES_CASES = json.dumps({"inputs": ["3\n"], "outputs": ["1\n2\n3\n"]})
WORDS_CASES = json.dumps({"inputs": ["a b\n"], "outputs": ["b a\n"]})
CODE = [
    (PRINT_DOUBLE, STDIN_CASES),
    ("Here it is:\n" + PRINT_DOUBLE + "\nDone.", STDIN_CASES),
    ("```python\nn = int(input())\nprint(n * 2 if n != 10 else 0)\n```", STDIN_CASES),
    ("```python\nn = int(input())\nprint(n + n if n < 3 else n)\n```", STDIN_CASES),
    ("```python\nprint(int(input()) * 3)\n```", STDIN_CASES),
    ("```python\nimport sys\nfor line in sys.stdin:\n    print(int(line) * 2)\n```", STDIN_CASES),
    ("```python\nimport sys\nprint(int(sys.stdin.readline()) * 2)\n```", STDIN_CASES),
    ("```python\nimport sys\nprint(int(sys.stdin.read()) * 2)\n```", STDIN_CASES),
    (
        "```python\ndef main():\n    print(int(input()) * 2)\n\n"
        "if __name__ == '__main__':\n    main()\n```",
        STDIN_CASES,
    ),
    ("```python\nprint(sqrt(int(input()) ** 2 * 4))\n```", STDIN_CASES),
    ("```python\nprint(int(input()) * 2, end='')\n```", STDIN_CASES),
    ("```python\nprint('  ' + str(int(input()) * 2) + '  ')\n```", STDIN_CASES),
    ("```python\nprint(int(input()) * 2)\nprint()\n```", STDIN_CASES),
    ("```python\nprint(int(input()) * 2\n```", STDIN_CASES),
    ("```python\nraise ValueError('no')\n```", STDIN_CASES),
    ("```python\nx = int(input())\nprint(x * 2 if x < 5 else 1 / 0)\n```", STDIN_CASES),
    ("", STDIN_CASES),
    ("no code at all, just text", STDIN_CASES),
    (
        "```python\nprint('résumé ✓')\n```",
        json.dumps({"inputs": ["\n"], "outputs": ["résumé ✓\n"]}),
    ),
    ("```python\na, b = map(int, input().split())\nprint(f'{a / b:.6f}')\n```", FLOAT_CASES),
    ("```python\na, b = map(int, input().split())\nprint(a / b)\n```", FLOAT_CASES),
    ("```python\nfor i in range(1, int(input()) + 1):\n    print(i)\n```", LINES_CASES),
    ("```python\nprint(*range(1, int(input()) + 1))\n```", LINES_CASES),
    ("```python\nprint(' '.join(reversed(input().split())))\n```", WORDS_CASES),
    ("```python\nprint(' '.join(input().split()))\n```", WORDS_CASES),
    ("```python\ndef add(a, b):\n    return a + b\n```", ADD_CASES),
    ("```python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n```", ADD_CASES),
    ("```python\ndef add(a, b):\n    return [a + b]\n```", ADD_CASES),
    ("```python\ndef add(a, b):\n    return str(a + b)\n```", ADD_CASES),
    ("```python\ndef pair(x):\n    return (x, 2 * x)\n```", PAIR_CASES),
    ("```python\ndef pair(x):\n    return [x, 2 * x]\n```", PAIR_CASES),
    (
        "```python\ndef add(a, b):\n    return a + b if a < 5 else 0\n```",
        ADD_CASES,
        2 / 3,
        "a function with a wrong answer on some cases gets partial credit (verl drops fn_name "
        "when it retries the cases one by one, so every retry fails)",
    ),
    (
        "```python\nn = int(input())\nif n == 2:\n    print(4)\n    exit()\nprint(n * 2)\n```",
        STDIN_CASES,
        1.0,
        "exit() ends the program normally (verl sets builtins.exit to None, so the call raises)",
    ),
    (PRINT_DOUBLE, "not json"),
    (PRINT_DOUBLE, json.dumps({"inputs": ["2\n"]})),
    (PRINT_DOUBLE, json.dumps({"inputs": [], "outputs": []})),
]

FAMILIES = {
    "gsm8k": ("openai/gsm8k", GSM8K),
    "math": ("lighteval/MATH", MATH),
    "dapo": ("math_dapo", DAPO),
    "prime_math": ("numina_olympiads", PRIME_MATH),
    "geometry3k": ("hiyouga/geometry3k", GEO3K),
    "search_r1": ("searchR1_nq", SEARCH),
    "code": ("apps", CODE),
    "math_verify": ("lighteval/MATH", MATH),
}
# the other names of each scorer's sources, spread over the cases (the dispatch is checked too)
ALIASES = {
    "math": ["DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "lighteval/MATH"],
    "dapo": ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime_2025"],
    "prime_math": [
        "numina_aops_forum",
        "numina_synthetic_math",
        "numina_amc_aime",
        "numina_synthetic_amc",
        "numina_cn_k12",
        "numina_olympiads",
    ],
    "search_r1": [
        "searchR1_nq",
        "searchR1_triviaqa",
        "searchR1_popqa",
        "searchR1_hotpotqa",
        "searchR1_2wikimultihopqa",
        "searchR1_musique",
        "searchR1_bamboogle",
    ],
    "code": ["apps", "codecontests", "codeforces", "taco"],
}


def ground_truth_of(family: str, truth):
    """As the parquet rows carry it: Search-R1 wraps its answers in {"target": [...]}."""
    return {"target": truth} if family == "search_r1" else truth


def verl_score(family: str, data_source: str, solution: str, truth):
    """What verl returns for one response."""
    if family == "math_verify":
        from verl.utils.reward_score import math_verify

        return math_verify.compute_score(solution, truth)
    from verl.utils.reward_score import default_compute_score

    return default_compute_score(data_source, solution, truth)


def build_cases() -> list[dict]:
    """Every case with the score verl gives it now."""
    cases = []
    for family, (default_source, entries) in FAMILIES.items():
        names = ALIASES.get(family, [default_source])
        for i, entry in enumerate(entries):
            solution, truth, *different = entry
            source = names[i % len(names)]
            truth = ground_truth_of(family, truth)
            case = {
                "family": family,
                "data_source": source,
                "solution_str": solution,
                "ground_truth": truth,
                "verl": verl_score(family, source, solution, truth),
            }
            if different:
                case["otbrl"], case["why"] = different
            cases.append(case)
    return cases


def main() -> None:
    cases = build_cases()
    OUT.write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")
    counts = {f: sum(c["family"] == f for c in cases) for f in FAMILIES}
    print(f"wrote {len(cases)} cases to {OUT}: {counts}", file=sys.stderr)


if __name__ == "__main__":
    main()
