"""Chat-style training text: prompts built from the pinned packages, answered by a model of the family.

Why: drafters trained on the raw package corpus (modules and descriptions) meet a different text at inference,
the answers of a chat model to user prompts. The early exits of the sorted draft agreed with the 1.5B target on
32-38 % of held-out package text but were accepted on 8-14 % of the benchmark's chat answers (docs/s2d.md).
EAGLE and Medusa train on the served model's own answers for the same reason. This module builds that text
without the benchmark's sources:

  prompts   one per (kind, source), from the pinned packages' modules, docstrings and descriptions, and from
            our own generators (arithmetic, word problems, conversation openers); kinds mirror the benchmark's
            categories: chat (two turns), translate (English -> German, then that German back into English),
            summarize, qa, rag, math, code, explain; and the prose kinds of train/prose.py (trivia, passage,
            news, german), whose first answer is a text that the second turn works on;
  answers   sampled from a model (default the packaged 0.5B draft, `temperature` 0.7), up to `batch` answers
            decoding together, a row refilled with the next prompt as soon as its answer ends (`sample_stream`):
            a 16-row step of the 0.5B costs about 1.3x a one-row step here (bf16, 300 cached tokens: 138 vs
            108 ms), and answers end at very different lengths, so a batch that waited for its longest ran
            few rows for most of its steps.

On disk (`~/.cache/specdraft/chats/NAME/chats.jsonl`, or a folder): one line per conversation,
{"id", "kind", "source", "model", "temperature", "messages": [[role, text], ...], "finish", "answer_tokens"},
appended conversation by conversation, so an interrupted run resumes where it stopped. `chat_docs` turns the
file into the `TextDoc`s both trainers read (`--corpus chats:NAME`).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import re
import textwrap
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import SamplingParams, resolve_dtype
from ..errors import SpecdraftError
from ..jsonl import read_jsonl, rewrite_jsonl
from ..models.batched import BatchDecoder
from ..sampling import processed_probs, sample
from .config import KINDS, PACKAGE_KINDS, ChatsConfig  # noqa: F401 (ChatsConfig: this module's config)
from .corpus import TextDoc, candidate_docs
from .prose import followup_accepts, names_withdrawn, prose_prompts


@dataclass(frozen=True)
class ChatPrompt:
    id: str
    kind: str
    source: str  # where the prompt's text comes from ("torch==2.13.0:torch/nn/...", "generator:math")
    user: str
    # a second user turn, "{answer}" standing for the first answer; `restart` drops the first exchange
    followup: str | None = None
    restart: bool = False


# ----------------------------------------------------------------------------------------------- prompt builders

_TOPICS = ("football", "jazz", "the moon landing", "coffee", "volcanoes", "chess", "the Roman empire", "bees",
           "electric cars", "the Olympic games", "sourdough bread", "deep sea fish", "Shakespeare", "rainforests",
           "video games", "the stock market", "photography", "marathon running", "tea ceremonies", "glaciers",
           "space telescopes", "board games", "classical music", "dinosaurs", "cooking pasta", "cats", "dogs",
           "solar energy", "ancient Egypt", "surfing", "comic books", "the internet", "mountain climbing",
           "birds migrating", "robots", "pizza", "the ocean tides", "basketball", "movies from the 1980s",
           "learning languages", "gardening", "hip hop", "trains", "honey", "the northern lights", "tennis")
_OPENERS = ("Hi! I just read an article about {t}. Do you know much about it?",
            "Hey, what do you think about {t}?",
            "Hello! I've been getting into {t} lately. Any fun facts?",
            "Did you know anything interesting about {t}? I'm curious.",
            "Hi there, how are you? I was thinking about {t} today.",
            "Do you like {t}? I can't decide whether I do.",
            "Good morning! My friend keeps talking about {t}. Can you tell me why people like it?")
_FOLLOWUPS = ("That's interesting! What else can you tell me about it?", "Why do you think that is?",
              "I didn't know that. How did it start?", "Cool. What would you recommend to a beginner?",
              "Really? Can you give me an example?", "Thanks! Is there anything surprising about it?")
_QA = ("What is the Python package {pkg} used for?", "Who would use {pkg}, and for what kind of work?",
       "In the Python package {pkg}, what does `{name}` do?", "What is the difference between {pkg} and "
       "other libraries that do similar things?", "How do I get started with {pkg}?")
_RAG = ("What does `{name}` return?", "What is `{name}` used for?", "Which arguments does `{name}` take?",
        "What happens when `{name}` is called?")


def _paragraphs(text: str, low: int, high: int) -> list[str]:
    out = []
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if low <= len(para) <= high and not para.startswith((">>>", "..", "|", "#", "-", "*", "=", ":")):
            out.append(para)
    return out


def _sentences(text: str) -> list[str]:
    flat = " ".join(text.split())
    plain = re.compile(r"[A-Za-z0-9 ,.;:'()!?-]+")  # prose only: no code, markup or symbols
    return [s for s in re.split(r"(?<=[.!?])\s+", flat) if 40 <= len(s) <= 220 and plain.fullmatch(s)]


def _functions(source_text: str) -> tuple[str, list[tuple[str, str, str, str]]]:
    """The module's docstring, and (name, signature, docstring, source) of its public, documented functions."""
    try:
        tree = ast.parse(source_text)
    except (SyntaxError, ValueError, RecursionError):
        return "", []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        docstring = ast.get_docstring(node) or ""
        if len(docstring) < 60:
            continue
        segment = textwrap.dedent(" " * node.col_offset + (ast.get_source_segment(source_text, node) or ""))
        args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
        out.append((node.name, f"{node.name}({', '.join(args)})", docstring, segment))
    return ast.get_docstring(tree) or "", out


def _math_prompt(rng: random.Random) -> str:
    if rng.random() < 0.4:
        def term() -> str:
            a, b = rng.randint(-20, 40), rng.randint(-20, 40)
            return f"({a} {rng.choice('+-*')} {b})"
        expression = f"({term()} {rng.choice('+-*')} {term()})"
        if rng.random() < 0.5:
            expression = f"{expression} {rng.choice('+-')} {term()}"
        return f"Calculate {expression}. Show your steps."
    a, b, c = rng.randint(3, 90), rng.randint(2, 30), rng.randint(2, 12)
    problems = (
        f"A shop sells pencils at {b} cents each. Anna buys {a} pencils and pays with a {c * 10} dollar note. "
        f"How much change does she get?",
        f"A train travels {a * 10} km in {c} hours. At the same speed, how far does it travel in {b} hours?",
        f"The perimeter of a rectangle is {2 * (a + b)} m and its width is {b} m. What is its area?",
        f"A tank holds {a * 100} litres. It loses {b} litres per minute. After how many minutes is it "
        f"{c * 10} % empty?",
        f"{a} workers build a wall in {c} days. How many days would {a + b} workers need at the same pace?",
        f"A price of {a * 5} dollars rises by {b} % and then falls by {c} %. What is the final price?",
        f"What is the sum of all whole numbers from {b} to {a + b}?",
        f"The average of {c} numbers is {a}. One number, {b}, is removed. What is the average of the rest?",
    )
    return "Solve this math word problem step by step.\n\n" + rng.choice(problems)


def build_prompts(per_kind: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[ChatPrompt]:
    """Up to `per_kind` prompts of each of `kinds`, in a deterministic order that interleaves the kinds.

    A kind's prompts do not depend on which other kinds are asked for: the package kinds draw from one seeded
    stream whatever the selection (and unchanged since before the prose kinds existed), the prose kinds from
    another."""
    rng = random.Random(seed)
    by_kind: dict[str, list[ChatPrompt]] = {kind: [] for kind in kinds}

    seen: set[str] = set()

    def add(kind: str, source: str, user: str, followup: str | None = None, restart: bool = False) -> None:
        key = f"{kind}-" + hashlib.sha256(f"{kind}:{source}:{user}".encode()).hexdigest()[:16]
        if kind in by_kind and len(by_kind[kind]) < per_kind and key not in seen:  # a generator can repeat itself
            seen.add(key)
            by_kind[kind].append(ChatPrompt(key, kind, source, user, followup, restart))

    for _ in range(per_kind):
        topic, opener = rng.choice(_TOPICS), rng.choice(_OPENERS)
        add("chat", "generator:chat", opener.format(t=topic), rng.choice(_FOLLOWUPS))
        add("math", "generator:math", _math_prompt(rng))

    for doc in candidate_docs() if any(kind in PACKAGE_KINDS for kind in by_kind) else ():
        if all(len(v) >= per_kind for kind, v in by_kind.items() if kind in PACKAGE_KINDS):
            break
        pin = doc.source.split(":", 1)[0]
        package = pin.split("==", 1)[0]
        text = doc.messages[-1][1]
        if doc.source.endswith(":METADATA"):
            for para in _paragraphs(text, 300, 1500)[:1]:
                add("summarize", doc.source, f"Summarize the following text in one sentence.\n\n{para}")
            add("qa", doc.source, rng.choice(_QA[:2] + _QA[3:]).format(pkg=package))
            continue
        module_doc, functions = _functions(text)
        for para in _paragraphs(module_doc, 300, 1500)[:1]:
            add("summarize", doc.source, f"Summarize the following text in one sentence.\n\n{para}")
        if not functions:
            continue
        name, signature, docstring, segment = rng.choice(functions)
        first = _paragraphs(docstring, 40, 600)
        if first:
            add("code", doc.source, f"Write a Python function `{signature}` that does the following.\n\n{first[0]}")
        if 200 <= len(segment) <= 1500:
            add("explain", doc.source, f"Explain what the following Python function does.\n\n```python\n{segment}\n```")
        if 200 <= len(docstring) <= 1500:
            add("rag", doc.source, f"Answer the question using the passage below.\n\nPassage: {docstring}\n\n"
                f"Question: {rng.choice(_RAG).format(name=name)}")
        add("qa", doc.source, _QA[2].format(pkg=package, name=name))
        sentences = _sentences(docstring)
        if sentences:
            add("translate", doc.source, f"Translate the following English text into German.\n\n{sentences[0]}",
                "Translate the following German text into English.\n\n{answer}", restart=True)
        for para in _paragraphs(docstring, 300, 1500)[:1]:
            add("summarize", doc.source, f"Summarize the following text in one sentence.\n\n{para}")

    for kind, prompts in prose_prompts(per_kind, seed).items():
        for source, user, followup, restart in prompts:
            add(kind, source, user, followup, restart)

    # interleave: the i-th prompt of every kind, then the (i+1)-th, so any prefix of the list is balanced
    ordered = []
    for i in range(per_kind):
        ordered.extend(by_kind[kind][i] for kind in kinds if i < len(by_kind[kind]))
    return ordered


# ------------------------------------------------------------------------------------------- batched sampling


@dataclass
class AnswerJob:
    """One answer to sample: a key the caller knows it by, the prompt's token ids, and its own seeded stream."""
    key: str
    prompt_ids: list[int]
    generator: torch.Generator


def sample_stream(loaded, pull, temperature: float, max_new_tokens: int, rows: int):
    """Sample answers with up to `rows` of them decoding together, refilling a row as soon as its answer ends.

    `pull(k)` returns up to k more `AnswerJob`s (fewer or none when it has none now; it is asked again each step,
    so jobs the caller adds between two yields, a second turn say, join as rows come free). Yields (job, answer
    ids without EOS, "stop" | "length") as answers finish; stops when no row is busy and `pull` has nothing.

    New prompts are prefilled together, left-padded, and joined to the running batch, whose cache is padded on
    the left to the longer of the two; padding is masked out and each row's positions count its own tokens, so a
    row decodes as it would alone (up to the last bits of a batched matmul). Keeping rows full is what pays:
    answers end at very different lengths, and a batch that waits for its longest ran a few rows for most steps.
    """
    from transformers import DynamicCache

    eos = loaded.eos_token_ids
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    pad = next(iter(eos))
    decoder = BatchDecoder(loaded)
    jobs: list[AnswerJob] = []  # the job of each batch row
    answers: list[list[int]] = []  # tokens sampled so far, per row
    mask = torch.zeros(0, 0, dtype=torch.long)  # [rows, cached]: 1 where a row has a token, 0 for padding
    logits = torch.zeros(0, 0)  # [rows, V]: each row's next-token logits

    def positions(mask: torch.Tensor, n: int) -> torch.Tensor:
        return (mask.cumsum(-1) - 1).clamp(min=0)[:, -n:]  # [rows, n]: each row counts its own tokens

    def left_pad(cache: DynamicCache, mask: torch.Tensor, columns: int) -> torch.Tensor:
        """Pad a batch's cache and its mask [rows, cached] on the left to `columns`; returns the padded mask."""
        extra = columns - mask.shape[1]
        if extra <= 0:
            return mask
        for layer in cache.layers:  # keys, values: [rows, Hkv, S, Dh]
            for name in ("keys", "values"):
                t = getattr(layer, name)
                setattr(layer, name, torch.cat([t.new_zeros(*t.shape[:2], extra, t.shape[3]), t], dim=2))
        return torch.cat([mask.new_zeros(mask.shape[0], extra), mask], dim=1)

    def admit(new: list[AnswerJob]) -> None:
        nonlocal mask, logits
        width = max(len(j.prompt_ids) for j in new)
        ids = torch.tensor([[pad] * (width - len(j.prompt_ids)) + j.prompt_ids for j in new])  # [new, width]
        new_mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in new])
        prefill = BatchDecoder(loaded)
        new_logits = prefill.forward(ids, new_mask, positions(new_mask, width))  # [new, V]
        if jobs:
            columns = max(mask.shape[1], width)
            mask = left_pad(decoder.cache, mask, columns)
            new_mask = left_pad(prefill.cache, new_mask, columns)
            for layer, joining in zip(decoder.cache.layers, prefill.cache.layers, strict=True):
                layer.keys = torch.cat([layer.keys, joining.keys])
                layer.values = torch.cat([layer.values, joining.values])
            mask, logits = torch.cat([mask, new_mask]), torch.cat([logits, new_logits])
        else:
            decoder.cache, mask, logits = prefill.cache, new_mask, new_logits
        jobs.extend(new)
        answers.extend([] for _ in new)

    with torch.inference_mode():
        while True:
            if len(jobs) < rows and (new := pull(rows - len(jobs))):
                admit(list(new))
            if not jobs:
                return
            probs = processed_probs(logits, params)  # [rows, V]
            still, finished = [], []
            for row, job in enumerate(jobs):
                token = int(sample(probs[row: row + 1], job.generator))
                reason = "stop" if token in eos else None
                if reason is None:
                    answers[row].append(token)
                    reason = "length" if len(answers[row]) >= max_new_tokens else None
                if reason is None:
                    still.append(row)
                else:
                    finished.append((job, answers[row], reason))
            if len(still) < len(jobs):
                keep = torch.tensor(still, dtype=torch.long)
                decoder.cache.batch_select_indices(keep)
                mask = mask[keep]
                jobs[:] = [jobs[r] for r in still]
                answers[:] = [answers[r] for r in still]
                if jobs and (first := int(mask.any(0).nonzero()[0])) > 0:  # columns that are padding for every row
                    mask = mask[:, first:]
                    for layer in decoder.cache.layers:
                        layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            yield from finished
            if not jobs:
                continue  # refill, or return when nothing is left
            mask = torch.cat([mask, torch.ones(len(jobs), 1, dtype=mask.dtype)], dim=1)
            step_ids = torch.tensor([[a[-1]] for a in answers])  # [rows, 1]
            logits = decoder.forward(step_ids, mask, positions(mask, 1))


def sample_batch(loaded, prompts: list[list[int]], temperature: float, max_new_tokens: int,
                 generators: list[torch.Generator], rows: int | None = None) -> list[tuple[list[int], str]]:
    """Sample one answer per prompt (`sample_stream`, `rows` at a time, default all at once); returns (answer
    ids without EOS, finish reason "stop" | "length") per prompt, in the prompts' order."""
    queue = [AnswerJob(str(i), p, g) for i, (p, g) in enumerate(zip(prompts, generators, strict=True))]
    results: dict[str, tuple[list[int], str]] = {}

    def pull(k: int) -> list[AnswerJob]:
        taken, queue[:k] = queue[:k], []
        return taken

    for job, ids, reason in sample_stream(loaded, pull, temperature, max_new_tokens, rows or max(len(prompts), 1)):
        results[job.key] = (ids, reason)
    return [results[str(i)] for i in range(len(prompts))]


# ------------------------------------------------------------------------------------------------- generation


# chats files committed to the repo (data/eagle/chats/NAME.jsonl.gz): the cache is lost with the machine, and
# writing them again costs the 0.5B 20-45 answer tokens/s here (about half an hour for qwen0.5b-chats), so the
# ones a shipped recipe reads are kept
BUNDLED_CHATS = Path(__file__).resolve().parents[3] / "data" / "eagle" / "chats"


def chats_root() -> Path:
    return Path.home() / ".cache" / "specdraft" / "chats"


def chats_file(name_or_folder: str) -> Path:
    """`NAME` -> ~/.cache/specdraft/chats/NAME/chats.jsonl; a folder or a .jsonl path is taken as it is. A NAME
    missing from the cache but committed as data/eagle/chats/NAME.jsonl.gz is first unpacked into the cache (so
    that `train chats --out NAME` resumes it, and readers read it)."""
    path = Path(name_or_folder).expanduser()
    if path.suffix == ".jsonl":
        return path
    if "/" in name_or_folder or path.is_dir():
        return path / "chats.jsonl"
    cached = chats_root() / name_or_folder / "chats.jsonl"
    bundled = BUNDLED_CHATS / f"{name_or_folder}.jsonl.gz"
    if not cached.exists() and bundled.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".unpacking")
        partial.write_bytes(gzip.decompress(bundled.read_bytes()))
        partial.replace(cached)  # whole or absent, never half a file
    return cached


def _read(path: Path, fix: str = "choose another --out") -> tuple[list[dict], bool]:
    """(the records of a chats file, whether a last line cut by a killed run was left out). Anything else that is
    not a chats record is an error: the file is not ours, and must not be rewritten."""
    rows, cut = read_jsonl(path, f"it is not a chats file of `specdraft train chats`; {fix}")
    records, ids = [], set()
    for number, record in enumerate(rows, 1):
        if not (isinstance(record, dict) and isinstance(record.get("id"), str)
                and isinstance(record.get("messages"), list)):
            raise SpecdraftError(f"{path} is not a chats file of `specdraft train chats` (record {number} is no "
                                 f"conversation); {fix}")
        if record["id"] not in ids:  # files from before prompts were deduplicated repeat some chat openers
            ids.add(record["id"])
            records.append(record)
    return records, cut


def _seeded(seed: int, key: str) -> torch.Generator:
    return torch.Generator().manual_seed(int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:15], 16))


def generate(config: ChatsConfig, progress: bool = True) -> Path:
    """Answer prompts batch by batch until the answers hold `config.tokens` tokens; resumes a partial file."""
    from tqdm import tqdm

    from ..models.adapter import load_model, set_threads
    from ..models.grouped_attention import use_grouped_attention

    path = chats_file(config.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    done, cut = _read(path)
    # the prompts depend on per_kind too (one seeded stream draws them all): a resumed run must not change it;
    # nor its kinds, which set how a stopped run is spread over them
    settings = {"model": config.model, "temperature": config.temperature, "seed": config.seed,
                "per_kind": config.per_kind, "kinds": list(config.kinds), "dtype": resolve_dtype(config.dtype)}
    # what files older than a setting ran
    before_setting = {"per_kind": config.per_kind, "kinds": list(PACKAGE_KINDS), "dtype": "float32"}
    for r in done[:1]:
        theirs = {k: r.get(k, before_setting.get(k)) for k in settings}
        if theirs != settings:
            raise SpecdraftError(f"{path} holds chats from other settings ({theirs}); choose another --out")
    if cut:  # only now that the file is known to be ours: without its cut last line, before appending to it
        rewrite_jsonl(path, done)
    done_ids = {r["id"].split("/")[0] for r in done}
    total = sum(r["answer_tokens"] for r in done)
    todo = [p for p in build_prompts(config.per_kind, config.seed, config.kinds) if p.id not in done_ids]
    # within each run of 2 x batch prompts, similar lengths come together: prompts that join the batch at one step
    # are prefilled as one padded block (an explain prompt is ~20x a chat opener)
    chunk = 2 * config.batch  # small, so that a run stopped anywhere still holds every kind in proportion
    todo = [p for i in range(0, len(todo), chunk) for p in sorted(todo[i: i + chunk], key=lambda p: len(p.user))]
    set_threads(config.threads)
    # the batched forward is the transformers one, with decoding steps in grouped attention
    loaded = load_model(config.model, settings["dtype"], progress=progress, backend="transformers")
    use_grouped_attention(loaded.model)
    tokenizer = loaded.tokenizer

    def encode(messages: list[tuple[str, str]]) -> list[int]:
        ids = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    bar = tqdm(total=config.tokens, initial=min(total, config.tokens), unit="tok", desc="chats",
               disable=not progress, smoothing=0.1)
    started, written_now = time.time(), 0
    first_turns = deque(todo)  # prompts not started; none is started once the answers hold `config.tokens`
    second_turns: deque[AnswerJob] = deque()  # asked as soon as their first answer is in, before new prompts
    asked: dict[str, tuple[ChatPrompt, list[tuple[str, str]]]] = {}  # answer key -> its prompt and conversation
    first_records: dict[str, dict] = {}  # second turn's key -> the first exchange's record, written with it

    def pull(k: int) -> list[AnswerJob]:
        taken = [second_turns.popleft() for _ in range(min(k, len(second_turns)))]
        while len(taken) < k and first_turns and total < config.tokens:
            p = first_turns.popleft()
            asked[p.id] = (p, [("user", p.user)])
            taken.append(AnswerJob(p.id, encode(asked[p.id][1]), _seeded(config.seed, p.id)))
        return taken

    with open(path, "a") as f:
        for job, ids, reason in sample_stream(loaded, pull, config.temperature, config.max_new_tokens, config.batch):
            p, conversation = asked.pop(job.key)
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            conversation = conversation + [("assistant", text)]
            record = {"id": job.key, "kind": p.kind, "source": p.source, **settings,
                      "messages": [list(m) for m in conversation], "finish": reason, "answer_tokens": len(ids)}
            is_first = job.key == p.id
            if is_first and p.followup and reason == "stop" and followup_accepts(p.kind, text):
                turn = ("user", p.followup.format(answer=text))
                second = [turn] if p.restart else conversation + [turn]
                key = p.id + "/2"
                asked[key] = (p, second)
                first_records[key] = record
                second_turns.append(AnswerJob(key, encode(second), _seeded(config.seed, key)))
                continue
            # a conversation is written whole (its first exchange, then its second): a resumed run skips it whole
            for r in ([] if is_first else [first_records.pop(job.key)]) + [record]:
                f.write(json.dumps(r) + "\n")
                total += r["answer_tokens"]
                written_now += r["answer_tokens"]
                bar.update(r["answer_tokens"])
            f.flush()
            bar.set_postfix(tok_s=f"{written_now / max(time.time() - started, 1e-9):.1f}")
    bar.close()
    if total < config.tokens:
        print(f"chats: the prompts ran out at {total} answer tokens; for more, start another --out with a larger "
              f"--per-kind or another --seed (the prompts depend on both), and join them: --corpus chats:A+chats:B")
    return path


# -------------------------------------------------------------------------------------------------- as a corpus


def chat_docs(name_or_folder: str) -> list[TextDoc]:
    """The conversations of a chats file as training documents, ranked by SHA-256 of their id; a conversation
    that names a subject withdrawn for overlapping the benchmark (prose.WITHDRAWN) is left out."""
    path = chats_file(name_or_folder)
    records, _ = _read(path, "name a chats file (`--corpus chats:NAME`)")
    if not records:
        raise SpecdraftError(f"no chats at {path}; make them with `specdraft train chats --out NAME`")
    def rank(record: dict) -> tuple[str, str]:  # a second turn stays right after its first (it repeats it)
        base, _, turn = record["id"].partition("/")
        return hashlib.sha256(f"{record['model']}:{base}".encode()).hexdigest(), turn

    return [TextDoc(f"chats:{r['model']}:{r['id']}", tuple((role, text) for role, text in r["messages"]))
            for r in sorted(records, key=rank)
            if r["messages"][-1][1] and not any(names_withdrawn(text) for _, text in r["messages"])]


def corpus_docs(spec: str) -> list[TextDoc]:
    """`packages` (the pinned-package corpus), `chats:NAME` (a chats file), or several joined by `+` (so a
    chats path cannot contain `+`); several are interleaved document by document, so any prefix holds all of
    them in proportion."""
    parts = [p.strip() for p in spec.split("+") if p.strip()]
    if not parts:
        raise SpecdraftError("--corpus is empty; use packages, chats:NAME or both joined by +")
    lists = []
    for part in parts:
        if part == "packages":
            lists.append(candidate_docs())
        elif part.startswith("chats:") and part[6:]:
            lists.append(chat_docs(part[6:]))
        else:
            raise SpecdraftError(f"unknown corpus {part!r}; use packages, chats:NAME or both joined by +")
    if len(lists) == 1:
        return lists[0]
    merged, cursors = [], [0] * len(lists)
    longest = max(len(docs) for docs in lists)
    # take from each list in proportion to its length, so the shorter one is spread over the whole run
    for step in range(longest):
        for i, docs in enumerate(lists):
            target = (step + 1) * len(docs) // longest
            merged.extend(docs[cursors[i]: target])
            cursors[i] = target
    return merged


def cmd_train_chats(args) -> int:
    config = ChatsConfig(out=args.out, model=args.model, tokens=args.tokens, per_kind=args.per_kind,
                         batch=args.batch, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         seed=args.seed, threads=args.threads, kinds=tuple(args.kinds), dtype=args.dtype)
    path = generate(config)
    records, _ = _read(path)
    kinds: dict[str, int] = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + r["answer_tokens"]
    print(f"{len(records)} conversations, {sum(kinds.values())} answer tokens in {path}")
    print("answer tokens per kind: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    return 0
