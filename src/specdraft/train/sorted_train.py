"""Training the exit adapters of a sorted (S2D) draft (drafters/exit_adapters.py) on this CPU.

Each step takes `windows_per_step` windows of `window` tokens of pinned-package text (the EAGLE corpus:
train/corpus.candidate_docs, chat-formatted through the draft's template; never the benchmark's sources),
runs the frozen draft over them once (no gradients; native backend, float32 weights: MKL for many rows), keeps the
residual stream at every exit, and trains only the adapters through the frozen LM head rows of the draft
vocabulary. The loss is S2D's: the mean over the exits of

  text   cross-entropy to the next token of the text (tokens outside the draft vocabulary are skipped), or
  self   cross-entropy to the draft's own last layer's distribution over the draft vocabulary (the target of
         self-speculation, and a stand-in for larger targets of the same family: no target runs in training), or
  both   their sum.

Validation (held-out windows: the last documents of the ranked corpus), at the start and at every checkpoint:
per exit, the top-1 agreement with the greedy next token of every model in `validate_against` (the targets the
draft serves; their argmax over the held-out windows is computed once and cached in the run folder). Top-1
agreement is the chance that a greedy draft token at that exit is accepted, given the same context.

Resume: checkpoints hold the adapters, the optimizer, the step and the log; the data order is a pure function of
the corpus and the step, so a resumed run reaches the same weights as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from ..errors import SpecdraftError
from ..drafters.exit_adapters import (
    AdapterConfig,
    ExitAdapters,
    adapters_root,
    draft_fingerprint,
    save_adapters,
)
from .common import CHECKPOINT, LOG, output_folder, warmup_cosine_lr, write_checkpoint
from .config import SortedTrainConfig


class WindowStream:
    """Windows of `window` tokens cut from the ranked corpus, in order, produced as far as asked (so resuming
    at step s re-tokenizes the same documents and gets the same windows)."""

    def __init__(self, tokenizer, window: int, max_len: int, held_out_docs: int, corpus: str = "packages"):
        from .chats import corpus_docs

        docs = corpus_docs(corpus)
        if len(docs) <= held_out_docs:
            raise SpecdraftError(f"the corpus has {len(docs)} documents; need more than {held_out_docs}")
        cut = len(docs) - held_out_docs
        while cut > 1 and docs[cut].source.endswith("/2"):  # a chat's second turn repeats its first: same side
            cut -= 1
        self.train_docs, self.val_docs = docs[:cut], docs[cut:]
        # which documents, in which order: a resumed run must see the same (a chats file can grow in between)
        self.fingerprint = hashlib.sha256("\n".join(d.source for d in docs).encode()).hexdigest()[:16]
        self.tokenizer, self.window, self.max_len = tokenizer, window, max_len
        self.windows: list[list[int]] = []
        self.next_doc = 0

    def _cut(self, doc) -> list[list[int]]:
        from .corpus import encode_doc

        ids = encode_doc(self.tokenizer, doc, self.max_len)
        return [ids[i: i + self.window] for i in range(0, len(ids), self.window) if len(ids) - i >= 8]

    def get(self, index: int) -> list[int]:
        while len(self.windows) <= index:
            if self.next_doc >= len(self.train_docs):
                raise SpecdraftError(f"the corpus holds {len(self.windows)} training windows of at most {self.window} "
                                     f"tokens, fewer than --steps x --windows-per-step = {index + 1}; lower --steps "
                                     f"or add text (--corpus packages+chats:NAME, or more chats)")
            self.windows.extend(self._cut(self.train_docs[self.next_doc]))
            self.next_doc += 1
        return self.windows[index]

    def validation(self, count: int) -> list[list[int]]:
        out: list[list[int]] = []
        for doc in self.val_docs:
            out.extend(self._cut(doc))
            if len(out) >= count:
                break
        return out[:count]


def greedy_next_tokens(model, tokens: list[int]) -> torch.Tensor:
    """A model's greedy next token after every prefix of `tokens`: [T] target ids."""
    return model.new_state(capacity=len(tokens)).forward(tokens, len(tokens)).argmax(-1)


class SortedTrainer:
    def __init__(self, config: SortedTrainConfig, progress: bool = True):
        from ..drafters.vocab import DraftVocab
        from ..models.adapter import load_model

        self.config = config
        self.progress = progress
        self.folder = output_folder(config.out, adapters_root())
        self.draft = load_model(config.draft, "float32", progress=progress, backend="native")
        native = self.draft.native
        n_layers = len(native.layers)
        if config.exits[-1] > n_layers:
            raise SpecdraftError(f"exits go up to {config.exits[-1]} layers but {config.draft!r} has {n_layers}")
        self.native = native
        vocab = DraftVocab.for_model(native.lm_head, self.draft.tokenizer, config.draft_vocab)
        self.vocab_ids = vocab.ids  # [V_draft]: the fixed rows (no prompt rows: training has no prompt)
        self.head_rows = native.lm_head[self.vocab_ids].float()  # [V_draft, D], frozen
        self.to_draft = torch.full((native.lm_head.shape[0],), -100, dtype=torch.long)  # target id -> row
        self.to_draft[self.vocab_ids] = torch.arange(self.vocab_ids.shape[0])
        self.stream = WindowStream(self.draft.tokenizer, config.window, config.max_len, held_out_docs=40,
                                   corpus=config.corpus)
        self.val_windows = self.stream.validation(config.validation_windows)
        self.stream.get(config.steps * config.windows_per_step - 1)  # a corpus too small fails now, not at the end
        self.n_layers = n_layers  # the teacher (self loss) and the probes' labels come from the last layer
        self.folder.mkdir(parents=True, exist_ok=True)  # only now: a refused run leaves no empty --out behind
        ckpt_path = self.folder / CHECKPOINT
        fingerprint = draft_fingerprint(native.final_norm, native.lm_head)
        adapter_config = AdapterConfig(draft=config.draft, fingerprint=fingerprint, exits=tuple(config.exits),
                                       rank=config.rank, hidden_size=native.embed.shape[1],
                                       draft_vocab=config.draft_vocab, eps=native.eps, probes=True)
        self.adapters = ExitAdapters(adapter_config, native.final_norm, seed=config.seed)
        self.optimizer = torch.optim.AdamW(self.adapters.parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay, betas=(0.9, 0.95))
        self.step = 0
        self.history: list[dict] = []
        if ckpt_path.is_file():
            ckpt = torch.load(ckpt_path, weights_only=False)
            if ckpt["train_config"] != self._identity():
                raise SpecdraftError(f"{self.folder} holds a run with other settings; choose another --out or "
                                     f"delete {ckpt_path}")
            self.adapters.load_state_dict(ckpt["adapters"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
            self.step, self.history = ckpt["step"], ckpt["history"]
        elif config.init:
            self._start_from(config.init)
        self.reference_argmax = self._reference_argmax()
        self.probe_model = None  # loaded when the first window needs the probe target's greedy tokens
        self.probe_reference_path = self.folder / "probe_reference.pt"
        self.probe_reference: dict[int, torch.Tensor] = (
            torch.load(self.probe_reference_path, weights_only=False) if self.probe_reference_path.is_file() else {})

    def _start_from(self, name_or_path: str) -> None:
        """Fine-tuning: copy trained adapters of the same shape (and the same draft: the fingerprint is checked)."""
        from ..drafters.exit_adapters import load_adapters

        start = load_adapters(name_or_path, self.native.final_norm, self.native.lm_head)
        mine, theirs = self.adapters.config, start.config
        for name in ("exits", "rank", "draft_vocab"):
            this_run, given = getattr(mine, name), getattr(theirs, name)  # exits: tuples on both sides
            if this_run != given:
                raise SpecdraftError(f"--init {name_or_path!r} has {name} {given}, this run {this_run}; pass the "
                                     f"same --{name.replace('_', '-')}")
        self.adapters.load_state_dict(start.state_dict())

    def _identity(self) -> dict:
        d = asdict(self.config)
        d["corpus_fingerprint"] = self.stream.fingerprint
        for name in ("steps", "checkpoint_every", "out"):
            d.pop(name)
        return d

    # ------------------------------------------------------------------------------------------- forward passes

    @torch.no_grad()
    def trunk(self, tokens: list[int], depth: int) -> dict[int, torch.Tensor]:
        """The frozen draft over one window: residual stream [T, D] after each of the exits, and after
        `depth` layers (the teacher's)."""
        native = self.native
        cache = native.new_cache(len(tokens))
        cache.reserve(len(tokens))
        hidden = native.embed_tokens(tokens)  # [T, D]
        wanted = set(self.config.exits) | {depth}
        out = {}
        for index in range(max(wanted)):
            hidden = native.layer_forward(index, hidden, cache, 0)
            if index + 1 in wanted:
                out[index + 1] = hidden
        return out

    @torch.no_grad()
    def teacher_probs(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The draft's own last layer, through its final norm, over the draft vocabulary: [T, V_draft]."""
        normed = self.native.ops.rms_norm(final_hidden.contiguous(), self.native.final_norm, self.native.eps)
        return F.linear(normed, self.head_rows).softmax(-1)

    def window_losses(self, tokens: list[int], window_index: int
                      ) -> tuple[list[torch.Tensor], list[float], list[torch.Tensor], list[tuple[float, float]]]:
        """Training window `window_index` of the stream: per exit, its loss (a tensor with gradients) and the top-1
        agreement with the next token; per exit but the last, its probe's loss and (accuracy, majority-answer
        rate)."""
        residuals = self.trunk(tokens, self.n_layers)
        labels = self.to_draft[torch.tensor(tokens[1:])]  # [T - 1]: the next token's row, -100 outside
        teacher = self.teacher_probs(residuals[self.n_layers][:-1])  # [T - 1, V_draft]
        last = len(self.config.exits) - 1
        losses, agreement = [None] * (last + 1), [0.0] * (last + 1)
        probe_losses, probe_stats = [], []
        fallback_top1 = None  # [T - 1]: the token the draft falls back to, the last exit's: "self" probes predict it
        target_top1 = None  # [T - 1]: or the probe target's greedy token, as a draft-vocabulary row (-100 outside)
        if self.config.probe_target != "self":
            target_top1 = self.to_draft[self.probe_labels_reference(window_index, tokens)[:-1]]
        for index in [last, *range(last)]:
            adapted = self.adapters(residuals[self.config.exits[index]][:-1], index)  # [T - 1, D]
            logits = F.linear(adapted, self.head_rows)  # [T - 1, V_draft]
            loss = logits.new_zeros(())
            if self.config.loss in ("text", "both"):
                loss = loss + F.cross_entropy(logits, labels, ignore_index=-100)
            if self.config.loss in ("self", "both"):
                loss = loss - (teacher * logits.log_softmax(-1)).sum(-1).mean()
            losses[index] = loss
            agreement[index] = float((logits.argmax(-1) == labels).float().mean())
            if index == last:
                fallback_top1 = logits.argmax(-1).detach()
                continue
            label_top1 = fallback_top1 if target_top1 is None else target_top1
            agrees = (logits.argmax(-1) == label_top1).float()  # [T - 1]
            probe = self.adapters.probe_logit(adapted.detach(), index)  # trains the probe only
            probe_losses.append(F.binary_cross_entropy_with_logits(probe, agrees))
            base_rate = float(agrees.mean())
            probe_stats.append((float(((probe > 0).float() == agrees).float().mean()), max(base_rate, 1 - base_rate)))
        return losses, agreement, probe_losses, probe_stats

    # ------------------------------------------------------------------------------------------------ training

    def lr_at(self, step: int) -> float:
        c = self.config
        return warmup_cosine_lr(step, c.steps, c.lr, c.warmup_steps, c.min_lr_ratio)

    def train_step(self, step: int) -> dict:
        c = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(step)
        self.optimizer.zero_grad(set_to_none=True)
        per_exit = [0.0] * len(c.exits)
        agree = [0.0] * len(c.exits)
        probe_loss = [0.0] * (len(c.exits) - 1)
        probe_accuracy = [0.0] * (len(c.exits) - 1)
        probe_base_rate = [0.0] * (len(c.exits) - 1)  # accuracy of always answering the majority label
        tokens = 0
        for w in range(c.windows_per_step):
            index = step * c.windows_per_step + w
            window = self.stream.get(index)
            losses, agreement, probe_losses, probe_stats = self.window_losses(window, index)
            # the probes' loss only reaches the probes (their inputs are detached); it is logged on its own
            ((sum(losses) / len(losses) + sum(probe_losses)) / c.windows_per_step).backward()
            for i, (loss, a) in enumerate(zip(losses, agreement, strict=True)):
                per_exit[i] += float(loss.detach()) / c.windows_per_step
                agree[i] += a / c.windows_per_step
            for i, (loss, (accuracy, base_rate)) in enumerate(zip(probe_losses, probe_stats, strict=True)):
                probe_loss[i] += float(loss.detach()) / c.windows_per_step
                probe_accuracy[i] += accuracy / c.windows_per_step
                probe_base_rate[i] += base_rate / c.windows_per_step
            tokens += len(window)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.adapters.parameters(), c.grad_clip))
        self.optimizer.step()
        return {"step": step + 1, "loss": sum(per_exit) / len(per_exit), "step_losses": per_exit,
                "agreement": agree, "probe_loss": probe_loss, "probe_accuracy": probe_accuracy,
                "probe_base_rate": probe_base_rate, "tokens": tokens, "lr": self.lr_at(step),
                "grad_norm": grad_norm}

    @torch.no_grad()
    def probe_labels_reference(self, window_index: int, tokens: list[int]) -> torch.Tensor:
        """The probe target's greedy next token at each position of a training window: [T] (computed once per
        window; saved with each checkpoint, so a resumed run reuses it)."""
        if window_index not in self.probe_reference:
            if self.probe_model is None:
                name = self.config.probe_target
                self.probe_model = self._served_model(name)
                if self.probe_model.vocab_size != self.to_draft.shape[0]:
                    raise SpecdraftError(f"--probe-target {name!r} has {self.probe_model.vocab_size} logits, the "
                                         f"draft {self.to_draft.shape[0]}: it must share the draft's vocabulary")
            self.probe_reference[window_index] = greedy_next_tokens(self.probe_model, tokens)
        return self.probe_reference[window_index]

    def _served_model(self, name: str):
        """A model the draft serves, by name or path, float32 (the draft itself when it is named)."""
        from ..models.adapter import load_model

        return self.draft if name == self.config.draft else load_model(name, "float32", progress=False)

    @torch.no_grad()
    def _reference_argmax(self) -> dict[str, list[torch.Tensor]]:
        """Per model in validate_against: its greedy next token at every held-out position (cached on disk)."""
        path = self.folder / "validation_reference.pt"
        cached = torch.load(path, weights_only=False) if path.is_file() else {}
        if cached.get("windows") != self.val_windows:
            cached = {"windows": self.val_windows, "argmax": {}}
        for name in self.config.validate_against:
            if name in cached["argmax"]:
                continue
            model = self._served_model(name)
            cached["argmax"][name] = [greedy_next_tokens(model, window) for window in self.val_windows]
            torch.save(cached, path)
        return cached["argmax"]

    @torch.no_grad()
    def validate(self) -> dict:
        """Per exit: top-1 agreement with each reference model's greedy token and with the text; per exit but the
        last, how often its probe says stop, and the agreement with each reference where it does."""
        c = self.config
        agree = {name: [0.0] * len(c.exits) for name in c.validate_against}
        probe_agree = {name: [0.0] * (len(c.exits) - 1) for name in c.validate_against}
        stops = [0.0] * (len(c.exits) - 1)
        text = [0.0] * len(c.exits)
        positions = 0
        for w, window in enumerate(self.val_windows):
            residuals = self.trunk(window, c.exits[-1])
            labels = torch.tensor(window[1:])
            for index, depth in enumerate(c.exits):
                adapted = self.adapters(residuals[depth], index)  # [T, D]
                drafted = self.vocab_ids[F.linear(adapted, self.head_rows).argmax(-1)]  # [T] target ids
                text[index] += float((drafted[:-1] == labels).sum())
                stop = self.adapters.probe_logit(adapted, index) > 0 if index < len(stops) else None  # [T]
                if stop is not None:
                    stops[index] += float(stop.sum())
                for name in c.validate_against:
                    same = drafted == self.reference_argmax[name][w]  # [T]
                    agree[name][index] += float(same.sum())
                    if stop is not None:
                        probe_agree[name][index] += float((same & stop).sum())
            positions += len(window)
        n_text = sum(len(w) - 1 for w in self.val_windows)
        return {"val_text_agreement": [t / n_text for t in text],
                "val_agreement": {name: [a / positions for a in values] for name, values in agree.items()},
                "val_probe_stops": [s / positions for s in stops],
                "val_probe_agreement": {name: [a / max(s, 1.0) for a, s in zip(values, stops, strict=True)]
                                        for name, values in probe_agree.items()}}

    def checkpoint(self) -> None:
        ckpt = {"train_config": self._identity(), "adapters": self.adapters.state_dict(),
                "optimizer": self.optimizer.state_dict(), "step": self.step, "history": self.history}
        if self.probe_reference:
            torch.save(self.probe_reference, self.probe_reference_path)
        write_checkpoint(self.folder, ckpt, self.history, [f"exit at layer {e}" for e in self.config.exits],
                         f"{self.config.loss} loss")

    def run(self, stop_after: int | None = None) -> ExitAdapters:
        """Train to config.steps (or stop after `stop_after` more steps: a deliberate interruption)."""
        from tqdm import tqdm

        c = self.config
        start = self.validate() if self.step == 0 else None  # the bare exits, for the before/after record
        bar = tqdm(total=c.steps, initial=self.step, unit="step", disable=not self.progress, desc="train sorted",
                   smoothing=0.05)
        started, done_now, tokens_now = time.time(), 0, 0
        while self.step < c.steps:
            if stop_after is not None and done_now >= stop_after:
                break
            record = self.train_step(self.step)
            if self.step == 0:
                record["start"] = start
            self.step += 1
            done_now += 1
            tokens_now += record["tokens"]
            record["elapsed_s"] = time.time() - started
            self.history.append(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tokens_now / max(time.time() - started, 1e-9):.0f}")
            if self.step % c.checkpoint_every == 0 or self.step == c.steps:
                self.history[-1].update(self.validate())
                self.checkpoint()
        bar.close()
        if self.step >= c.steps:
            first = next((r["start"] for r in self.history if "start" in r), None)
            self.adapters.config.extra = {"train": asdict(c), "steps": self.step,
                                          "tokens": sum(r["tokens"] for r in self.history),
                                          "before": first,
                                          "after": {k: v for k, v in self.history[-1].items() if k.startswith("val_")}}
            save_adapters(self.adapters, self.folder)
        return self.adapters


def cmd_train_sorted(args) -> int:
    from ..config import parse_int_list
    from ..models.adapter import set_threads

    set_threads(args.threads)
    config = SortedTrainConfig(out=args.out, draft=args.draft, exits=parse_int_list(args.exits, "--exits"),
                               rank=args.rank, draft_vocab=args.draft_vocab, loss=args.loss, steps=args.steps,
                               window=args.window, windows_per_step=args.windows_per_step, lr=args.lr,
                               checkpoint_every=args.checkpoint_every, seed=args.seed, corpus=args.corpus,
                               init=args.init, probe_target=args.probe_target,
                               validate_against=tuple(n for n in args.validate_against.split(",") if n))
    trainer = SortedTrainer(config)
    trainer.run()
    print(json.dumps(trainer.adapters.config.extra.get("after", {}), indent=1))
    print(f"sorted draft: {trainer.folder} ({trainer.step} steps; log {trainer.folder / LOG}, plot "
          f"{trainer.folder / 'loss.png'}); use it with --method sorted --draft {config.draft} "
          f"--sorted-draft {args.out}")
    return 0
