"""Training data for an EAGLE head: documents of a corpus (train/corpus.py), run through the target, features on
disk.

On disk (one folder), appended one sequence at a time so that an interrupted collection resumes:
  tokens.i32     [N] int32, every sequence back to back
  taps.bf16      [N, n_taps, D] bfloat16 (stored as int16 bits): the target's hidden states at `layers`
  final.bf16     [N, D] bfloat16: the target's final-normed hidden state (its LM head gives the next-token
                 distribution, recomputed in training)
  sequences.jsonl  one line per finished sequence: {"start", "length", "source"}
  meta.json      target identity, layers, counts
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import SpecdraftError
from ..drafters.eagle_head import vocab_hash
from .chats import corpus_docs
from .corpus import PINNED_PACKAGES, encode_doc


@dataclass
class CollectConfig:
    target: str = "qwen2.5-coder-1.5b-instruct"
    out: str = ""
    tokens: int = 60_000  # stop after this many tokens
    max_len: int = 512  # tokens per sequence (longer documents are cut)
    layers: tuple[int, ...] | None = None  # default: EAGLE-3's (2, L // 2, L - 3)
    dtype: str = "auto"  # target weights while collecting: auto = bf16 on the native backend, as at inference
    backend: str = "auto"
    threads: int | None = None
    corpus: str = "packages"  # packages, chats:NAME (train/chats.py), or both joined by +


def default_layers(n_layers: int) -> tuple[int, int, int]:
    """A low, a middle and a high layer, as vLLM picks them for EAGLE-3 (residual stream before each)."""
    low, mid, high = min(2, n_layers - 1), n_layers // 2, max(n_layers - 3, 0)
    return tuple(sorted((low, mid, high)))  # a tiny model's picks can come out of order (3 layers: 2, 1, 0)


class FeatureStore:
    """Reads a collected folder through memory maps (no copy into RAM)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        meta_path = self.folder / "meta.json"
        if not meta_path.is_file():
            raise SpecdraftError(f"{self.folder} holds no collected features (no meta.json); run the collection")
        self.meta = json.loads(meta_path.read_text())
        self.sequences = [json.loads(line) for line in (self.folder / "sequences.jsonl").read_text().splitlines()
                          if line.strip()]
        self.n_tokens = sum(s["length"] for s in self.sequences)
        n_taps, hidden = len(self.meta["layers"]), self.meta["hidden_size"]
        self.tokens = np.memmap(self.folder / "tokens.i32", dtype=np.int32, mode="r", shape=(self.n_tokens,))
        self.taps = np.memmap(self.folder / "taps.bf16", dtype=np.int16, mode="r",
                              shape=(self.n_tokens, n_taps, hidden))
        self.final = np.memmap(self.folder / "final.bf16", dtype=np.int16, mode="r", shape=(self.n_tokens, hidden))

    def sequence(self, index: int, start: int = 0, length: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [T] int64, taps [T, n_taps, D] float32, final [T, D] float32 of one sequence (or of its
        `length` tokens from `start`)."""
        s = self.sequences[index]
        length = s["length"] - start if length is None else length
        window = slice(s["start"] + start, s["start"] + start + length)
        tokens = torch.from_numpy(np.array(self.tokens[window])).long()
        taps = torch.from_numpy(np.array(self.taps[window])).view(torch.bfloat16).float()
        final = torch.from_numpy(np.array(self.final[window])).view(torch.bfloat16).float()
        return tokens, taps, final

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """[V] int64: how often each token appears (the reduced draft vocabulary keeps the most frequent)."""
        return torch.bincount(torch.from_numpy(np.array(self.tokens)).long(), minlength=vocab_size)


class FeatureStores:
    """Several collected folders read as one (corpora collected apart, e.g. chats and package text): the
    sequences are numbered across the folders in order. All must come from the same target and taps."""

    def __init__(self, folders: list[str | Path]):
        if not folders:
            raise SpecdraftError("no feature folder given")
        # expanded here: a shell expands the ~ of the first folder of A+B only
        self.stores = [FeatureStore(Path(folder).expanduser()) for folder in folders]
        self.meta = self.stores[0].meta
        for store in self.stores[1:]:
            for key in ("target", "hidden_size", "layers", "vocab_hash", "vocab_size"):
                if store.meta.get(key) != self.meta.get(key):
                    raise SpecdraftError(f"{store.folder} was collected with another {key} "
                                         f"({store.meta.get(key)!r}) than {self.stores[0].folder} "
                                         f"({self.meta.get(key)!r}); train on folders of one target")
        self.sequences = [s for store in self.stores for s in store.sequences]
        self.owner = [(k, i) for k, store in enumerate(self.stores) for i in range(len(store.sequences))]
        self.n_tokens = sum(store.n_tokens for store in self.stores)

    def sequence(self, index: int, start: int = 0, length: int | None = None):
        """As FeatureStore.sequence, for a sequence numbered across the folders."""
        k, i = self.owner[index]
        return self.stores[k].sequence(i, start, length)


def split_folders(spec: str) -> list[str]:
    """"a+b" -> ["a", "b"] (feature folders joined by +, as corpora are)."""
    return [part.strip() for part in spec.split("+") if part.strip()]


def collect(config: CollectConfig, progress: bool = True) -> Path:
    """Run the target over the corpus, appending each sequence's features; resumes a partial folder."""
    from tqdm import tqdm

    from ..models.adapter import load_model, set_threads

    if not config.out:
        raise SpecdraftError("collection needs an output folder (--data DIR)")
    out = Path(config.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    set_threads(config.threads)
    target = load_model(config.target, config.dtype, progress=progress, backend=config.backend)
    layers = tuple(config.layers) if config.layers else default_layers(target.n_layers)
    taps_requested = layers + (target.n_layers,)  # the final-normed state rides along as the last tap
    meta = {"target": config.target, "target_path": target.path, "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size, "n_layers": target.n_layers, "layers": list(layers),
            "vocab_hash": vocab_hash(target.tokenizer), "max_len": config.max_len,
            "collect_dtype": target.dtype_name, "backend": target.backend,
            "sources": "data/eagle/SOURCES.md", "packages": list(PINNED_PACKAGES), "corpus": config.corpus}
    meta_path = out / "meta.json"
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        old.setdefault("corpus", "packages")  # folders collected before the corpus was a choice
        for key in ("target", "hidden_size", "layers", "vocab_hash", "max_len", "corpus"):
            if old.get(key) != meta[key]:
                raise SpecdraftError(f"{out} holds features collected with another {key} ({old.get(key)!r}); "
                                     f"choose another folder")
    meta_path.write_text(json.dumps(meta, indent=1))
    seq_path = out / "sequences.jsonl"
    done = [json.loads(line) for line in seq_path.read_text().splitlines() if line.strip()] if seq_path.exists() else []
    n_done = sum(s["length"] for s in done)
    # drop bytes a killed run wrote past its last finished sequence
    row_bytes = {"tokens.i32": 4, "taps.bf16": 2 * len(layers) * target.hidden_size,
                 "final.bf16": 2 * target.hidden_size}
    for name, size in row_bytes.items():
        path = out / name
        path.touch()
        with open(path, "r+b") as f:
            f.truncate(n_done * size)
    docs = corpus_docs(config.corpus)
    # resuming continues the same document list: a corpus that changed since (a chats file that grew) would
    # skip some documents and repeat others
    changed = next((i for i, s in enumerate(done) if i >= len(docs) or s["source"] != docs[i].source), None)
    if changed is not None:
        raise SpecdraftError(f"{out} was collected from another version of the corpus {config.corpus!r} (document "
                             f"{changed} differs); collect into a new folder (--data)")
    bar = tqdm(total=config.tokens, initial=min(n_done, config.tokens), unit="tok", disable=not progress,
               desc="collect", smoothing=0.05)
    started, collected_now = time.time(), 0
    with torch.inference_mode(), open(out / "tokens.i32", "ab") as f_tok, open(out / "taps.bf16", "ab") as f_taps, \
            open(out / "final.bf16", "ab") as f_final, open(seq_path, "a") as f_seq:
        for doc in docs[len(done):]:
            if n_done >= config.tokens:
                break
            ids = encode_doc(target.tokenizer, doc, config.max_len)
            if len(ids) < 16:
                ids = []
            if ids:
                state = target.new_state(capacity=len(ids), feature_layers=taps_requested)
                state.forward(ids, 1)
                features = state.features.to(torch.bfloat16)  # [T, n_taps + 1, D]
                f_tok.write(np.asarray(ids, dtype=np.int32).tobytes())
                f_taps.write(features[:, :-1].contiguous().view(torch.int16).numpy().tobytes())
                f_final.write(features[:, -1].contiguous().view(torch.int16).numpy().tobytes())
                for f in (f_tok, f_taps, f_final):
                    f.flush()
            # a skipped document still gets its line, so that resuming skips the same documents
            f_seq.write(json.dumps({"start": n_done, "length": len(ids), "source": doc.source}) + "\n")
            f_seq.flush()
            n_done += len(ids)
            collected_now += len(ids)
            bar.update(len(ids))
            bar.set_postfix(tok_s=f"{collected_now / max(time.time() - started, 1e-9):.1f}")
    bar.close()
    meta["tokens"] = n_done
    meta_path.write_text(json.dumps(meta, indent=1))
    return out


__all__ = [
    "CollectConfig",
    "FeatureStore",
    "FeatureStores",
    "collect",
    "default_layers",
    "vocab_hash",
]
