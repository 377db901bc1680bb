"""The public Python API: load models by name or path, build an engine, generate.

    from specdraft import ModelConfig, SpecConfig, SamplingParams, load_engine
    engine = load_engine(ModelConfig(dtype="bfloat16"), SpecConfig(method="draft", gamma=4))
    ids = engine.encode("Write a Python function that reverses a string.")   # chat template applied
    result = engine.generate(ids, SamplingParams(max_new_tokens=64))
    print(result.text, result.stats.tau, result.stats.acceptance_rate)
"""

from __future__ import annotations

from .config import ModelConfig, SpecConfig
from .drafters import build_drafter, check_drafter_inputs, needs_draft_model
from .engine import Engine
from .errors import SpecdraftError
from .models.adapter import LoadedModel, load_model, set_threads
from .models.fetch import check_model_names, vocabulary_mismatch
from .models.verify_curve import draft_price, verify_curve
from .prefix_cache import PrefixCache


def load_engine(models: ModelConfig, spec: SpecConfig, progress: bool = True,
                target: LoadedModel | None = None, draft: LoadedModel | None = None,
                prefix_cache: PrefixCache | None = None) -> Engine:
    """Load what `spec` needs (models already loaded may be passed in and are reused). prefix_cache: prompts' K/V
    kept for later prompts that begin the same way (`PrefixCache(max_bytes)`, prefix_cache.py)."""
    for value, kind, what in ((models, ModelConfig, "models"), (spec, SpecConfig, "spec")):
        if not isinstance(value, kind):
            raise SpecdraftError(f"load_engine's {what} must be a {kind.__name__}, got {value!r}")
    for value, what in ((target, "target"), (draft, "draft")):
        if value is not None and not isinstance(value, LoadedModel):
            raise SpecdraftError(f"load_engine's {what} must be a loaded model (specdraft.load_model) or None, got "
                                 f"{value!r}; to load one by name, put the name in ModelConfig")
    # names, paths and heads first: a mistyped one fails before gigabytes load
    check_model_names(models.target if target is None else None,
                      models.draft if needs_draft_model(spec.method) and draft is None else None)
    check_drafter_inputs(spec)
    set_threads(models.threads)
    target = target or load_model(models.target, models.dtype, models.cache_dir, progress, models.backend)
    if needs_draft_model(spec.method) and draft is None:
        draft = load_draft(models, target, progress)
    drafter = build_drafter(spec, target, draft)  # before the curve: a drafter that cannot be built fails at once
    # gamma auto's costs, measured once per machine and cached: the target's verify curve, a draft byte's price
    curve = verify_curve(target, spec.draft_len + 1) if spec.adaptive_gamma else None
    price = draft_price(target, drafter) if spec.adaptive_gamma else 1.0
    return Engine(target, drafter, spec, new_drafter=lambda: build_drafter(spec, target, draft), curve=curve,
                  prefix_cache=prefix_cache, draft_price=price)


def load_draft(models: ModelConfig, target: LoadedModel, progress: bool = True) -> LoadedModel | None:
    """The draft model `models` names (None when it names none). A draft named as the target is the target itself,
    one copy of the weights (self-speculation: the sorted draft's exits on the target's own layers)."""
    if not models.draft:
        return None
    if models.draft == models.target:
        return target
    mismatched = vocabulary_mismatch(models.draft, target.tokenizer)
    if mismatched:  # a packaged draft that cannot draft for this target: said before it is fetched
        raise SpecdraftError(
            f"draft {models.draft!r} and target {target.name!r} have incompatible vocabularies (the target maps "
            f"{mismatched[0]!r} otherwise); choose a draft with the target's tokenizer, or use --method prompt-lookup "
            "(the server: --no-draft)")
    return load_model(models.draft, models.dtype, models.cache_dir, progress, models.backend)
