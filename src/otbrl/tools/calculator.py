"""The built-in ``calculator`` tool: exact arithmetic over a small grammar, no ``eval``.

Grammar (whitespace ignored)::

    expr   := term (("+" | "-") term)*
    term   := unary (("*" | "/" | "//" | "%") unary)*
    unary  := ("+" | "-") unary | power
    power  := atom ("^" unary)?            # right-associative; "**" is accepted for "^"
    atom   := number | "(" expr ")"
    number := digits ["." digits] | "." digits

Values are exact rationals (``fractions.Fraction``), so ``1234*56`` is ``69104`` and ``1/3*3`` is
``1``. Limits keep a hostile input cheap: at most ``MAX_CHARS`` characters, ``MAX_DEPTH``
nested parentheses/unary signs, integer exponents with ``|e| <= MAX_EXPONENT`` and results of at
most ``MAX_DIGITS`` digits. Anything else raises ``ValueError`` (or ``ZeroDivisionError``), which
the agent loop turns into an error observation.
"""

from __future__ import annotations

import contextlib
import re
from fractions import Fraction

MAX_CHARS = 200
MAX_DEPTH = 32
MAX_EXPONENT = 64
MAX_DIGITS = 60
DECIMALS = 6  # non-integer results: rounded to this many decimals
_TOKEN = re.compile(r"\s*(?:(\d+\.\d*|\.\d+|\d+)|(\*\*|//|[-+*/%^()]))")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result as text.

    Args:
        expression: numbers with + - * / // % ^ and parentheses, e.g. "1234*56" or "(2+3)^2/4".
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression: expected a str, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise ValueError(f"expression: longer than {MAX_CHARS} characters")
    value = _Parser(_tokens(expression)).parse()
    return format_number(value)


def format_number(value: Fraction) -> str:
    """An exact integer as is; any other rational rounded to ``DECIMALS`` decimals."""
    if value.denominator == 1:
        return str(value.numerator)
    rounded = round(value, DECIMALS)
    text = f"{float(rounded):.{DECIMALS}f}" if abs(rounded) < 1e15 else str(float(rounded))
    return text.rstrip("0").rstrip(".") if "." in text else text


def _tokens(text: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"expression: unexpected character {text[pos:].lstrip()[0]!r}")
        tokens.append(match.group(1) or ("^" if match.group(2) == "**" else match.group(2)))
        pos = match.end()
    if not tokens:
        raise ValueError("expression: empty")
    return tokens


class _Parser:
    """Recursive descent over the token list; one method per grammar rule."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def parse(self) -> Fraction:
        value = self.expr()
        if self.pos != len(self.tokens):
            raise ValueError(f"expression: unexpected {self.tokens[self.pos]!r}")
        return value

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ValueError("expression: ends too early")
        self.pos += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
            _check_size(value)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op, right = self.take(), self.unary()
            if op == "*":
                value = value * right
            elif right == 0:
                raise ZeroDivisionError("division by zero")
            elif op == "/":
                value = value / right
            elif op == "//":
                value = Fraction(value // right)
            else:
                value = value % right
            _check_size(value)
        return value

    def unary(self) -> Fraction:
        if self.peek() in ("+", "-"):
            sign = self.take()
            with self._nested():
                value = self.unary()
            return -value if sign == "-" else value
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() != "^":
            return base
        self.take()
        with self._nested():
            exponent = self.unary()
        if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
            raise ValueError(f"expression: exponents must be integers with |e| <= {MAX_EXPONENT}")
        if base == 0 and exponent < 0:
            raise ZeroDivisionError("zero to a negative power")
        value = base ** int(exponent)
        _check_size(value)
        return value

    def atom(self) -> Fraction:
        token = self.take()
        if token == "(":
            with self._nested():
                value = self.expr()
            if self.take() != ")":
                raise ValueError("expression: missing ')'")
            return value
        if token[0].isdigit() or token[0] == ".":
            return Fraction(token)
        raise ValueError(f"expression: unexpected {token!r}")

    @contextlib.contextmanager
    def _nested(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ValueError(f"expression: nested deeper than {MAX_DEPTH}")
        try:
            yield
        finally:
            self.depth -= 1


def _check_size(value: Fraction) -> None:
    # Limits the work of every later operation too: a 60-digit numerator is still cheap.
    if len(str(abs(value.numerator))) > MAX_DIGITS or len(str(value.denominator)) > MAX_DIGITS:
        raise ValueError(f"expression: result has more than {MAX_DIGITS} digits")
