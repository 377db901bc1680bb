"""How far can trees take this head? The best static tree for each node budget, chosen on the benchmark's own
greedy answers (an optimistic ceiling: the shape is fitted to the very text it is scored on).

    python scripts/eagle_tree_ceiling.py --head qwen1.5b-s15 --bench out/heldout-1.5b \
        --curve docs/perf/verify-curve-1.5b-32-zen4-2026-12-02.json

(`--bench` is a greedy benchmark run's folder with its records.jsonl: run the bench command of
docs/bench/2026-12-02-heldout-1.5b, given in docs/benchmarks.md, with `--out out/heldout-1.5b`.)

For every `ar` turn of the run (all turns; later turns see the earlier `ar` answers, as the benchmark builds
them): the target (bf16, native) runs once over prompt + answer with the head's feature taps, and the training
unroll (`ttt_logits`, tested equal to the drafter's chain) gives the head's logits at every anchor for draft
steps 1..D along the answer's own tokens. At anchor a (the target's features known through position a, token
a + 1 already the target's), step j guesses token a + 1 + j; its rank r_j is the place of the answer's token in
the head's draft-vocabulary logits (a token outside the draft vocabulary never ranks).

A static tree is a prefix-closed set of rank paths (r_1, ..., r_d); drafting it costs one head call per depth,
and it keeps the answer's tokens up to the longest prefix of the anchor's rank vector that is a node (ranks tie
optimistically: a token level with another counts as ahead of it). Per budget N the script picks the N nodes
that the most anchors reach (greedy over children of chosen nodes; optimal for the mean kept length over all
anchors, since a node is reached no more often than its parent; the walk's τ visits only some anchors, so this
is the best shape by that mean, not strictly by τ), then walks each answer pass by pass as the engine would (a
pass emits the kept tokens plus one of the target's). The chain (γ = D, ranks 0 only) is the first row; trees
are searched with up to `--branch` children a node and `--depth` levels.

With lookup first (its default n-grams), a chain pass where lookup would copy verifies the copy instead (the
engine's rule); a tree pass keeps the longer of the copy and the tree at a verify cost of max(N, copy) + 1
tokens (the engine merges the copy into the tree, dropping tree nodes past the budget: an upper bound). The
lookup columns' trees are fitted on the anchors where lookup would not copy.

Decode speedup over AR per pass: τ / (verify cost + head steps), the verify cost from the target's measured
curve (`--curve`, relative to one token; past its last point extrapolated along its last slope, marked *), a
head step at `--head-step` of a target step (γ auto's price of a head step). End to end at the run's own prefill
share of our AR's time: 1 / (share + (1 − share) / decode). `--alpha` adds what a better head would give,
`--fit-on` fits the shapes on another run's vectors.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from specdraft import load_model
from specdraft.bench.methods import TurnOutput
from specdraft.bench.runner import Conversation
from specdraft.bench.suite import load_prompts
from specdraft.config import AUTO_LOOKUP_FIRST
from specdraft.registry import LookupOptions
from specdraft.drafters.prompt_lookup import find_continuation
from specdraft.models.adapter import set_threads
from specdraft.drafters.eagle_head import load_head
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
        copy = find_continuation(ids[: a + 2], depth, LookupOptions.lookup_max_ngram, AUTO_LOOKUP_FIRST)
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


def walk(turn_vectors, tree: set[tuple[int, ...]], curve: list[float], head_step: float, lookup: str = "off"
         ) -> tuple[float, float]:
    """(τ, decode speed over AR) over every answer, pass by pass. `lookup` (where lookup first would copy):
    "off" ignores the copy; "replace" verifies the copy instead of the drafter's chain (the engine's rule for
    chains); "merge" keeps the longer of the copy and the tree at a verify cost of max(nodes, copy) + 1 tokens
    (the engine merges the copy into the tree within max(budget, copy) nodes, `with_copy_branch`, so this is an
    upper bound of what it keeps)."""
    tokens = passes = cost = 0.0
    head_cost = head_step * max(len(n) for n in tree)
    for vectors in turn_vectors:
        a = 0
        while a < len(vectors):
            ranks, copied, copy_kept = vectors[a]
            step, pass_cost = kept(ranks, tree) + 1, verify_cost(curve, len(tree) + 1)[0] + head_cost
            if copied and lookup == "replace":
                step, pass_cost = copy_kept + 1, verify_cost(curve, copied + 1)[0]
            elif copied and lookup == "merge":
                step = max(step, copy_kept + 1)
                pass_cost = verify_cost(curve, max(len(tree), copied) + 1)[0] + head_cost
            tokens += min(step, len(vectors) - a)
            passes += 1
            cost += pass_cost
            a += step
    return tokens / passes, tokens / cost


def with_alpha(turn_vectors, alpha: float, seed: int = 0):
    """The same answers and copies, with a head that is right with probability `alpha` at every step,
    independently (rank 0), and otherwise wrong (rank 1): what a better head would give."""
    rng = random.Random(seed)
    return [[([0 if rng.random() < alpha else 1 for _ in ranks], copied, copy_kept)
             for ranks, copied, copy_kept in vectors] for vectors in turn_vectors]


def verify_cost(curve: list[float], n_tokens: int) -> tuple[float, bool]:
    if n_tokens <= len(curve):
        return curve[n_tokens - 1], False
    slope = curve[-1] - curve[-2]
    return curve[-1] + slope * (n_tokens - len(curve)), True


def collect(args, prompts: dict, ar: dict, chat: bool) -> dict[str, list]:
    """Rank vectors per category, per turn (see rank_vectors)."""
    target = load_model(args.target, "auto")
    head = load_head(args.head, target)
    by_category: dict[str, list] = {}
    for qid in dict.fromkeys(q for q, _ in ar):
        conversation = Conversation(target, chat=chat)
        for turn, text in enumerate(prompts[qid]["turns"]):
            record = ar.get((qid, turn))
            if record is None:
                break
            prompt_ids = conversation.prompt_ids(text)
            vectors = rank_vectors(target, head, prompt_ids, record["output_ids"], args.depth)
            by_category.setdefault(record["category"], []).append(vectors)
            conversation.answered(prompt_ids, TurnOutput(record["output_ids"], record["text"], record["wall_s"]))
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
                        help="a json file: read the rank vectors from it if it was made for this head, bench and "
                             "depth, else compute them and save them there")
    parser.add_argument("--fit-on", default=None,
                        help="another --vectors file: fit the trees on its anchors (does a shape transfer?)")
    parser.add_argument("--alpha", default="0.5,0.6,0.7,0.75,0.8,0.85,0.9",
                        help="what-if: a γ = 6 chain with lookup first, for a head right with these probabilities")
    args = parser.parse_args()
    set_threads(None)
    bench = Path(args.bench)
    settings = json.loads((bench / "run.json").read_text(encoding="utf-8"))["settings"]
    if settings.get("temperature", 0.0) != 0.0:
        raise SystemExit(f"{bench} sampled at temperature {settings['temperature']}: the walk needs greedy answers")
    prompts = {p["question_id"]: p for p in load_prompts(args.prompts or settings.get("prompts"), None, None)}
    records = [json.loads(line) for line in (bench / "records.jsonl").read_text(encoding="utf-8").split("\n")
               if line.strip()]
    ar = {(r["question_id"], r["turn"]): r for r in records if r["label"] == "ar"}
    if any(r.get("time_prefill_s") is None for r in ar.values()):
        raise SystemExit(f"{bench}: some `ar` records have no prefill time; the end-to-end column needs them")
    share = sum(r["time_prefill_s"] for r in ar.values()) / sum(r["wall_s"] for r in ar.values())
    made_for = {"head": args.head, "bench": str(bench), "depth": args.depth}
    saved = json.loads(Path(args.vectors).read_text()) if args.vectors and Path(args.vectors).is_file() else None
    if saved is not None and saved.get("made_for") == made_for:
        by_category = saved["by_category"]
    else:
        by_category = collect(args, prompts, ar, settings.get("chat", True))
        if args.vectors:
            Path(args.vectors).write_text(json.dumps({"made_for": made_for, "by_category": by_category}))
    turn_vectors = [vectors for turns in by_category.values() for vectors in turns]
    anchors = [v for vectors in turn_vectors for v in vectors]
    fit_anchors = anchors
    if args.fit_on:
        fit_anchors = [v for turns in json.loads(Path(args.fit_on).read_text())["by_category"].values()
                       for vectors in turns for v in vectors]
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
          f"a head step {args.head_step} of a target step; trees fitted on "
          f"{args.fit_on or 'these anchors'} (the lookup columns' on the anchors where lookup would not copy)\n")

    def end_to_end(decode: float) -> str:
        return f"{1 / (share + (1 - share) / decode):.2f}×"

    print("| tree | nodes | depth | verify cost | τ, head alone | decode | end to end | τ, lookup first | decode "
          "| end to end |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    chain = {(0,) * d for d in range(1, args.depth + 1)}
    uncopied = [v for v in fit_anchors if not v[1]]
    rows = [("chain", chain, chain, "replace")]
    rows += [(f"best static, {n} nodes", best_tree(fit_anchors, n, args.branch, args.depth),
              best_tree(uncopied, n, args.branch, args.depth), "merge") for n in map(int, args.budgets.split(","))]
    for name, tree, tree_with_copies, rule in rows:
        cost, extrapolated = verify_cost(curve, len(tree) + 1)
        tau, decode = walk(turn_vectors, tree, curve, args.head_step)
        tau_copies, decode_copies = walk(turn_vectors, tree_with_copies, curve, args.head_step, rule)
        print(f"| {name} | {len(tree)} | {max(len(n) for n in tree)} | {cost:.2f}{'*' if extrapolated else ''} | "
              f"{tau:.2f} | {decode:.2f}× | {end_to_end(decode)} | {tau_copies:.2f} | {decode_copies:.2f}× | "
              f"{end_to_end(decode_copies)} |")
    tree = best_tree(uncopied, 5, args.branch, args.depth)
    print(f"\nper category, best static tree of 5 nodes {sorted(tree)}, lookup first (merged): τ "
          + ", ".join(f"{c} {walk(v, tree, curve, args.head_step, 'merge')[0]:.2f}"
                      for c, v in sorted(by_category.items())))
    print("\nwhat-if, a γ = 6 chain with lookup first for a head right with probability α at every step: "
          + "; ".join(f"α {alpha}: τ {t:.2f}, decode {d:.2f}×, end to end {end_to_end(d)}"
                      for alpha in map(float, args.alpha.split(","))
                      for t, d in [walk(with_alpha(turn_vectors, alpha), chain, curve, args.head_step, "replace")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
