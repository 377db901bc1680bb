"""Training an EAGLE head with training-time test (EAGLE-3): the head is unrolled on its own outputs.

For a collected sequence of T tokens t_0..t_{T-1} with the target's taps f_i and target distributions p_i
(p_i = the target's next-token distribution at position i, recomputed from its final-normed state through
its LM head restricted to the draft vocabulary, renormalised there), one training step runs, for every anchor
position a = 0..T-2 at once:

  step 1  row (fc(f_a), t_{a+1}) at position a, attending to step-1 rows 0..a      -> predicts p_{a+1}
  step j  row (out_{j-1}(a), t_{a+j}) at position a+j-1, attending to step-1 rows 0..a and to the rows of
          steps 2..j of the same anchor (exactly the rows the head's cache holds when it drafts token j)
                                                                                    -> predicts p_{a+j}

The loss is sum_j w^(j-1) * CE(p_{a+j}, head_j(a)) over anchors with a + j <= T - 1 (soft targets: the
target's whole distribution over the draft vocabulary), w = 0.8 by default. Gradients flow through the
unrolled steps. AdamW, linear warmup then cosine decay.

Resume: every `checkpoint_every` steps the head, the optimizer and the log are saved atomically; the data
order is a pure function of (seed, epoch) and nothing else draws random numbers, so a resumed run reaches
the same state as an uninterrupted one (tests/test_eagle.py checks it).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import SpecdraftError
from ..models import fetch
from ..drafters.eagle_head import (
    EagleHead,
    EagleHeadConfig,
    head_config_for,
    head_from_tensors,
    heads_root,
    new_head,
    read_head,
    resolve_head_path,
    save_head,
    target_mismatches,
)
from .common import CHECKPOINT, LOG, output_folder, warmup_cosine_lr, write_checkpoint
from .config import TrainConfig
from .eagle_data import FeatureStores, split_folders


@dataclass
class TargetTensors:
    """The target weights the head trains against: embedding, LM head and final norm (read from safetensors,
    not the whole model), plus its Hugging Face config."""

    hf_config: object
    embed: torch.Tensor  # [V, D]
    lm_head: torch.Tensor  # [V, D]
    final_norm: torch.Tensor  # [D]

    @classmethod
    def load(cls, model_path: str) -> TargetTensors:
        from safetensors import safe_open
        from transformers import AutoConfig

        folder = Path(model_path)
        fetch.add_float_weights(folder)  # a packaged model fetched with its GGUF only: fp32 safetensors, once
        config = AutoConfig.from_pretrained(folder)
        wanted = {"model.embed_tokens.weight": None, "lm_head.weight": None, "model.norm.weight": None}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                names = set(f.keys())  # a safetensors handle is not a container
                for name in wanted:
                    if name in names:
                        wanted[name] = f.get_tensor(name).float()
        if wanted["model.embed_tokens.weight"] is None or wanted["model.norm.weight"] is None:
            raise SpecdraftError(f"{folder} has no embed_tokens / norm weights in safetensors files")
        lm_head = wanted["lm_head.weight"] if wanted["lm_head.weight"] is not None else wanted[
            "model.embed_tokens.weight"]  # tied embeddings
        return cls(config, wanted["model.embed_tokens.weight"], lm_head, wanted["model.norm.weight"])


def choose_draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent target ids (ties: lower id first), ascending. counts: [V] int64."""
    order = sorted(range(counts.shape[0]), key=lambda i: (-int(counts[i]), i))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def ttt_losses(head: EagleHead, tokens: torch.Tensor, taps: torch.Tensor, target_probs: torch.Tensor,
               ttt_steps: int, start: int = 0) -> tuple[list[torch.Tensor], list[float]]:
    """The unrolled forward of one window of a sequence (see the module docstring).

    tokens [T] int64; taps [T, 3, D_t] float32; target_probs [T, V_draft] float32 (row i = p_i); `start` is
    the window's first position in its sequence (rotary positions; the window attends only within itself).
    Returns per unrolled step the mean soft cross-entropy (a tensor) and the top-1 agreement with the target.
    """
    losses, agreement = [], []
    for j, logits in enumerate(ttt_logits(head, tokens, taps, ttt_steps, start), start=1):
        wanted = target_probs[j: j + logits.shape[0]]  # [valid, V_draft]: p_{a + j}
        losses.append(-(wanted * logits.float().log_softmax(-1)).sum(-1).mean())
        agreement.append(float((logits.argmax(-1) == wanted.argmax(-1)).float().mean()))
    return losses, agreement


def ttt_logits(head: EagleHead, tokens: torch.Tensor, taps: torch.Tensor, ttt_steps: int,
               start: int = 0) -> list[torch.Tensor]:
    """Per unrolled step j, the head's draft-vocabulary logits [T - j, V_draft] of every anchor whose target
    position a + j exists (row a: what the head drafts as token j after the committed rows 0..a)."""
    c = head.config
    n = tokens.shape[0] - 1  # anchors a = 0..T-2
    group = c.num_attention_heads // c.num_key_value_heads
    scale = 1.0 / math.sqrt(c.head_dim)
    anchors = torch.arange(n)
    causal = anchors[None, :] <= anchors[:, None]  # [n, n]: step-1 key b visible to anchor a when b <= a
    hidden = head.fuse(taps[:n])  # [n, D]
    step1_keys = step1_values = None
    own_keys: list[torch.Tensor] = []  # per step >= 2: [H, n, Dh], the anchor's own rows
    own_values: list[torch.Tensor] = []
    per_step = []
    for j in range(1, ttt_steps + 1):
        valid = n - (j - 1)  # anchors whose target position a + j exists (a + j <= T - 1)
        if valid <= 0:
            break
        next_ids = tokens[torch.clamp(anchors + j, max=tokens.shape[0] - 1)]  # [n]
        q, k, v = head.qkv(hidden, next_ids, start + anchors + (j - 1))  # [n, H|Hkv, Dh]
        q = q.transpose(0, 1)  # [H, n, Dh]
        k = k.transpose(0, 1).repeat_interleave(group, 0)  # [H, n, Dh]
        v = v.transpose(0, 1).repeat_interleave(group, 0)
        if j == 1:
            step1_keys, step1_values = k, v
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)  # [H, n, Dh]
        else:
            own_keys.append(k)
            own_values.append(v)
            scores = (q @ step1_keys.transpose(1, 2)) * scale  # [H, n, n]
            scores = scores.masked_fill(~causal, float("-inf"))
            diag = torch.stack([(q * key).sum(-1) for key in own_keys], dim=-1) * scale  # [H, n, j - 1]
            weights = torch.cat([scores, diag], dim=-1).float().softmax(dim=-1)  # [H, n, n + j - 1]
            attended = weights[..., :n] @ step1_values  # [H, n, Dh]
            for s, value in enumerate(own_values):
                attended = attended + weights[..., n + s: n + s + 1] * value
        out = head.finish(hidden, attended.transpose(0, 1).reshape(n, -1))  # [n, D]
        per_step.append(head.draft_logits(out[:valid]))  # [valid, V_draft]
        hidden = out
    return per_step


class Trainer:
    """One training run: builds or resumes the head, steps, checkpoints, logs, plots, saves."""

    def __init__(self, config: TrainConfig, progress: bool = True):
        self.config = config
        self.progress = progress
        self.store = FeatureStores(split_folders(config.data))
        meta = self.store.meta
        # (sequence, start, length) windows; held out: the last sequences of each folder's ranked corpus
        train_sequences, val_sequences, offset = [], [], 0
        for store in self.store.stores:
            usable = [offset + j for j, s in enumerate(store.sequences) if s["length"] >= 8]  # numbered across
            offset += len(store.sequences)
            if len(usable) < 2:
                raise SpecdraftError(f"{store.folder} holds {len(usable)} usable sequences; collect more (--tokens)")
            n_val = max(1, int(len(usable) * config.validation_fraction))
            train_sequences += usable[:-n_val]
            val_sequences += usable[-n_val:]
        self.train_ids = self._windows(train_sequences)
        self.val_ids = self._windows(val_sequences)
        self.folder = output_folder(config.out, heads_root())
        self.folder.mkdir(parents=True, exist_ok=True)
        self.target = TargetTensors.load(meta["target_path"])
        self.steps = config.steps or max(1, int(config.epochs * len(self.train_ids)))
        ckpt_path = self.folder / CHECKPOINT
        if ckpt_path.is_file():
            ckpt = torch.load(ckpt_path, weights_only=False)
            # checkpoints from before --compute-dtype were fp32, from before --init none went on from a head
            stored = {"compute_dtype": "float32", "init": None, **ckpt["train_config"]}
            if stored != self._identity():
                raise SpecdraftError(f"{self.folder} holds a run with other settings; choose another --out or "
                                     f"delete {ckpt_path}")
            head_config = EagleHeadConfig.from_dict(ckpt["head_config"])
            self.head = EagleHead(head_config, self.target.embed)
            self.head.load_state_dict(ckpt["head"])
            self.optimizer = self._optimizer()
            self.optimizer.load_state_dict(ckpt["optimizer"])
            self.step = ckpt["step"]
            self.history = ckpt["history"]
        elif config.init:
            self.head = self._initial_head(config.init)
            self.optimizer = self._optimizer()
            self.step = 0
            self.history = []
        else:
            counts = torch.zeros(meta["vocab_size"], dtype=torch.long)
            for i in sorted({w[0] for w in self.train_ids}):
                counts += torch.bincount(self.store.sequence(i)[0], minlength=meta["vocab_size"])
            draft_to_target = choose_draft_vocab(counts, config.draft_vocab)
            head_config = head_config_for(meta["target"], self.target.hf_config, meta["vocab_size"],
                                          tuple(meta["layers"]), config.draft_vocab, meta["vocab_hash"],
                                          config.intermediate_size)
            covered = float(counts[draft_to_target].sum()) / max(1, int(counts.sum()))
            head_config.extra = {"data": "+".join(str(store.folder) for store in self.store.stores),
                                 "data_tokens": self.store.n_tokens,
                                 "collect_dtype": "+".join(str(store.meta.get("collect_dtype"))
                                                           for store in self.store.stores),
                                 "train": asdict(config),
                                 "draft_vocab_coverage": covered}
            self.head = new_head(head_config, self.target.embed, self.target.lm_head, self.target.final_norm,
                                 draft_to_target, seed=config.seed)
            self.optimizer = self._optimizer()
            self.step = 0
            self.history: list[dict] = []
        self.draft_lm_head = self.target.lm_head[self.head.d2t]  # [V_draft, D]: the target's head, draft rows

    def _initial_head(self, name: str) -> EagleHead:
        """`--init NAME`: a trained head to go on from, checked against these features' target; it keeps its own
        shapes and draft vocabulary (the settings that would choose them must agree), with a fresh optimizer and
        learning-rate schedule."""
        meta, config, hf_config = self.store.meta, self.config, self.target.hf_config
        head_config, tensors = read_head(name)
        problems = target_mismatches(head_config, hf_config.hidden_size, meta["vocab_size"], meta["vocab_hash"])
        if list(head_config.target_layers) != list(meta["layers"]):
            problems.append(f"taps at layers {head_config.target_layers}, the features' at {meta['layers']}")
        if problems:
            raise SpecdraftError(f"--init {name}: that head was trained for {head_config.target!r}, not for these "
                                 f"features of {meta['target']!r} ({'; '.join(problems)})")
        wanted = {"--draft-vocab": (config.draft_vocab, head_config.draft_vocab_size),
                  "--intermediate-size": (config.intermediate_size or hf_config.intermediate_size,
                                          head_config.intermediate_size)}
        for option, (asked, has) in wanted.items():
            if asked != has:  # the command line leaves these to the head; the API must agree with it
                raise SpecdraftError(f"--init {name} has {option.removeprefix('--')} {has}, not {asked}: leave "
                                     f"{option} out")
        head_config.extra = {"init": name, "init_extra": head_config.extra,  # the starting head's provenance
                             "data": "+".join(str(store.folder) for store in self.store.stores),
                             "data_tokens": self.store.n_tokens, "train": asdict(config)}
        return head_from_tensors(head_config, tensors, self.target.embed, f"--init {name}")

    def _windows(self, sequences: list[int]) -> list[tuple[int, int, int]]:
        out = []
        for i in sequences:
            length = self.store.sequences[i]["length"]
            for start in range(0, length, self.config.window):
                if length - start >= 8:
                    out.append((i, start, min(self.config.window, length - start)))
        return out

    def _identity(self) -> dict:
        """The settings a checkpoint must share to be resumed (everything but the step count)."""
        d = asdict(self.config)
        d.pop("steps")
        d.pop("checkpoint_every")
        d["data"] = "+".join(str(Path(folder).expanduser().resolve()) for folder in split_folders(d["data"]))
        if d["init"]:  # a name or a path to the same head is the same run
            try:
                d["init"] = str(resolve_head_path(d["init"]).resolve())
            except SpecdraftError:
                pass  # gone since: the checkpoint holds the head, compare as given
        return d

    def _optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.head.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.config.lr, weight_decay=self.config.weight_decay,
                                 betas=(0.9, 0.95))

    def lr_at(self, step: int) -> float:
        c = self.config
        return warmup_cosine_lr(step, self.steps, c.lr, c.warmup_steps, c.min_lr_ratio)

    def window_for_step(self, step: int) -> tuple[int, int, int]:
        """The data order: a permutation per epoch drawn from (seed, epoch) alone."""
        epoch, index = divmod(step, len(self.train_ids))
        order = torch.randperm(len(self.train_ids), generator=torch.Generator().manual_seed(
            self.config.seed * 100_003 + epoch))
        return self.train_ids[int(order[index])]

    def _batch(self, window: tuple[int, int, int]):
        index, start, length = window
        tokens, taps, final = self.store.sequence(index, start, length)
        with torch.no_grad():
            target_probs = (final @ self.draft_lm_head.T).softmax(-1)  # [T, V_draft]
        return tokens, taps, target_probs

    def compute(self):
        """The context a forward pass runs in: bf16 autocast when `compute_dtype` says so."""
        if self.config.compute_dtype == "bfloat16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, step: int) -> dict:
        c = self.config
        window = self.window_for_step(step)
        tokens, taps, target_probs = self._batch(window)
        self.head.train()
        with self.compute():
            losses, agreement = ttt_losses(self.head, tokens, taps, target_probs, c.ttt_steps, start=window[1])
        loss = sum(c.step_weight ** j * l for j, l in enumerate(losses))
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(step)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.head.parameters(), c.grad_clip))
        self.optimizer.step()
        return {"step": step + 1, "loss": float(loss.detach()), "step_losses": [float(l.detach()) for l in losses],
                "agreement": agreement, "tokens": int(tokens.shape[0]), "lr": self.lr_at(step),
                "grad_norm": grad_norm}

    @torch.no_grad()
    def validate(self) -> dict:
        """Mean per-step loss and top-1 agreement with the target on the held-out sequences."""
        self.head.eval()
        sums, agree, weight = [0.0] * self.config.ttt_steps, [0.0] * self.config.ttt_steps, 0
        for window in self.val_ids:
            tokens, taps, target_probs = self._batch(window)
            with self.compute():
                losses, agreement = ttt_losses(self.head, tokens, taps, target_probs, self.config.ttt_steps,
                                               start=window[1])
            for j, (l, a) in enumerate(zip(losses, agreement)):
                sums[j] += float(l) * tokens.shape[0]
                agree[j] += a * tokens.shape[0]
            weight += tokens.shape[0]
        return {"val_step_losses": [s / weight for s in sums], "val_agreement": [a / weight for a in agree]}

    def checkpoint(self) -> None:
        ckpt = {"train_config": self._identity(), "head_config": asdict(self.head.config),
                "head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                "history": self.history}
        write_checkpoint(self.folder, ckpt, self.history, "draft step {}", "cross-entropy to the target")

    def run(self, stop_after: int | None = None) -> EagleHead:
        """Train to `self.steps` (or stop after `stop_after` more steps: a deliberate interruption)."""
        from tqdm import tqdm

        bar = tqdm(total=self.steps, initial=self.step, unit="step", disable=not self.progress, desc="train",
                   smoothing=0.05)
        started, done_now, tokens_now = time.time(), 0, 0
        while self.step < self.steps:
            if stop_after is not None and done_now >= stop_after:
                break
            record = self.train_step(self.step)
            self.step += 1
            done_now += 1
            tokens_now += record["tokens"]
            record["elapsed_s"] = time.time() - started
            self.history.append(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc1=f"{record['agreement'][0]:.2f}",
                            tok_s=f"{tokens_now / max(time.time() - started, 1e-9):.0f}")
            if self.step % self.config.checkpoint_every == 0 or self.step == self.steps:
                if self.step == self.steps:
                    self.history[-1].update(self.validate())
                self.checkpoint()
        bar.close()
        if self.step >= self.steps:
            self.head.config.extra["steps"] = self.step
            self.head.config.extra["final"] = {k: v for k, v in self.history[-1].items() if k.startswith("val_")}
            save_head(self.head, self.folder)
        return self.head


# ---------------------------------------------------------------------------------------------- command line

def cmd_train(args) -> int:
    from ..models.adapter import load_model, set_threads
    from ..drafters.eagle_head import export_eagle3, load_head
    from .eagle_data import CollectConfig, collect

    if args.train_command == "eagle-export":
        target = load_model(args.target, "auto", progress=False)
        print(export_eagle3(load_head(args.head, target), args.out))
        return 0
    set_threads(args.threads)
    folder = Path(args.target).name
    if args.corpus != "packages":  # one feature folder per corpus
        folder += "-" + args.corpus.replace(":", "-").replace("+", "_").replace("/", "_")
    data = args.data or str(Path("~/.cache/specdraft/eagle-data").expanduser() / folder)
    # the head's shapes: as given, else an --init head's own (a wrong name fails here, before the collection),
    # else the defaults
    shapes = {name: value for name in ("draft_vocab", "intermediate_size")
              if (value := getattr(args, name)) is not None}
    if args.init:
        init_config = read_head(args.init)[0]
        shapes = {"draft_vocab": init_config.draft_vocab_size, "intermediate_size": init_config.intermediate_size,
                  **shapes}
    # the training settings are checked before a collection that may take an hour
    config = TrainConfig(data=data, out=args.out, steps=args.steps, epochs=args.epochs, ttt_steps=args.ttt_steps,
                         window=args.window, lr=args.lr, checkpoint_every=args.checkpoint_every, seed=args.seed,
                         compute_dtype=args.compute_dtype, init=args.init, **shapes)
    if len(split_folders(data)) > 1:  # several folders: collected already (each by its own --corpus run)
        print(f"training on the collected folders {data} (nothing is collected with several --data folders)")
    else:
        collect(CollectConfig(target=args.target, out=data, tokens=args.tokens, max_len=args.max_len,
                              dtype=args.collect_dtype, threads=args.threads, corpus=args.corpus))
    if args.collect_only:
        print(f"features: {data}; train on them (and other folders: --data A+B) with the same command without "
              f"--collect-only")
        return 0
    trainer = Trainer(config)
    head = trainer.run()
    print(f"head: {trainer.folder} ({trainer.step} steps; log {trainer.folder / LOG}, plot "
          f"{trainer.folder / 'loss.png'}); use it with --method eagle --eagle-head {args.out}")
    if args.export:
        print(f"EAGLE-3 layout: {export_eagle3(head, args.export)}")
    return 0
