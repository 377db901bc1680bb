"""Prompts' K/V kept for later prompts that begin the same way.

Every chat request to a server starts with the same template and system prompt, and each turn of a conversation
resends all the turns before it. On a CPU a prompt's prefill is compute-bound (about 80 tokens/s for the 1.5B on 2
Zen 3 cores), so a request that recomputes what an earlier one already cached waits for nothing. A `PrefixCache`
keeps the target's K/V of the prompts it has prefilled (`store`) and gives a new sequence the longest prefix any
of them shares with its prompt (`restore`); prefill goes on from there.

Exact: a position's K/V depends only on the tokens up to it, and the native kernels compute a row the same way
whatever else is in its pass (batch invariance), so K/V computed for another prompt's identical prefix are the
very bits this prompt's own prefill would write. Only sequences whose state says so (`prefix_reusable`: the native
backend with bf16 or GGUF weights, no feature taps) take part; float32 weights prefill long passes with torch's
matmul, whose rows depend on the pass, and the transformers backend keeps its own cache.

Entries live in least-recently-used order within a byte budget; an entry that a newer prompt extends (the earlier
turns of the same conversation) is dropped for the newer one. Each entry names the model that computed it (engines
of different models may share one cache; a state takes only its own model's entries)."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

from .errors import SpecdraftError


@dataclass
class _Entry:
    token_ids: tuple[int, ...]
    kv: object  # what the state's export_prefix returned
    nbytes: int
    model: weakref.ref  # the state's prefix_model: only its states may take these K/V


class PrefixCache:
    """K/V of prompts prefilled before, for later sequences of the same model that begin the same way."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise SpecdraftError(f"a prefix cache's budget must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # oldest use first
        self._lock = threading.Lock()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _longest(self, token_ids: list[int], model: object) -> tuple[int, _Entry | None]:
        best, best_entry = 0, None
        for entry in self._entries.values():
            limit = min(len(entry.token_ids), len(token_ids))
            if limit <= best or entry.model() is not model:
                continue
            common = 0
            while common < limit and entry.token_ids[common] == token_ids[common]:
                common += 1
            if common > best:
                best, best_entry = common, entry
        return best, best_entry

    def restore(self, state, token_ids: list[int]) -> int:
        """Load into `state` (empty) the K/V of the longest stored prefix of `token_ids`; returns its length
        (0: nothing stored begins the same way, or the state cannot take it)."""
        if len(state) or not state.prefix_reusable:
            return 0
        with self._lock:
            length, entry = self._longest(token_ids, state.prefix_model)
            if entry is None:
                return 0
            self._entries.move_to_end(entry.token_ids)
            state.import_prefix(list(token_ids[:length]), entry.kv)
            return length

    def store(self, state, token_ids: list[int]) -> None:
        """Keep the K/V the state holds for `token_ids` (its first len(token_ids) positions)."""
        if not token_ids or not state.prefix_reusable or state.token_ids[: len(token_ids)] != list(token_ids):
            return
        key = tuple(token_ids)
        with self._lock:
            if key in self._entries and self._entries[key].model() is state.prefix_model:
                self._entries.move_to_end(key)
                return
            nbytes = state.prefix_bytes(len(key))
            if nbytes > self.max_bytes:
                return
            # entries this one extends (or another model's of the same tokens) give way to it
            for old in [old for old in self._entries if len(old) <= len(key) and key[: len(old)] == old]:
                self.nbytes -= self._entries.pop(old).nbytes
            while self._entries and self.nbytes + nbytes > self.max_bytes:
                self.nbytes -= self._entries.popitem(last=False)[1].nbytes
            self._entries[key] = _Entry(key, state.export_prefix(len(key)), nbytes, weakref.ref(state.prefix_model))
            self.nbytes += nbytes
