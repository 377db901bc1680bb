"""Batched decoding on the transformers backend: one model's forward over several rows with one KV cache (rows
that share a prefix, or left-padded prompts). The answers app samples many answers to one prompt with it, the
chats builder serves many prompts at once. The native backend batches sequences with their own caches in one
pass instead (`NativeState.forward_many`, `Engine.generate_many`)."""

from __future__ import annotations

import contextlib

import torch

from .adapter import LoadedModel
from .fastpath import WeightMajorLinear


class BatchDecoder:
    """One model's forward over a batch of rows with a KV cache: rows that share a prefix, or left-padded
    prompts (`attention_mask` and `position_ids` as transformers takes them)."""

    def __init__(self, loaded: LoadedModel):
        from transformers import DynamicCache

        self.loaded = loaded
        self.cache = DynamicCache(config=loaded.model.config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [rows, n] -> float32 logits [rows, V] of the last position; the cache grows by n."""
        rows, n = input_ids.shape
        few_rows = self.loaded.weight_major and 1 < rows * n <= WeightMajorLinear.MAX_ROWS
        with WeightMajorLinear() if few_rows else contextlib.nullcontext():
            out = self.loaded.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()
