"""A safe arithmetic evaluator (a recursive-descent parser over exact fractions; never `eval`) and the
calculator verifier's check of claims such as "17 * 23 = 391" or "15% of 80 = 12".

Grammar:  expr   := term (("+" | "-") term)*
          term   := power (("*" | "×" | "/" | "÷") power)*
          power  := unary ("^" | "**") power | unary          (right-associative, integer exponents <= 64)
          unary  := ("-" | "+") unary | atom
          atom   := number ["%"] | "(" expr ")" | number "%" "of" atom
Numbers take thousands separators and decimals ("1,250.5"). Anything else is rejected with a reason.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_EXPONENT = 64
MAX_DIGITS = 1000
_TOKEN = re.compile(r"\s*(?:(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)|(\*\*|of\b|[-+*/^()%×÷]))")


class CalculatorError(ValueError):
    """The input is not arithmetic this calculator accepts."""


def _tokens(text: str) -> list[str]:
    tokens, pos = [], 0
    text = text.strip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match:
            raise CalculatorError(f"unexpected {text[pos:].strip()[:12]!r}: only numbers, + - * / ^ % ( ) and "
                                  f"'of' are allowed")
        tokens.append(match.group(1) or match.group(2))
        pos = match.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]):
        self.tokens, self.i = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, *expected: str) -> str:
        token = self.peek()
        if token is None or (expected and token not in expected):
            raise CalculatorError(f"expected {' or '.join(expected) or 'more input'}, got {token or 'the end'}")
        self.i += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> Fraction:
        value = self.power()
        while self.peek() in ("*", "×", "/", "÷"):
            op = self.take()
            right = self.power()
            if op in ("/", "÷"):
                if right == 0:
                    raise CalculatorError("division by zero")
                value = value / right
            else:
                value = value * right
        return value

    def power(self) -> Fraction:
        base = self.unary()
        if self.peek() in ("^", "**"):
            self.take()
            exponent = self.power()
            if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
                raise CalculatorError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
            if base == 0 and exponent < 0:
                raise CalculatorError("division by zero")
            return base ** int(exponent)
        return base

    def unary(self) -> Fraction:
        if self.peek() in ("-", "+"):
            return -self.unary() if self.take() == "-" else self.unary()
        return self.atom()

    def atom(self) -> Fraction:
        token = self.take()
        if token == "(":
            value = self.expr()
            self.take(")")
        elif token[0].isdigit() or token[0] == ".":
            if len(token) > MAX_DIGITS:
                raise CalculatorError("number too long")
            value = Fraction(token.replace(",", ""))
        else:
            raise CalculatorError(f"unexpected {token!r}")
        if self.peek() == "%":
            self.take()
            value = value / 100
            if self.peek() == "of":
                self.take()
                value = value * self.unary()
        return value


def evaluate(text: str) -> Fraction:
    """The exact value of an arithmetic expression; CalculatorError for anything else."""
    tokens = _tokens(text)
    if not tokens:
        raise CalculatorError("empty expression")
    parser = _Parser(tokens)
    value = parser.expr()
    if parser.peek() is not None:
        raise CalculatorError(f"unexpected {parser.peek()!r} after a complete expression")
    return value


def _claimed(text: str) -> tuple[Fraction, int | None]:
    """A claimed result: its value and the decimals it was written with (None for exact)."""
    cleaned = re.sub(r"^[\s$€£]+|[\s.]+$", "", text)
    percent = cleaned.endswith("%")
    value = evaluate(cleaned[:-1] if percent else cleaned)
    decimals = re.search(r"\.(\d+)\s*%?$", cleaned)
    value = value / 100 if percent else value
    places = len(decimals.group(1)) + (2 if percent else 0) if decimals else None
    return value, places


def agrees(exact: Fraction, claimed: Fraction, places: int | None) -> bool:
    """Exact equality, or equality after rounding the exact value to the decimals the claim was written with."""
    if exact == claimed:
        return True
    return places is not None and round(exact, places) == claimed


def check_claim(answer: str, source: str = ""):
    """Verdict for "expression = result" in the answer, or for the answer as the result of the source's
    expression when the answer has no "="."""
    from .verifiers import Verdict

    if "=" in answer:
        expression, _, result = answer.rpartition("=")
        expression = expression.rstrip("=")
    else:
        expression, result = source, answer
    try:
        exact = evaluate(expression)
        claimed, places = _claimed(result)
    except CalculatorError as exc:
        return Verdict(False, f"not checkable arithmetic: {exc}")
    if agrees(exact, claimed, places):
        return Verdict(True, f"{expression.strip()} = {float(exact):g}")
    return Verdict(False, f"{expression.strip()} is {float(exact):g}, not {result.strip()}")
