"""The prompt suite: JSON lines of {question_id, category, turns: [user message, ...]}."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecdraftError

DEFAULT_PROMPTS = Path(__file__).resolve().parents[3] / "data" / "bench" / "prompts.jsonl"


def load_prompts(path: str | Path | None = None, categories: list[str] | None = None,
                 limit: int | None = None) -> list[dict]:
    """The prompts of `path` (default: the committed suite), in file order, optionally filtered to
    `categories` and to the first `limit` of each category."""
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise SpecdraftError(f"prompt file {path} not found; pass --prompts FILE (JSON lines with question_id, "
                             "category, turns) or rebuild the suite with scripts/build_bench_prompts.py")
    prompts = []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: JSON strings may hold U+2028
    except UnicodeDecodeError as error:
        raise SpecdraftError(f"{path} is not UTF-8 text (byte {error.start}); prompts are JSON lines") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecdraftError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        turns = row.get("turns") if isinstance(row, dict) else None
        if (not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns)
                or "question_id" not in row or not isinstance(row.get("category"), str)):
            raise SpecdraftError(f"{path}:{number}: each line needs question_id, category and turns "
                                 "(a non-empty list of non-empty user messages)")
        prompts.append({"question_id": str(row["question_id"]), "category": row["category"], "turns": turns})
    known = list(dict.fromkeys(p["category"] for p in prompts))
    if categories:
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise SpecdraftError(f"no prompts in category {', '.join(unknown)}; {path.name} has {', '.join(known)}")
        prompts = [p for p in prompts if p["category"] in categories]
    if limit is not None:
        if limit < 1:
            raise SpecdraftError(f"--limit must be >= 1, got {limit}")
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p["category"]] = seen.get(p["category"], 0) + 1
            if seen[p["category"]] <= limit:
                kept.append(p)
        prompts = kept
    if not prompts:
        raise SpecdraftError(f"no prompts selected from {path}")
    return prompts
