"""Verifiers: answer + source -> Verdict(ok, reason). One protocol, three checkers.

  grounded    the answer is a figure or a date that the source itself states (normalize.py)
  calculator  the answer states an arithmetic claim, "17 * 23 = 391", that a safe evaluator confirms
  unit-tests  the answer is code; the source is the tests to run against it, in a sandbox (sandbox.py)

A verifier never raises on a bad answer: a malformed answer is a rejected one, with the reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

from ..errors import SpecdraftError
from .normalize import find_values, supports


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


class Verifier(Protocol):
    name: str

    def verify(self, answer: str, source: str) -> Verdict:
        """Is `answer` confirmed by `source` (the article, the expression's context, the tests)?"""


class GroundedVerifier:
    """Every figure or date the answer states must be stated by the source (normalised: see normalize.py)."""

    name = "grounded"

    def verify(self, answer: str, source: str) -> Verdict:
        claims = find_values(answer)
        if not claims:
            return Verdict(False, "the answer states no figure or date")
        stated = find_values(source)
        found = []
        for claim in claims:
            match = next((m for m in stated if supports(m.value, claim.value)), None)
            if match is None:
                return Verdict(False, f"{claim.text!r} ({claim.value}) is not stated in the source")
            found.append(f"{claim.text!r} as {match.text!r}")
        return Verdict(True, "stated in the source: " + ", ".join(found))


class CalculatorVerifier:
    """The answer claims `expression = value` (or the source gives the expression and the answer the value);
    a parser evaluates the expression exactly, never `eval`."""

    name = "calculator"

    def verify(self, answer: str, source: str) -> Verdict:
        from .calculator import check_claim

        return check_claim(answer, source)


class UnitTestVerifier:
    """The answer is Python code; the source is test code run after it in a sandbox. Passes iff exit code 0."""

    name = "unit-tests"

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 1024):
        self.timeout_s, self.memory_mb = timeout_s, memory_mb

    def verify(self, answer: str, source: str) -> Verdict:
        from .sandbox import run_python

        if not source.strip():
            return Verdict(False, "no tests to run")
        result = run_python(answer + "\n\n" + source, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        if result.ok:
            return Verdict(True, f"tests passed in {result.wall_s:.2f}s")
        return Verdict(False, result.summary())


VERIFIERS = {"grounded": GroundedVerifier, "calculator": CalculatorVerifier, "unit-tests": UnitTestVerifier}


def build_verifier(name: str) -> Verifier:
    if name not in VERIFIERS:
        raise SpecdraftError(f"unknown verifier {name!r}; choose one of {', '.join(VERIFIERS)}")
    return VERIFIERS[name]()
