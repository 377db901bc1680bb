"""Is a weak EAGLE head weak, or is the engine wrong? The head's offline agreement with the target on a benchmark
run's own greedy answers, next to the acceptance the engine measured on the same turns.

    python scripts/eagle_agreement.py --head qwen1.5b-chats --bench docs/bench/eagle-chats --label "eagle[gamma=1]"

For every first turn of the run's `ar` records: the target (bf16 weights, native backend) runs once over the
prompt and its answer with the head's feature taps; the training unroll (`ttt_logits`, tested equal to the
drafter's chain) gives the head's guesses at every position for draft steps 1..3. Agreement = the guess equals
the target's greedy token, split into positions whose token lies in the prompt and in the answer. If the answer
agreement at step 1 is close to the engine's acceptance at γ = 1 (accepted / drafted of the `--label` records),
the loop is consistent and the head itself is what limits acceptance.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdraft import load_model
from specdraft.bench.runner import Conversation
from specdraft.models.adapter import set_threads
from specdraft.models.eagle_head import load_head
from specdraft.train.eagle_train import ttt_logits

PROMPTS = Path(__file__).resolve().parents[1] / "data" / "bench" / "prompts.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", required=True, help="EAGLE head name or folder")
    parser.add_argument("--bench", required=True, help="a benchmark output folder (its records.jsonl)")
    parser.add_argument("--label", default="eagle[gamma=1]", help="the records whose acceptance is compared")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--prompts", default=str(PROMPTS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    set_threads(None)
    target = load_model(args.target, "auto")
    head = load_head(args.head, target)
    records = [json.loads(line) for line in (Path(args.bench) / "records.jsonl").read_text().splitlines()]
    prompts = {p["question_id"]: p for p in map(json.loads, Path(args.prompts).read_text().splitlines())}
    engine = {(r["question_id"], r["turn"]): (r["accepted"], r["drafted"]) for r in records if r["label"] == args.label}
    prompt_hits, answer_hits = [0.0, 0], [[0.0, 0] for _ in range(args.steps)]
    for record in records:
        if record["label"] != "ar" or record["turn"] != 0:
            continue
        prompt_ids = Conversation(target, chat=True).prompt_ids(prompts[record["question_id"]]["turns"][0])
        ids = prompt_ids + record["output_ids"]
        with torch.inference_mode():
            state = target.new_state(feature_layers=tuple(head.config.target_layers))
            greedy = state.forward(ids, len(ids)).argmax(-1)  # [T]: the target's token after each position
            guesses = ttt_logits(head, torch.tensor(ids), state.features, args.steps)
        per_step = []
        for j, logits in enumerate(guesses, start=1):
            # row a: the head's guess for the token after position a + j, the target's is greedy[a + j]
            hit = (head.d2t[logits.argmax(-1)] == greedy[j: j + logits.shape[0]]).float()  # [T - j]
            in_prompt = max(len(prompt_ids) - j - 1, 0)  # rows whose guessed token is a prompt token
            answer = hit[in_prompt:]
            per_step.append(round(float(answer.mean()), 2) if len(answer) else None)
            answer_hits[j - 1][0] += float(answer.sum())
            answer_hits[j - 1][1] += len(answer)
            if j == 1:
                prompt_hits[0] += float(hit[:in_prompt].sum())
                prompt_hits[1] += in_prompt
        accepted, drafted = engine.get((record["question_id"], 0), (None, None))
        measured = f"{accepted}/{drafted} = {accepted / drafted:.2f}" if drafted else "-"
        print(f"{record['category']:14s} prompt {len(prompt_ids):4d} answer {len(record['output_ids']):3d}  "
              f"answer agreement per step {per_step}  engine ({args.label}) accepted {measured}", flush=True)
    print(f"prompt positions, step 1: {prompt_hits[0] / max(1, prompt_hits[1]):.3f}")
    print("answer positions per step: " + ", ".join(f"{h / max(1, n):.3f}" for h, n in answer_hits))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
