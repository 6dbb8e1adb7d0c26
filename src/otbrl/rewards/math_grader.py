"""The PRM800K answer grader (Lightman et al. 2023) and the numeric / symbolic fallback that
verl's ``prime_math`` (``numina_*`` sources) adds to it; also geometry3k's reward.

``grade_answer(given, truth)``: equal after the MATH normalisation, or after PRM800K's own
normalisation (units, ``\\text{}``, LaTeX to text, mixed numbers, case), or element-wise equal
under ``sympy.simplify`` (integers and fractions must match as written). ``math_equal`` then
tries numbers (with a relative tolerance and the ×100 / ÷100 percentage readings), intervals,
tuples, matrices and symbolic equality.

Safety: the original graders hand model-written text to ``eval`` and to sympy's ``parse_expr``
(which evaluates Python): a response could run code in the trainer. Here numbers are
evaluated by a small arithmetic interpreter over the AST, and text reaches ``parse_expr``
only when every name in it is a symbol or a sympy function (``safe_sympy_text``); anything else
is treated as unparsable, as the originals treat text they cannot parse.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import keyword
import operator
import re
import tokenize

from otbrl.rewards.math_answers import hendrycks_strip

# -- safe evaluation ---------------------------------------------------------------------------

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def safe_arithmetic(text: str):
    """The value of ``text`` when it is plain arithmetic on numbers (``+ - * / // % **``,
    parentheses, lists and tuples of such); ``ValueError`` otherwise. Exponents are capped at
    1000 so that ``9**9**9`` cannot hang the trainer."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float, complex):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 1000:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Tuple):
            return tuple(value(e) for e in node.elts)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"not arithmetic: {e}") from None
    return value(tree.body)


_SYMPY_DENY = {
    "sympify",
    "parse_expr",
    "lambdify",
    "var",
    "symbols",
    "Symbol",
    "evaluate",
    "init_printing",
    "init_session",
    "preview",
    "srepr",
    "python",
}
_SYMPY_MODULES = (
    "sympy.core",
    "sympy.functions",
    "sympy.sets",
    "sympy.matrices",
    "sympy.geometry",
    "sympy.polys",
    "sympy.simplify",
    "sympy.ntheory",
    "sympy.concrete",
    "sympy.integrals",
    "sympy.series",
    "sympy.logic",
)


def _allowed_name(name: str) -> bool:
    import sympy

    if "__" in name or name in _SYMPY_DENY or keyword.iskeyword(name):
        return False
    if hasattr(builtins, name):
        return name in ("abs", "max", "min", "round", "pow", "int", "float", "complex")
    obj = getattr(sympy, name, None)
    if obj is None:
        return True  # becomes a Symbol
    return not callable(obj) or getattr(obj, "__module__", "").startswith(_SYMPY_MODULES)


def safe_sympy_text(text: str) -> bool:
    """True when ``text`` can go to sympy's ``parse_expr`` without running anything but
    sympy arithmetic: no strings, attribute access, lambdas, statements, and only names that
    are symbols or sympy's mathematical functions and constants."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return False
    previous = None
    for tok in tokens:
        if tok.type == tokenize.STRING or tok.string in (":", ";", "@", "`", "!", "="):
            return False
        if tok.type == tokenize.NAME and (previous == "." or not _allowed_name(tok.string)):
            return False
        if tok.type == tokenize.ERRORTOKEN and not tok.string.isspace():
            return False
        previous = tok.string
    return True


def parse_expr(text: str, *, implicit: bool = False):
    """sympy's ``parse_expr`` (its standard transformations, plus implicit multiplication
    with ``implicit``) on text ``safe_sympy_text`` accepts; ``ValueError`` for the rest."""
    from sympy.parsing import sympy_parser

    if not safe_sympy_text(text):
        raise ValueError("not a plain expression")
    transformations = sympy_parser.standard_transformations
    if implicit:
        transformations += (sympy_parser.implicit_multiplication_application,)
    return sympy_parser.parse_expr(text, transformations=transformations)


# -- PRM800K normalisation and grading ---------------------------------------------------------


def mathd_normalize(answer: str | None, *, plain_percent: bool = False) -> str | None:
    """The MATH normalisation after unwrapping an enclosing ``\\text{}``; the unwrapped answer
    when the normalisation fails."""
    if answer is None:
        return None
    answer = answer.strip()
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
    if m is not None:
        answer = m.group("text").strip()
    try:
        return hendrycks_strip(answer, plain_percent=plain_percent)
    except (ValueError, IndexError):
        return answer


_UNITS = (
    "degree",
    "cm",
    "centimeter",
    "meter",
    "mile",
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "month",
    "year",
    "foot",
    "feet",
    "inch",
    "yard",
    "liter",
)


def _is_int_value(x: float) -> bool:
    try:
        return abs(x - round(x)) <= 1e-7
    except (OverflowError, ValueError):
        return False


def _drop_thousands_commas(text: str) -> str:
    """``1,234,567`` -> ``1234567``; tuple commas (``(1,2)``) stay."""
    pattern = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
    while True:
        new = pattern.sub(r"\1\3\4", text)
        if new == text:
            return new
        text = new


def _str_is_int(text: str) -> bool:
    try:
        return _is_int_value(float(_drop_thousands_commas(text)))
    except ValueError:
        return False


def _latex_to_text(expr: str) -> str:
    from pylatexenc import latex2text

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # keeps a mixed number "3\frac12" apart
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for old, new in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(old, new)
    return expr.strip()


def prm800k_normalize(expr: str | None, *, mathruler: bool = False) -> str | None:
    """PRM800K's answer normalisation. ``mathruler``: the dialect of the ``mathruler`` package
    (geometry3k's grader): no ``liter`` unit, and spaces and braces dropped at the end."""
    if expr is None:
        return None
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if m is not None:
        expr = m.group("text")
    for old, new in (
        ("\\%", "%"),
        ("\\$", "$"),
        ("$", ""),
        ("%", ""),
        (" or ", " , "),
        (" and ", " , "),
        ("million", "*10^6"),
        ("billion", "*10^9"),
        ("trillion", "*10^12"),
    ):
        expr = expr.replace(old, new)
    for unit in _UNITS[:-1] if mathruler else _UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    try:
        if _is_int_value(float(expr)):
            expr = str(round(float(expr)))
    except ValueError:
        pass
    if "\\" in expr:
        # pylatexenc raises assorted errors on broken TeX: keep the text as written
        with contextlib.suppress(Exception):
            expr = _latex_to_text(expr)
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", "\\1+\\2", expr)  # a mixed number "7 3/4" -> "7+3/4"
    if mathruler:
        expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _sympy_equal(truth: str, given: str) -> bool:
    """``simplify(truth - given) == 0``, only for short expressions of at most two unknowns
    (longer ones can hang sympy); False when sympy cannot parse them."""
    import sympy

    expr = f"({truth})-({given})"
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr:
        return False
    if re.search(r"\^[0-9]+\^", expr) or re.search(r"\^[0-9][0-9]+", expr):
        return False
    try:
        return sympy.simplify(parse_expr(expr.replace("^", "**"), implicit=True)) == 0
    except Exception:  # sympy raises many types on text that is not an expression
        return False


def _split_tuple(expr: str) -> list[str]:
    expr = _drop_thousands_commas(expr)
    if not expr:
        return []
    brackets = "()[]"
    if (
        len(expr) > 2
        and expr[0] in brackets
        and expr[-1] in brackets
        and not any(ch in expr[1:-1] for ch in brackets)
    ):
        return [elem.strip() for elem in expr[1:-1].split(",")]
    return [expr]


def _is_fraction(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def grade_answer(given: str | None, truth: str, *, mathruler: bool = False) -> bool:
    """PRM800K's grader: is ``given`` the same answer as ``truth``? (see the module doc)."""
    if given is None:
        return False
    if mathd_normalize(truth, plain_percent=mathruler) == mathd_normalize(
        given, plain_percent=mathruler
    ):
        return True
    truth_n = prm800k_normalize(truth, mathruler=mathruler)
    given_n = prm800k_normalize(given, mathruler=mathruler)
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truth_elems, given_elems = _split_tuple(truth_n), _split_tuple(given_n)
    if len(truth_elems) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
        return False  # brackets differ: (a, b) is not [a, b]
    if len(truth_elems) != len(given_elems):
        return False
    for t, g in zip(truth_elems, given_elems):
        if _is_fraction(t) and _is_fraction(g):
            ok = t == g  # an unreduced fraction is not the answer
        elif _str_is_int(t) != _str_is_int(g):
            ok = False  # an integer answer must be given as one
        else:
            ok = _sympy_equal(t, g)
        if not ok:
            return False
    return True
