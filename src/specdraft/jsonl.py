"""JSON-lines files that runs append to, a record a line: the last line may be cut off by a kill mid-write."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import SpecdraftError


def read_jsonl(path: Path, fix: str) -> tuple[list, bool]:
    """(the records of `path`, whether its last line was cut off and left out); [] for a missing file. A cut line
    is the last one of a file that does not end with a newline (every record is written with its newline); any
    other line that is not JSON, or a file that is not UTF-8, is an error whose message ends with `fix`."""
    path = Path(path)
    if not path.exists():
        return [], False
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: a JSON string may hold U+2028
    except UnicodeDecodeError:
        raise SpecdraftError(f"{path} is not UTF-8 text; {fix}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):  # a newline follows: not a write cut off by a kill
                raise SpecdraftError(f"{path}: line {number} is not JSON; {fix}") from None
            return records, True
    return records, False


def rewrite_jsonl(path: Path, records: list) -> None:
    """Replace `path` by `records` whole (a new file, then a rename): never half a file."""
    partial = Path(path).with_suffix(".jsonl.tmp")
    partial.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    partial.replace(path)
