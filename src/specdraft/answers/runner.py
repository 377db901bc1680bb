"""The experiment: for each question, the small model answers greedily and N times by sampling (engine requests:
one prefill through the prefix cache, the samples decoded together), the large model answers greedily once; every
answer is verified and graded.
One JSON record per question is appended to OUT/records.jsonl as soon as it is done, so a run can be stopped
and resumed (same settings, same OUT); OUT/summary.json, OUT/report.md and OUT/accuracy_vs_n.png are computed
from the records alone (metrics.py).

Two tasks, told apart by the dataset's fields:
  qa    {id, context, question, answers}: chat prompt = paragraph + question, one-line answer; verifier
        `grounded` against the paragraph; graded by normalised exact match and token F1 against the golds.
  code  {id, prompt, entry_point, test} (HumanEval): the prompt is completed as raw text (the function body);
        the verifier runs the docstring's examples only; graded by the dataset's hidden tests, in the sandbox.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..engine import Engine
from ..errors import SpecdraftError
from ..jsonl import read_jsonl, rewrite_jsonl
from ..models.adapter import LoadedModel, load_model, set_threads
from ..prefix_cache import PrefixCache
from . import metrics
from .normalize import exact_match, token_f1, vote_key
from .sampler import one_line, sample_answers
from .verifiers import Verifier, build_verifier

QA_SYSTEM = ("You answer questions about a news article. Reply with the figure or the date alone, as the article "
             "states it: no sentence, no explanation.")


@dataclass(frozen=True)
class AnswersConfig:
    dataset: str
    out: str
    small: str = "qwen2.5-coder-0.5b-instruct"
    large: str = "qwen2.5-coder-1.5b-instruct"
    n: int = 10
    temperature: float = 0.7
    verifier: str | None = None  # default: grounded (qa), unit-tests (code)
    limit: int | None = None
    seed: int = 0
    max_new_tokens: int | None = None  # default: 16 (qa), 192 (code)
    dtype: str = "auto"
    threads: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.n <= 64:
            raise SpecdraftError(f"--n must be between 1 and 64, got {self.n}")
        if not self.temperature > 0:
            raise SpecdraftError(f"--temperature must be > 0 for sampling, got {self.temperature}")
        if self.limit is not None and self.limit < 1:
            raise SpecdraftError(f"--limit must be >= 1, got {self.limit}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise SpecdraftError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not Path(self.dataset).is_file():
            raise SpecdraftError(f"dataset {self.dataset} not found (JSONL; data/answers/ has the built ones)")

    def settings(self) -> dict:
        """What must match for a run to resume into an existing OUT."""
        out = asdict(self)
        for name in ("out", "limit", "threads"):
            out.pop(name)
        return out


def load_dataset(path: str, limit: int | None, seed: int) -> list[dict]:
    """The rows in a fixed pseudo-random order (by hash of seed and id), the first `limit` of them."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise SpecdraftError(f"{path}:{line_no} is not JSON ({exc.msg})") from None
    except UnicodeDecodeError:
        raise SpecdraftError(f"{path} is not UTF-8 text; a dataset is JSON lines") from None
    if not rows:
        raise SpecdraftError(f"{path} has no rows")
    for row in rows:
        if not isinstance(row, dict):
            raise SpecdraftError(f"{path}: every line must be one JSON object (a row), found {type(row).__name__}")
        missing = [k for k in ("id",) if k not in row]
        if missing or not (("question" in row and "answers" in row and "context" in row) or "entry_point" in row):
            raise SpecdraftError(f"{path}: row {row.get('id', '?')} needs id, context, question, answers "
                                 f"(or HumanEval's id, prompt, entry_point, test)")
    rows.sort(key=lambda r: hashlib.sha256(f"{seed}:{r['id']}".encode()).hexdigest())
    return rows[:limit] if limit else rows


def sample_seeds(seed: int, row_id: str, n: int) -> list[int]:
    return [int(hashlib.sha256(f"{seed}:{row_id}:{i}".encode()).hexdigest()[:12], 16) for i in range(n)]


def _chat_ids(loaded: LoadedModel, system: str, user: str) -> list[int]:
    tokenizer = loaded.tokenizer
    if not getattr(tokenizer, "chat_template", None):  # raw-text models (the tests' tiny ones)
        return list(tokenizer(f"{system}\n{user}\n", add_special_tokens=True)["input_ids"])
    ids = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class QATask:
    kind = "qa"
    default_verifier = "grounded"
    default_max_new_tokens = 16
    stop_rule = staticmethod(one_line)

    def prompt_ids(self, loaded: LoadedModel, row: dict) -> list[int]:
        return _chat_ids(loaded, QA_SYSTEM, f"Article: {row['context']}\n\nQuestion: {row['question']}")

    def answer(self, text: str, row: dict) -> str:
        line = text.strip().split("\n")[0].strip()
        return re.sub(r"^(answer|a)\s*:\s*", "", line, flags=re.IGNORECASE).rstrip(".").strip()

    def source(self, row: dict) -> str:
        return row["context"]

    def key(self, answer: str) -> str:
        return vote_key(answer)

    def grade(self, answer: str, row: dict) -> dict:
        return {"em": float(exact_match(answer, row["answers"])), "f1": token_f1(answer, row["answers"])}

    def golds(self, row: dict) -> list[str]:
        return row["answers"]


class CodeTask:
    kind = "code"
    default_verifier = "unit-tests"
    default_max_new_tokens = 192

    @staticmethod
    def stop_rule(text: str) -> bool:
        """The body ends at the first non-empty line that is not indented."""
        return any(line and not line[0].isspace() for line in text.split("\n")[1:-1]) or "\n\n\n\n" in text

    def prompt_ids(self, loaded: LoadedModel, row: dict) -> list[int]:
        return list(loaded.tokenizer(row["prompt"], add_special_tokens=True)["input_ids"])

    def answer(self, text: str, row: dict) -> str:
        """The completion up to the first non-empty line that is not indented (the function has ended)."""
        lines = text.split("\n")
        end = next((i for i, line in enumerate(lines) if i > 0 and line and not line[0].isspace()), len(lines))
        return "\n".join(lines[:end]).rstrip()

    def source(self, row: dict) -> str:
        from .code import docstring_tests

        return docstring_tests(row["prompt"], row["entry_point"])

    def program(self, answer: str, row: dict) -> str:
        return row["prompt"] + answer + "\n"

    def key(self, answer: str) -> str:
        return "\n".join(line.rstrip() for line in answer.strip("\n").split("\n") if line.strip()
                         and not line.strip().startswith("#"))

    def grade(self, answer: str, row: dict) -> dict:
        from .sandbox import run_python

        result = run_python(self.program(answer, row) + "\n" + row["test"] + f"\n\ncheck({row['entry_point']})\n",
                            timeout_s=10.0)
        return {"em": float(result.ok), "f1": float(result.ok)}

    def golds(self, row: dict) -> list[str]:
        return []


def task_for(rows: list[dict]) -> QATask | CodeTask:
    return CodeTask() if "entry_point" in rows[0] else QATask()


def _verify(task, verifier: Verifier, answer: str, row: dict, source: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    candidate = task.program(answer, row) if isinstance(task, CodeTask) else answer
    verdict = verifier.verify(candidate, source)
    return verdict.to_dict(), time.perf_counter() - t0


def _entry(task, answer_text: str, token_ids: list[int], row: dict) -> dict:
    answer = task.answer(answer_text, row)
    return {"text": answer_text, "answer": answer, "key": task.key(answer), "tokens": len(token_ids)}


def run_question(task, row: dict, small: Engine, large: Engine, verifier: Verifier,
                 config: AnswersConfig, max_new_tokens: int) -> dict:
    """One record: small greedy + N samples, large greedy, verdicts, grades (see strategies.py for its use)."""
    source = task.source(row)
    record: dict = {"id": row["id"], "question": row.get("question", row.get("prompt", ""))[:500],
                    "golds": task.golds(row)}
    small_prompt = task.prompt_ids(small.target, row)
    got = sample_answers(small, small_prompt, config.n, config.temperature, max_new_tokens,
                         sample_seeds(config.seed, row["id"], config.n), task.stop_rule)
    record["small"] = {"prompt_tokens": got.prompt_tokens, "greedy": _entry(task, got.greedy.text,
                                                                            got.greedy.token_ids, row),
                       "samples": [_entry(task, s.text, s.token_ids, row) for s in got.samples],
                       "time_prefill_s": got.time_prefill_s, "time_greedy_s": got.time_greedy_s,
                       "time_samples_s": got.time_samples_s}
    large_prompt = task.prompt_ids(large.target, row)
    got = sample_answers(large, large_prompt, 0, config.temperature, max_new_tokens, [], task.stop_rule)
    record["large"] = {"prompt_tokens": got.prompt_tokens, "greedy": _entry(task, got.greedy.text,
                                                                            got.greedy.token_ids, row),
                       "time_prefill_s": got.time_prefill_s, "time_greedy_s": got.time_greedy_s}
    grades: dict[str, dict] = {}
    for entry in [record["small"]["greedy"], *record["small"]["samples"], record["large"]["greedy"]]:
        entry["verdict"], entry["verify_s"] = _verify(task, verifier, entry["answer"], row, source)
        if entry["answer"] not in grades:
            grades[entry["answer"]] = task.grade(entry["answer"], row)
    record["grades"] = grades
    return record


# A question's prompt K/V, kept for its N sampled answers after the greedy one (the 0.5B's 240-token prompt: 6 MB)
PREFIX_CACHE_BYTES = 64 << 20


def run(config: AnswersConfig, log=sys.stderr) -> dict:
    """Run (or resume) the experiment into config.out; return the summary."""
    rows = load_dataset(config.dataset, config.limit, config.seed)
    task = task_for(rows)
    verifier = build_verifier(config.verifier or task.default_verifier)
    max_new_tokens = config.max_new_tokens or task.default_max_new_tokens
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise SpecdraftError(f"--out {out} is a file; name a folder (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    records_path, settings_path = out / "records.jsonl", out / "settings.json"
    # "sampler": records of the transformers batch sampler (before 2026-12-06) have none, and a run resumes only with
    # the answers the same sampler gives
    settings = {**config.settings(), "task": task.kind, "verifier": verifier.name, "max_new_tokens": max_new_tokens,
                "sampler": "engine"}
    done: set[str] = set()
    if records_path.exists():
        try:
            previous = json.loads(settings_path.read_text(encoding="utf-8")) if settings_path.exists() else {}
        except (UnicodeDecodeError, json.JSONDecodeError):
            previous = None
        if not isinstance(previous, dict) or {k: v for k, v in previous.items() if k in settings} != settings:
            raise SpecdraftError(f"{out} holds a run with other settings (or an unreadable settings.json); use "
                                 f"another --out (or the same settings to resume)")
        kept, cut = read_jsonl(records_path, "the records file was edited or is corrupt; use another --out")
        if not all(isinstance(r, dict) and "id" in r for r in kept):
            raise SpecdraftError(f"{records_path} holds lines that are not records; use another --out")
        if cut:  # a kill mid-write: the next record must not be appended to the cut line
            rewrite_jsonl(records_path, kept)
        done = {r["id"] for r in kept}
    todo = [row for row in rows if row["id"] not in done]
    if todo:
        set_threads(config.threads)
        small_model = load_model(config.small, config.dtype, progress=False)
        large_model = load_model(config.large, config.dtype, progress=False)
        small = Engine(small_model, prefix_cache=PrefixCache(PREFIX_CACHE_BYTES))
        large = Engine(large_model)
        settings.update({"small_params": small_model.matmul_params, "large_params": large_model.matmul_params,
                         "torch_dtype": small_model.dtype_name, "backend": small_model.backend})
        settings_path.write_text(json.dumps(settings, indent=1) + "\n")
    else:  # everything asked for is recorded: summarise only
        settings = json.loads(settings_path.read_text())
    print(f"{len(rows)} questions ({len(done & {r['id'] for r in rows})} already done), task {task.kind}, "
          f"verifier {verifier.name}, n={config.n}", file=log, flush=True)
    started = time.perf_counter()
    with records_path.open("a") as f:
        for i, row in enumerate(todo, 1):
            record = run_question(task, row, small, large, verifier, config, max_new_tokens)
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            elapsed = time.perf_counter() - started
            print(f"[{i}/{len(todo)}] {row['id']} small={record['small']['greedy']['answer']!r} "
                  f"large={record['large']['greedy']['answer']!r} ({elapsed / i:.1f}s/question)", file=log, flush=True)
    wanted = {row["id"] for row in rows}
    records = [r for r in metrics.read_records(records_path) if r["id"] in wanted]
    return metrics.write_outputs(records, settings, out)
