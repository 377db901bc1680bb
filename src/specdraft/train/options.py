"""`specdraft train` flags (no torch import here: the CLI builds its parser fast)."""

from __future__ import annotations

from .config import ChatsConfig, TrainConfig
from .prose import PROSE_KINDS


def add_train_arguments(parser) -> None:
    """`specdraft train eagle ...` and `specdraft train eagle-export ...`."""
    from ..models.fetch import DEFAULT_TARGET

    sub = parser.add_subparsers(dest="train_command", required=True)
    eagle = sub.add_parser("eagle", help="collect the target's features over the pinned-package corpus, then "
                           "train an EAGLE-3-style head (resumes both phases)")
    defaults = TrainConfig(data="", out="")
    eagle.add_argument("--target", default=DEFAULT_TARGET)
    eagle.add_argument("--out", required=True, help="head name (saved in ~/.cache/specdraft/heads/NAME) or folder")
    eagle.add_argument("--data", default=None, help="feature folder (default ~/.cache/specdraft/eagle-data/TARGET, "
                       "suffixed by the corpus); several joined by + train on all of them, collected already")
    eagle.add_argument("--collect-only", action="store_true", help="collect the features, do not train")
    eagle.add_argument("--tokens", type=int, default=60_000, help="tokens of training text to collect "
                       "(60k with the default 3 epochs: about 40 min on a quiet 2-core AVX2 machine, docs/eagle.md)")
    eagle.add_argument("--max-len", type=int, default=512, help="tokens per collected sequence")
    eagle.add_argument("--corpus", default="packages", help="training text: packages (the pinned packages' "
                       "modules and descriptions), chats:NAME (made by `specdraft train chats`), or both joined by +")
    eagle.add_argument("--collect-dtype", default="auto", help="target weights while collecting (auto: bf16 on "
                       "the native backend, the taps the head sees at inference; float32 prefills as fast here "
                       "with twice the memory: docs/eagle.md)")
    eagle.add_argument("--steps", type=int, default=None, help="training steps (default: --epochs over the data)")
    eagle.add_argument("--epochs", type=float, default=defaults.epochs)
    eagle.add_argument("--ttt-steps", type=int, default=defaults.ttt_steps, help="unrolled draft steps")
    eagle.add_argument("--window", type=int, default=defaults.window, help="tokens per training step")
    eagle.add_argument("--draft-vocab", type=int, default=None,
                       help=f"rows of the head's reduced vocabulary (default {defaults.draft_vocab}; with --init the "
                       f"head's own)")
    eagle.add_argument("--intermediate-size", type=int, default=None,
                       help=f"the head's MLP width (default {defaults.intermediate_size}; with --init the head's own)")
    eagle.add_argument("--lr", type=float, default=defaults.lr)
    eagle.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    eagle.add_argument("--seed", type=int, default=0)
    eagle.add_argument("--compute-dtype", default=defaults.compute_dtype,
                       help="the products of a training step: float32, bfloat16 (under autocast; parameters, "
                       "optimizer and the loss stay float32) or auto (bfloat16 where the CPU computes it natively)")
    eagle.add_argument("--init", default=None, help="go on from this trained head (name or folder) instead of a "
                       "fresh one: fine-tune on new features, with a fresh optimizer and schedule (see --lr)")
    eagle.add_argument("--threads", type=int, default=None)
    eagle.add_argument("--export", default=None, help="also write the EAGLE-3 layout (vLLM, SGLang) here")
    add_sorted_arguments(sub)
    add_chats_arguments(sub)
    export = sub.add_parser("eagle-export", help="write a trained head in the EAGLE-3 layout vLLM and SGLang load")
    export.add_argument("head", help="head name or folder")
    export.add_argument("out", help="output folder")
    export.add_argument("--target", default=DEFAULT_TARGET)


def add_sorted_arguments(sub) -> None:
    from .config import SortedTrainConfig

    d = SortedTrainConfig(out="")
    p = sub.add_parser("sorted", help="train the exit adapters of a sorted (S2D) draft on the pinned-package corpus "
                       "(resumes; saved to ~/.cache/specdraft/sorted/NAME)")
    p.add_argument("--out", required=True, help="name (saved in ~/.cache/specdraft/sorted/NAME) or folder")
    p.add_argument("--draft", default=d.draft)
    p.add_argument("--exits", default=",".join(map(str, d.exits)), help="layer counts of the exits, ascending")
    p.add_argument("--rank", type=int, default=d.rank, help="rank of each exit's residual adapter")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help="LM-head rows the exits score")
    p.add_argument("--loss", default=d.loss, help="text (next-token cross-entropy), self (toward the draft's own "
                   "last layer) or both")
    p.add_argument("--corpus", default=d.corpus, help="training text: packages, chats:NAME (made by "
                   "`specdraft train chats`), or both joined by +")
    p.add_argument("--init", default=None, help="start from trained adapters (a name, e.g. the shipped "
                   "qwen2.5-coder-0.5b-instruct-sorted, or a folder) and fine-tune them on --corpus")
    p.add_argument("--probe-target", default=d.probe_target, help="what the exit probes predict agreement with: self "
                   "(the draft's last exit) or a served model (its greedy token; runs it once over every window, "
                   "cached in the run folder)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--window", type=int, default=d.window, help="tokens per window")
    p.add_argument("--windows-per-step", type=int, default=d.windows_per_step)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--validate-against", default=",".join(d.validate_against),
                   help="models whose greedy tokens the held-out agreement is measured against (comma list)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)


def _kinds(value: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in value.split(",") if k.strip())


def add_chats_arguments(sub) -> None:
    d = ChatsConfig(out="")
    p = sub.add_parser("chats", help="chat-style training text: prompts built from the pinned packages, answered "
                       "by a model (resumes; saved to ~/.cache/specdraft/chats/NAME); train on it with "
                       "--corpus chats:NAME")
    p.add_argument("--out", required=True, help="name (saved in ~/.cache/specdraft/chats/NAME) or folder")
    p.add_argument("--model", default=d.model, help="the model that answers (a small one of the served family)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="stop once the answers hold this many tokens")
    p.add_argument("--per-kind", type=int, default=d.per_kind, help="prompts built per kind")
    p.add_argument("--batch", type=int, default=d.batch, help="prompts decoded together")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--kinds", type=_kinds, default=d.kinds,
                   help=f"comma-separated prompt kinds (default all: {','.join(d.kinds)}); the prose kinds "
                   f"({', '.join(PROSE_KINDS)}) need no package scan, so they start at once")
    p.add_argument("--dtype", default=d.dtype, help="the answering model's weights (auto: bfloat16 where the CPU "
                   "computes it natively, float32 elsewhere); recorded, and a resumed run must keep it")
    p.add_argument("--threads", type=int, default=None)
