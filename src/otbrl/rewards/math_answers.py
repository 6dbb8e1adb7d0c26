"""Answer extraction and string normalisation of the MATH-style scorers verl users rely on.

Three conventions, each reproduced to the score (``tests/data/verl_reward_cases.json``):

* ``hendrycks_math``: the answer in the response's last ``\\boxed{}`` (or ``\\fbox{}``)
  compared with the ground truth after the MATH release's string normalisation (Hendrycks et
  al. 2021): verl's ``math_reward`` for ``lighteval/MATH`` and MATH-500. 1.0 or 0.0.
* ``dapo_math``: the text after the last ``Answer:`` normalised as in Minerva (Lewkowycz et al.
  2022, appendix D), falling back to a verbatim ``\\boxed{}`` near the end; +1 / -1 as DAPO
  trains with, plus ``acc`` and ``pred`` (verl's ``math_dapo``).
* ``hendrycks_strip``: the normalisation itself, shared with the PRM800K grader
  (``otbrl.rewards.math_grader``), in the dialects the two copies of it in the wild differ by.
"""

from __future__ import annotations

import re


def last_boxed(text: str, *, commands: tuple[str, ...] = ("\\boxed", "\\fbox")) -> str | None:
    """The last ``\\boxed{...}`` of ``text`` including the command and its braces, or None.

    The command searched is the first of ``commands`` found at all (``\\fbox`` only when there
    is no ``\\boxed``); its group ends where the brace depth first returns to zero. A
    ``\\boxed `` followed by a space (``\\boxed 5``) is handled by ``boxed_content``'s callers.
    """
    start = -1
    for command in commands:
        start = text.rfind(command)
        if start >= 0:
            break
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def _hendrycks_boxed_answer(text: str) -> str | None:
    """The boxed answer as the MATH release extracts it; ``ValueError`` for a box it cannot
    unwrap (an ``\\fbox{}``), which its scorer counts as wrong."""
    if "\\boxed " in text:  # "\boxed 5$": up to the next dollar sign
        return text.split("\\boxed ")[-1].split("$")[0]
    group = last_boxed(text)
    if group is None:
        return None
    if not (group.startswith("\\boxed{") and group.endswith("}")):
        raise ValueError(f"cannot unwrap {group!r}")
    return group[len("\\boxed{") : -1]


def _braced_fracs(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}``; a ``\\frac`` with
    one character after it leaves the whole string unchanged, one with none is an
    ``IndexError`` (the original's behaviour, which its callers rely on)."""
    head, *tails = text.split("\\frac")
    out = [head]
    for tail in tails:
        out.append("\\frac")
        if tail[0] == "{":
            out.append(tail)
            continue
        if len(tail) < 2:
            return text
        num, den, rest = tail[0], tail[1], tail[2:]
        out.append(f"{{{num}}}{{{den}}}{rest}" if den != "{" else f"{{{num}}}{den}{rest}")
    return "".join(out)


def _slash_to_frac(text: str) -> str:
    """``"3/4"`` (two plain integers) -> ``\\frac{3}{4}``; anything else unchanged."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        num, den = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    return f"\\frac{{{num}}}{{{den}}}" if text == f"{num}/{den}" else text


def _braced_sqrt(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (one character); ``IndexError`` on a bare trailing
    ``\\sqrt``, which the callers treat as "leave the answer as written"."""
    if "\\sqrt" not in text:
        return text
    head, *tails = text.split("\\sqrt")
    return head + "".join(
        "\\sqrt" + tail if tail[0] == "{" else "\\sqrt{" + tail[0] + "}" + tail[1:]
        for tail in tails
    )


def hendrycks_strip(text: str, *, plain_percent: bool = False) -> str:
    """The MATH release's answer normalisation (``\\dfrac`` -> ``\\frac``, no ``\\left``,
    degrees, units after ``\\text{ }``, ``.5`` -> ``0.5``, short ``x =`` prefixes, spaces...).

    ``plain_percent``: also drop a bare ``%`` (mathruler's copy) instead of only ``\\%``.
    Raises ``ValueError`` / ``IndexError`` where the original raised (two ``\\text{ }`` units,
    a bare trailing ``\\sqrt``): callers decide what that means.
    """
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        text = text.replace(old, new)
    if "\\text{ " in text:  # a unit: "\text{ cm}" and everything after it goes
        pieces = text.split("\\text{ ")
        if len(pieces) != 2:
            raise ValueError("more than one '\\text{ ' unit")
        text = pieces[0]
    if plain_percent:
        text = text.replace("\\%", "").replace("%", "")
    else:
        text = text.replace("\\\\%", "").replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> "5"
        text = sides[1]
    text = _braced_sqrt(text).replace(" ", "")
    text = _braced_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_to_frac(text)


def hendrycks_equal(answer: str, truth: str) -> bool:
    """The MATH release's equivalence: equal after ``hendrycks_strip``; where the
    normalisation fails on either, the raw strings are compared."""
    try:
        return hendrycks_strip(answer) == hendrycks_strip(truth)
    except (ValueError, IndexError):
        return answer == truth


def hendrycks_math(data_source: str, solution_str: str, ground_truth: str, extra_info) -> float:
    """1.0 when the response's last ``\\boxed{}`` answer equals the ground truth after the MATH
    normalisation, else 0.0 (also when there is no box, or one it cannot unwrap)."""
    try:
        answer = _hendrycks_boxed_answer(solution_str)
    except ValueError:
        return 0.0
    return float(answer is not None and hendrycks_equal(answer, ground_truth))


# Minerva's normalisation (Lewkowycz et al. 2022, appendix D): replacements, then words and
# TeX that carry no value. Order matters ("an " before "a ", "\text{and}" after ",\text{and}").
_MINERVA_REPLACE = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_MINERVA_DROP = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
_MINERVA_UNWRAP = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # keep the first $...$ only
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),  # \sqrt2 -> \sqrt{2}
)
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INVALID = "[INVALID]"  # what dapo_math predicts when the response states no answer


def minerva_normalize(answer: str) -> str:
    """A final answer normalised as Minerva does: the right-hand side of the last ``=``,
    units and filler words removed, ``$``/``\\text{}``/``\\boxed{}`` unwrapped, shorthand TeX
    braced, thousands separators dropped from plain integers."""
    answer = answer.split("=")[-1]
    for old, new in _MINERVA_REPLACE:
        answer = answer.replace(old, new)
    for word in _MINERVA_DROP:
        answer = answer.replace(word, "")
    for pattern, repl in _MINERVA_UNWRAP:
        answer = pattern.sub(repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_math(data_source: str, solution_str: str, ground_truth: str, extra_info) -> dict:
    """DAPO's math reward: ``{"score": 1.0 | -1.0, "acc": bool, "pred": str | None}``.

    Only the last 300 characters count. The prediction is the last ``Answer: ...`` line
    (Minerva-normalised, compared with the normalised ground truth); without one, the last
    ``\\boxed{}`` in the final 100 characters, compared verbatim.
    """
    tail = solution_str[-300:]
    lines = _ANSWER_LINE.findall(tail)
    pred = minerva_normalize(lines[-1] if lines else INVALID)
    correct = pred == minerva_normalize(ground_truth)
    if pred == INVALID:
        group = last_boxed(tail[-100:], commands=("\\boxed{",))
        if group is not None:
            pred = group[len("\\boxed{") : -1]
            correct = pred == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
