"""specdraft: lossless speculative decoding for Hugging Face causal language models.

The names below load on first use (PEP 562), so that `import specdraft.cli` stays light: a command line checks its
arguments before torch and the models load (a mistyped path fails in well under the seconds torch takes)."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_engine": ".api", "load_model": ".models.adapter", "Engine": ".engine", "Generation": ".engine",
    "LoadedModel": ".models.adapter", "PrefixCache": ".prefix_cache", "ModelConfig": ".config",
    "SamplingParams": ".config", "SpecConfig": ".config", "SpecdraftError": ".errors", "Acceptance": ".types",
    "Draft": ".types", "GenerationResult": ".types", "SpecStats": ".types",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdraft' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
