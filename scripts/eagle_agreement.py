"""Is a weak EAGLE head weak, or is the engine wrong? The head's offline agreement with the target on a benchmark
run's own greedy answers, next to the acceptance the engine measured on the same turns.

    python scripts/eagle_agreement.py --head qwen1.5b-s15 --bench out/bench-eagle --label eagle

(`--bench` is a benchmark run's folder with its records.jsonl; the runs under docs/bench keep only their summaries,
so run the bench command docs/benchmarks.md gives for one, with `--out out/bench-eagle`.)

For every first turn of the run's `ar` records: the target (bf16 weights, native backend) runs once over the
prompt and its answer with the head's feature taps; the training unroll (`ttt_logits`, tested equal to the
drafter's chain) gives the head's guesses at every position for draft steps 1..3. Agreement = the guess equals
the target's greedy token, split into positions whose token lies in the prompt and in the answer. If the answer
agreement at step 1 is close to the engine's acceptance at γ = 1 (accepted / drafted of the `--label` records),
the loop is consistent and the head itself is what limits acceptance.

    python scripts/eagle_agreement.py --head qwen1.5b-chats-s8 --chats qwen1.5b-chats-self --limit 32

does the same over a chats file's answers (`specdraft train chats`): comparing chats answered by the 0.5B with
the same prompts answered by the 1.5B tells whether the head is weak on the target's own text.

Step-1 answer agreement is also split by whether lookup first (its default: n-grams of 2-3 tokens) would copy
at that position: the engine asks the head only where it would not, so that part is the one that shows online.
Besides top-1 agreement (what greedy decoding keeps), it gives the expected acceptance of a guess sampled from the
head at temperature 1, sum_x min(p, q) (what sampling keeps).
With `--bench`, runs whose records carry `steps_by_source` also give the engine's own acceptance of the head's
drafts per step (given the steps before it) on the same first turns, to set beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdraft import load_model
from specdraft.bench.runner import Conversation
from specdraft.config import AUTO_LOOKUP_FIRST
from specdraft.registry import LookupOptions
from specdraft.drafters.prompt_lookup import find_continuation
from specdraft.models.adapter import set_threads
from specdraft.drafters.eagle_head import load_head
from specdraft.train.chats import chats_file
from specdraft.train.eagle_train import ttt_logits
from specdraft.types import DRAFTER_SOURCE

PROMPTS = Path(__file__).resolve().parents[1] / "data" / "bench" / "prompts.jsonl"


def agreement(target, head, prompt_ids: list[int], answer_ids: list[int], steps: int):
    """(hits per draft step over the answer positions, positions per step, step-1 hits and positions over the
    prompt, step-1 answer hits and positions split by whether lookup first would copy, the expected acceptance
    at temperature 1 per step over the answer positions summed): the head's guess against the target's greedy
    token at every position of prompt + answer; the expected acceptance of a guess sampled from the head's q
    is sum_x min(p(x), q(x)) (p the target's distribution there, q zero outside the draft vocabulary)."""
    ids = prompt_ids + answer_ids
    with torch.inference_mode():
        state = target.new_state(feature_layers=tuple(head.config.target_layers))
        target_probs = state.forward(ids, len(ids)).float().softmax(-1)  # [T, V]: the target after each position
        greedy = target_probs.argmax(-1)  # [T]
        guesses = ttt_logits(head, torch.tensor(ids), state.features, steps)
    answer_hits, answer_rows, sampled, prompt = [], [], [], (0.0, 0)
    split = {True: [0.0, 0], False: [0.0, 0]}
    for j, logits in enumerate(guesses, start=1):
        # row a: the head's guess for the token after position a + j, the target's is greedy[a + j]
        hit = (head.d2t[logits.argmax(-1)] == greedy[j: j + logits.shape[0]]).float()  # [T - j]
        in_prompt = max(len(prompt_ids) - j - 1, 0)  # rows whose guessed token is a prompt token
        answer_hits.append(float(hit[in_prompt:].sum()))
        answer_rows.append(len(hit) - in_prompt)
        with torch.inference_mode():
            q = head.full_vocab_logits(logits[in_prompt:]).softmax(-1)  # [answer rows, V]
            sampled.append(float(torch.minimum(q, target_probs[j + in_prompt: j + logits.shape[0]]).sum()))
        if j == 1:
            prompt = (float(hit[:in_prompt].sum()), in_prompt)
            for row in range(in_prompt, len(hit)):  # the engine's context then ends at position row + 1
                copies = bool(find_continuation(ids[: row + 2], 1, LookupOptions.lookup_max_ngram, AUTO_LOOKUP_FIRST))
                split[copies][0] += float(hit[row])
                split[copies][1] += 1
    return answer_hits, answer_rows, prompt, split, sampled


def online_steps(args) -> str:
    """The engine's own per-step acceptance of the drafter's guesses (SpecStats.steps_by_source, in records
    that carry it) over the `--label` records' first turns: the online twin of the split below."""
    records = [json.loads(line) for line in (Path(args.bench) / "records.jsonl").read_text().splitlines()]
    reached, kept = [0] * args.steps, [0] * args.steps
    for record in records:
        if record["label"] != args.label or record["turn"] != 0:
            continue
        steps = ((record.get("stats") or {}).get("steps_by_source") or {}).get(DRAFTER_SOURCE)
        for i in range(min(args.steps, len((steps or {}).get("reached", [])))):
            reached[i] += steps["reached"][i]
            kept[i] += steps["kept"][i]
    if not reached[0]:
        return f"online ({args.label}): no per-step tallies in these records"
    return (f"online ({args.label}, first turns), the head's own drafts, acceptance per step given the steps "
            "before it: " + ", ".join(f"{k / r:.3f} ({k}/{r})" if r else "-" for k, r in zip(kept, reached)))


def bench_turns(args, target):
    """(label, prompt ids, answer ids, engine acceptance text) per first turn of a benchmark run's `ar` records."""
    records = [json.loads(line) for line in (Path(args.bench) / "records.jsonl").read_text().splitlines()]
    prompts = {p["question_id"]: p for p in map(json.loads, Path(args.prompts).read_text().splitlines())}
    engine = {(r["question_id"], r["turn"]): (r["accepted"], r["drafted"]) for r in records if r["label"] == args.label}
    for record in records:
        if record["label"] != "ar" or record["turn"] != 0:
            continue
        prompt_ids = Conversation(target, chat=True).prompt_ids(prompts[record["question_id"]]["turns"][0])
        accepted, drafted = engine.get((record["question_id"], 0), (None, None))
        measured = f"engine ({args.label}) accepted " + (f"{accepted}/{drafted} = {accepted / drafted:.2f}"
                                                         if drafted else "-")
        yield record["category"], prompt_ids, record["output_ids"], measured


def chats_turns(args, target):
    """(kind, prompt ids, answer ids, "") per conversation of a chats file (`specdraft train chats`), in file order:
    the answer is the last assistant message, the prompt everything before it."""
    tokenizer = target.tokenizer
    records = [json.loads(line) for line in chats_file(args.chats).read_text().splitlines() if line.strip()]
    for record in records[: args.limit]:
        messages = [{"role": role, "content": text} for role, text in record["messages"]]
        whole = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        if not whole.startswith(prompt):
            continue
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer_ids = tokenizer.encode(whole[len(prompt):].rstrip("\n"), add_special_tokens=False)
        yield record["kind"], prompt_ids, answer_ids, record["model"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", required=True, help="EAGLE head name or folder")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--bench", help="a benchmark output folder (its records.jsonl)")
    source.add_argument("--chats", help="a chats file's name or folder (`specdraft train chats`)")
    parser.add_argument("--limit", type=int, default=None, help="--chats: the first N conversations")
    parser.add_argument("--label", default="eagle[gamma=1]", help="the records whose acceptance is compared")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--prompts", default=str(PROMPTS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    set_threads(None)
    target = load_model(args.target, "auto")
    head = load_head(args.head, target)
    turns = bench_turns(args, target) if args.bench else chats_turns(args, target)
    totals, rows, prompt_total, sampled_total = [0.0] * args.steps, [0] * args.steps, [0.0, 0], [0.0] * args.steps
    by_kind: dict[str, list[float]] = {}
    by_copy = {True: [0.0, 0], False: [0.0, 0]}
    for kind, prompt_ids, answer_ids, note in turns:
        hits, counts, (prompt_hits, prompt_rows), split, sampled = agreement(target, head, prompt_ids, answer_ids,
                                                                             args.steps)
        for copies, (h, n) in split.items():
            by_copy[copies][0] += h
            by_copy[copies][1] += n
        for j in range(min(args.steps, len(hits))):
            totals[j] += hits[j]
            rows[j] += counts[j]
            sampled_total[j] += sampled[j]
        prompt_total[0] += prompt_hits
        prompt_total[1] += prompt_rows
        kind_total = by_kind.setdefault(kind, [0.0, 0])
        kind_total[0] += hits[0]
        kind_total[1] += counts[0]
        per_step = [round(h / n, 2) if n else None for h, n in zip(hits, counts)]
        print(f"{kind:14s} prompt {len(prompt_ids):4d} answer {len(answer_ids):3d}  "
              f"answer agreement per step {per_step}  {note}", flush=True)
    print(f"prompt positions, step 1: {prompt_total[0] / max(1, prompt_total[1]):.3f}")
    print("answer positions per step: " + ", ".join(f"{h / max(1, n):.3f}" for h, n in zip(totals, rows)))
    print("answer positions per step, expected acceptance at temperature 1 (sum of min(p, q)): "
          + ", ".join(f"{s / max(1, n):.3f}" for s, n in zip(sampled_total, rows)))
    print("answer positions, step 1, where lookup first would not copy (the head drafts): "
          f"{by_copy[False][0] / max(1, by_copy[False][1]):.3f} ({by_copy[False][1]}); where it would copy: "
          f"{by_copy[True][0] / max(1, by_copy[True][1]):.3f} ({by_copy[True][1]})")
    if args.bench:
        print(online_steps(args))
    print("answer positions, step 1, per kind: " + ", ".join(f"{k} {h / max(1, n):.2f} ({n})"
                                                             for k, (h, n) in sorted(by_kind.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
