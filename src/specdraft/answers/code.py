"""The code variant's verifier source: the examples a HumanEval docstring gives, turned into assertions.

Only what the prompt shows is used (`>>> call` followed by its output, or `call ==> result` / `call == result`
/ `call ➞ result` / `call -> result` / `call should return result`); the dataset's hidden tests are the grader,
never the verifier. Examples whose expected value is not a Python literal are skipped.
"""

from __future__ import annotations

import ast
import doctest
import re

_HARNESS = '''
import ast as _ast, math as _math

def _same(got, want):
    if isinstance(want, float) or isinstance(got, float):
        try:
            return _math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
        except TypeError:
            return False
    return got == want
'''


def _literal(text: str) -> bool:
    try:
        ast.literal_eval(text.strip())
        return True
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False


def _expression(text: str) -> bool:
    try:
        ast.parse(text.strip(), mode="eval")
        return True
    except SyntaxError:
        return False


def docstring_examples(prompt: str, entry_point: str) -> list[tuple[str, str]]:
    """(call, expected literal) pairs shown in the prompt for `entry_point`."""
    examples: list[tuple[str, str]] = []
    for example in doctest.DocTestParser().get_examples(prompt):
        call = example.source.strip()
        want_lines = []
        for line in example.want.splitlines():  # the docstring's closing quotes end the expected output
            if line.strip().startswith(('"""', "'''")):
                break
            want_lines.append(line)
        want = "\n".join(want_lines).strip()
        if entry_point in call and _expression(call) and _literal(want):
            examples.append((ast.unparse(ast.parse(call, mode="eval")), want))
    if examples:
        return examples
    arrow = re.compile(rf"({re.escape(entry_point)}\(.*\))\s*(?:==>|=>|==|➞|->|should return|returns?|→)\s*(.+)$")
    for line in prompt.splitlines():
        match = arrow.search(line.strip())
        if match:
            call, want = match.group(1), match.group(2).strip().rstrip(".,;")
            if _expression(call) and _literal(want):
                examples.append((ast.unparse(ast.parse(call, mode="eval")), want))
    return examples


def docstring_tests(prompt: str, entry_point: str) -> str:
    """Test code asserting each docstring example; empty when the docstring has none."""
    examples = docstring_examples(prompt, entry_point)
    if not examples:
        return ""
    lines = [_HARNESS]
    for call, want in examples:
        lines.append(f"assert _same({call}, {want}), {('docstring example failed: ' + call)!r}")
    return "\n".join(lines) + "\n"
