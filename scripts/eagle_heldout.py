"""Several EAGLE heads on one held-out set: a training run's (the last 3 % of each data folder's sequences).

    python scripts/eagle_heldout.py --data A+B+C --run qwen1.5b-s15 qwen1.5b-s15 qwen1.5b-s14

`--data` and `--run` name a finished training run (its checkpoint fixes the split); each head named after them
is scored on that run's held-out windows: top-1 agreement and soft cross-entropy per draft step (as training
validates), and the expected acceptance at temperature 1 of a guess sampled from the head's q, sum_x min(p, q),
also for q sharpened to q^(1/s) (`--sharpen`; still exact in the engine, which accepts with the q it drew from).
p is the target's distribution over the scored head's draft vocabulary. A head trained on some of these folders
held out the same sequences of them only if it was trained with the same window and validation fraction.
"""

from __future__ import annotations

import argparse
import json

import torch
from safetensors.torch import load_file

from specdraft.models.adapter import set_threads
from specdraft.drafters.eagle_head import EagleHead, EagleHeadConfig, resolve_head_path
from specdraft.train.config import TrainConfig
from specdraft.train.eagle_train import Trainer, ttt_logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--run", required=True, help="the training run's --out")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--sharpen", default="1.0,0.8")
    parser.add_argument("--validation-fraction", type=float, default=0.03,
                        help="sequences held out of each folder (0.99: score a folder no head was trained on)")
    parser.add_argument("heads", nargs="+")
    args = parser.parse_args()
    set_threads(2)
    trainer = Trainer(TrainConfig(data=args.data, out=args.run, window=args.window, epochs=args.epochs,
                                  validation_fraction=args.validation_fraction),
                      progress=False)
    scales = [float(s) for s in args.sharpen.split(",")]
    for name in args.heads:
        folder = resolve_head_path(name)
        head = EagleHead(EagleHeadConfig.from_dict(json.loads((folder / "head.json").read_text())),
                         trainer.target.embed)
        head.load_state_dict(load_file(str(folder / "head.safetensors")))
        trainer.head, trainer.draft_lm_head = head.eval(), trainer.target.lm_head[head.d2t]
        scores = trainer.validate()
        kept = {s: [0.0] * trainer.config.ttt_steps for s in scales}
        rows = [0] * trainer.config.ttt_steps
        with torch.inference_mode():
            for window in trainer.val_ids:
                tokens, taps, target_probs = trainer._batch(window)
                for j, logits in enumerate(ttt_logits(head, tokens, taps, trainer.config.ttt_steps, window[1])):
                    wanted = target_probs[j + 1: j + 1 + logits.shape[0]]  # [valid, V_draft]
                    rows[j] += logits.shape[0]
                    for s in scales:
                        kept[s][j] += float(torch.minimum(wanted, (logits / s).softmax(-1)).sum())
        print(f"{name}: agreement " + " / ".join(f"{a:.3f}" for a in scores["val_agreement"])
              + ", loss " + " / ".join(f"{a:.3f}" for a in scores["val_step_losses"])
              + "".join(f", expected T=1 acceptance (s {s}) " + " / ".join(f"{k / max(1, n):.3f}"
                                                                       for k, n in zip(kept[s], rows))
                        for s in scales), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
