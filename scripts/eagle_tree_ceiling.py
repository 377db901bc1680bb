"""How far can trees take this head? The best static tree for each node budget, chosen on the benchmark's own
greedy answers (an optimistic ceiling: the shape is fitted to the very text it is scored on).

    python scripts/eagle_tree_ceiling.py --head qwen1.5b-s15 --bench docs/bench/s19-s2d-1.5b-heldout

For every `ar` turn of the run (all turns; later turns see the earlier `ar` answers, as the benchmark builds
them): the target (bf16, native) runs once over prompt + answer with the head's feature taps, and the training
unroll (`ttt_logits`, tested equal to the drafter's chain) gives the head's logits at every anchor for draft
steps 1..D along the answer's own tokens. At anchor a (the target's features known through position a, token
a + 1 already the target's), step j guesses token a + 1 + j; its rank r_j is the place of the answer's token in
the head's draft-vocabulary logits (a token outside the draft vocabulary never ranks).

A static tree is a prefix-closed set of rank paths (r_1, ..., r_d); drafting it costs one head call per depth,
and it keeps the answer's tokens up to the longest prefix of the anchor's rank vector that is a node. Per
budget N the script picks the N nodes that the most anchors reach (greedy over children of chosen nodes, which
is optimal for the per-anchor mean because a node is reached no more often than its parent), then walks each
answer pass by pass as the engine would (a pass emits the kept tokens plus one of the target's) for τ. The
chain (γ = D, ranks 0 only) is the first row. Prompt lookup is off here: it would add the copied tokens.

Decode speedup over AR per pass: τ / (verify cost of N + 1 tokens + head steps), the verify cost from the
target's measured curve (`--curve`, relative to one token; past its last point extrapolated along its last
slope, marked *), a head step at `--head-step` of a target step (γ auto's price, session 15). End to end at
the run's own prefill share of our AR's time: 1 / (share + (1 − share) / decode).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdraft import load_model
from specdraft.bench.runner import Conversation
from specdraft.config import AUTO_LOOKUP_FIRST, SpecConfig
from specdraft.drafters.prompt_lookup import find_continuation
from specdraft.models.adapter import set_threads
from specdraft.models.eagle_head import load_head
from specdraft.train.eagle_train import ttt_logits

NEVER = 10**6  # the rank of a token outside the draft vocabulary


def rank_vectors(target, head, prompt_ids: list[int], answer_ids: list[int], depth: int
                 ) -> list[tuple[list[int], int, int]]:
    """Per decode anchor of the answer (a = len(prompt) - 1 .. len(ids) - 3): the ranks of the answer's next
    tokens at draft steps 1..depth (shorter near the end of the answer), and what prompt lookup would copy there
    (its default n-grams of 2-3 tokens, up to `depth` tokens): (ranks, copied tokens, copied tokens kept)."""
    ids = prompt_ids + answer_ids
    with torch.inference_mode():
        state = target.new_state(feature_layers=tuple(head.config.target_layers))
        state.forward(ids, 1)
        per_step = ttt_logits(head, torch.tensor(ids), state.features, depth)  # step j: [T - j, V_draft]
    draft_id = torch.full((head.t2d.shape[0],), -1, dtype=torch.long)
    draft_id[head.d2t] = torch.arange(head.d2t.shape[0])
    vectors = []
    for a in range(len(prompt_ids) - 1, len(ids) - 2):
        ranks = []
        for j, logits in enumerate(per_step, start=1):
            if a + 1 + j >= len(ids) or a >= logits.shape[0]:
                break
            wanted = int(draft_id[ids[a + 1 + j]])
            row = logits[a]  # [V_draft]
            ranks.append(NEVER if wanted < 0 else int((row > row[wanted]).sum()))
        copy = find_continuation(ids[: a + 2], depth, SpecConfig.lookup_max_ngram, AUTO_LOOKUP_FIRST)
        copy_kept = 0
        while copy_kept < len(copy) and a + 2 + copy_kept < len(ids) and copy[copy_kept] == ids[a + 2 + copy_kept]:
            copy_kept += 1
        vectors.append((ranks, len(copy), copy_kept))
    return vectors


def best_tree(vectors: list[list[int]], budget: int, branch: int, depth: int) -> set[tuple[int, ...]]:
    """The `budget` rank paths most anchors reach, prefix-closed."""
    counts: dict[tuple[int, ...], int] = {}
    for ranks, _, _ in vectors:
        for d in range(1, min(depth, len(ranks)) + 1):
            if ranks[d - 1] >= branch:
                break
            counts[tuple(ranks[:d])] = counts.get(tuple(ranks[:d]), 0) + 1
    chosen: set[tuple[int, ...]] = set()
    frontier = {(r,) for r in range(branch)}
    while len(chosen) < budget and frontier:
        node = max(frontier, key=lambda n: (counts.get(n, 0), -len(n), [-r for r in n]))
        frontier.discard(node)
        chosen.add(node)
        if len(node) < depth:
            frontier |= {node + (r,) for r in range(branch)}
    return chosen


def kept(ranks: list[int], tree: set[tuple[int, ...]]) -> int:
    d = 0
    while d < len(ranks) and tuple(ranks[: d + 1]) in tree:
        d += 1
    return d


def walk(turn_vectors, tree: set[tuple[int, ...]], curve: list[float], head_step: float, lookup: bool
         ) -> tuple[float, float]:
    """(τ, decode speed over AR) over every answer, pass by pass. With `lookup`, a pass where lookup would copy
    verifies the copy instead of the tree (lookup first, the engine's default)."""
    tokens = passes = cost = 0.0
    tree_cost = verify_cost(curve, len(tree) + 1)[0] + head_step * max(len(n) for n in tree)
    for vectors in turn_vectors:
        a = 0
        while a < len(vectors):
            ranks, copied, copy_kept = vectors[a]
            if lookup and copied:
                step, pass_cost = copy_kept + 1, verify_cost(curve, copied + 1)[0]
            else:
                step, pass_cost = kept(ranks, tree) + 1, tree_cost
            tokens += min(step, len(vectors) - a)
            passes += 1
            cost += pass_cost
            a += step
    return tokens / passes, tokens / cost


def verify_cost(curve: list[float], n_tokens: int) -> tuple[float, bool]:
    if n_tokens <= len(curve):
        return curve[n_tokens - 1], False
    slope = curve[-1] - curve[-2]
    return curve[-1] + slope * (n_tokens - len(curve)), True


def collect(args, prompts: dict, ar: dict) -> dict[str, list]:
    """Rank vectors per category, per turn (see rank_vectors)."""
    target = load_model(args.target, "auto")
    head = load_head(args.head, target)
    by_category: dict[str, list] = {}
    for qid in dict.fromkeys(q for q, _ in ar):
        conversation = Conversation(target, chat=True)
        for turn, text in enumerate(prompts[qid]["turns"]):
            record = ar.get((qid, turn))
            if record is None:
                break
            prompt_ids = conversation.prompt_ids(text)
            vectors = rank_vectors(target, head, prompt_ids, record["output_ids"], args.depth)
            by_category.setdefault(record["category"], []).append(vectors)
            conversation.messages.append({"role": "assistant", "content": record["text"]})
    return by_category


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", required=True)
    parser.add_argument("--bench", required=True, help="a benchmark folder with `ar` records (greedy)")
    parser.add_argument("--prompts", default=None, help="default: the run's own prompts file")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--branch", type=int, default=4)
    parser.add_argument("--budgets", default="1,2,3,4,5,6,8,10,12,15,20,25,31")
    parser.add_argument("--curve", default=None, help="a verify-curve json (default: the target's in the cache)")
    parser.add_argument("--long", action="store_true", help="use the curve's long-context column")
    parser.add_argument("--head-step", type=float, default=0.021)
    parser.add_argument("--vectors", default=None,
                        help="a json file: read the rank vectors from it if it exists, else save them there")
    args = parser.parse_args()
    set_threads(None)
    run = json.loads((Path(args.bench) / "run.json").read_text())
    prompts_path = Path(args.prompts or run["settings"]["prompts"])
    prompts = {p["question_id"]: p for p in map(json.loads, prompts_path.read_text().splitlines())}
    records = [json.loads(line) for line in (Path(args.bench) / "records.jsonl").read_text().splitlines()]
    ar = {(r["question_id"], r["turn"]): r for r in records if r["label"] == "ar"}
    prefill = sum(r["time_prefill_s"] or 0.0 for r in ar.values())
    share = prefill / sum(r["wall_s"] for r in ar.values())
    if args.vectors and Path(args.vectors).is_file():
        by_category = json.loads(Path(args.vectors).read_text())
    else:
        by_category = collect(args, prompts, ar)
        if args.vectors:
            Path(args.vectors).write_text(json.dumps(by_category))
    turn_vectors = [vectors for turns in by_category.values() for vectors in turns]
    anchors = [v for vectors in turn_vectors for v in vectors]
    print(f"{len(turn_vectors)} turns, {len(anchors)} anchors; prefill {share:.1%} of our AR's time in this run; "
          f"lookup would copy at {sum(1 for v in anchors if v[1]) / len(anchors):.1%} of the anchors")
    for j in range(args.depth):
        reached = [v for v, _, _ in anchors if len(v) > j and all(r == 0 for r in v[:j])]
        cover = [sum(v[j] < k for v in reached) / max(1, len(reached)) for k in (1, 2, 4, 8)]
        print(f"step {j + 1}, given steps before it right: top-1/2/4/8 {' / '.join(f'{c:.3f}' for c in cover)} "
              f"({len(reached)} anchors)")
    curve_path = Path(args.curve) if args.curve else next(
        (Path.home() / ".cache/specdraft/verify-curves").glob(f"{args.target}-*.json"))
    curve = json.loads(curve_path.read_text())["relative_long" if args.long else "relative"]
    print(f"\nverify curve {curve_path.name} ({'long' if args.long else 'short'} context, {len(curve)} points); "
          f"a head step {args.head_step} of a target step\n")
    print("| tree | nodes | depth | verify cost | τ | decode over AR | end to end | τ, lookup first | decode | end to end |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [("chain", {(0,) * d for d in range(1, args.depth + 1)})]
    rows += [(f"best static, {n} nodes", best_tree(anchors, n, args.branch, args.depth))
             for n in map(int, args.budgets.split(","))]
    for name, tree in rows:
        cost, extrapolated = verify_cost(curve, len(tree) + 1)
        cells = []
        for lookup in (False, True):
            tau, decode = walk(turn_vectors, tree, curve, args.head_step, lookup)
            cells += [f"{tau:.2f}", f"{decode:.2f}×", f"{1 / (share + (1 - share) / decode):.2f}×"]
        print(f"| {name} | {len(tree)} | {max(len(n) for n in tree)} | {cost:.2f}{'*' if extrapolated else ''} | "
              + " | ".join(cells) + " |")
    tree = best_tree(anchors, 5, args.branch, args.depth)
    print("\nper category, best static tree of 5 nodes (chosen over all categories), lookup first: τ "
          + ", ".join(f"{c} {walk(v, tree, curve, args.head_step, True)[0]:.2f}" for c, v in sorted(by_category.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
