"""The benchmark's methods, in one registry: a method builds, from the loaded models and a speculative
configuration, a function that generates one turn and times the whole call.

Our own methods are derived from `config.METHODS` (each backed by `load_engine`), so a drafter that joins the
engine's registry joins the benchmark too; the transformers baselines are registered below. A new method that
is neither calls `register(Method(...))`; the runner never names a method.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..api import load_engine
from ..config import METHODS as ENGINE_METHODS
from ..config import TREE_METHODS, ModelConfig, SamplingParams, SpecConfig
from ..drafters import NEEDS_DRAFT_MODEL
from ..errors import SpecdraftError
from ..models.adapter import LoadedModel


@dataclass
class TurnOutput:
    """One generation call: the new tokens (EOS excluded), its wall time, and the loop's statistics
    (`SpecStats.to_dict()`) where the method has them (None for transformers' generate)."""

    token_ids: list[int]
    text: str
    wall_s: float
    stats: dict | None = None


# (prompt ids, sampling parameters) -> TurnOutput
GenerateTurn = Callable[[list[int], SamplingParams], TurnOutput]


@dataclass
class BenchModels:
    """The models loaded once and shared by every method of a run."""

    config: ModelConfig
    target: LoadedModel
    draft: LoadedModel | None


@dataclass(frozen=True)
class Method:
    name: str
    about: str
    build: Callable[[BenchModels, SpecConfig], GenerateTurn]  # spec carries gamma and the drafter's knobs
    needs_draft: bool = False
    uses_gamma: bool = False


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise SpecdraftError(f"unknown benchmark method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name]


# ------------------------------------------------------------------------------------------------ ours

def _build_ours(engine_method: str) -> Callable[[BenchModels, SpecConfig], GenerateTurn]:
    def build(models: BenchModels, spec: SpecConfig) -> GenerateTurn:
        engine = load_engine(models.config, replace(spec, method=engine_method), progress=False,
                             target=models.target, draft=models.draft)

        def generate(prompt_ids: list[int], params: SamplingParams) -> TurnOutput:
            start = time.perf_counter()
            result = engine.generate(prompt_ids, params)
            wall = time.perf_counter() - start
            return TurnOutput(result.token_ids, result.text, wall, result.stats.to_dict())

        return generate

    return build


for _name in ENGINE_METHODS:  # tree methods take their depth from the tree knobs, not gamma
    register(Method(_name, f"specdraft engine, method {_name!r}", _build_ours(_name),
                    needs_draft=_name in NEEDS_DRAFT_MODEL, uses_gamma=_name not in ("ar",) + TREE_METHODS))


# ------------------------------------------------------------------------------------------------ transformers

def _hf_generate(models: BenchModels, extra: Callable[[SpecConfig], dict], spec: SpecConfig) -> GenerateTurn:
    """transformers' `generate` on the same target. Every sampling knob is passed explicitly so that nothing in
    the model's generation_config (e.g. a repetition penalty) makes it decode differently from ours."""
    target = models.target
    eos = sorted(target.eos_token_ids)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else eos[0]

    def generate(prompt_ids: list[int], params: SamplingParams) -> TurnOutput:
        input_ids = torch.tensor([prompt_ids])  # [1, n]
        kwargs = dict(max_new_tokens=params.max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                      repetition_penalty=1.0, do_sample=not params.greedy, **extra(spec))
        if not params.greedy:
            kwargs.update(temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
            if params.seed is not None:
                torch.manual_seed(params.seed)  # generate samples from the global RNG; seeded per call, not per step
        else:
            kwargs.update(temperature=None, top_k=None, top_p=None)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        wall = time.perf_counter() - start
        tokens = out[0, len(prompt_ids):].tolist()
        tokens = tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]
        return TurnOutput(tokens, target.tokenizer.decode(tokens, skip_special_tokens=True), wall)

    return generate


def _require_draft(models: BenchModels) -> LoadedModel:
    if models.draft is None:
        raise SpecdraftError("method 'hf-assisted' needs a draft model (--draft NAME_OR_PATH)")
    return models.draft


register(Method("hf-ar", "transformers generate, greedy or sampling",
                lambda models, spec: _hf_generate(models, lambda s: {}, spec)))
register(Method("hf-assisted", "transformers generate(assistant_model=draft), its own draft-length schedule",
                lambda models, spec: _hf_generate(
                    models, lambda s: {"assistant_model": _require_draft(models).model}, spec),
                needs_draft=True))
# gamma auto for transformers' prompt lookup: its own default length (PromptLookupCandidateGenerator's
# num_output_tokens); it has no per-pass choice of length
HF_AUTO_GAMMA = 10
register(Method("hf-prompt-lookup",
                f"transformers generate(prompt_lookup_num_tokens=gamma; auto: {HF_AUTO_GAMMA}, its default)",
                lambda models, spec: _hf_generate(
                    models, lambda s: {"prompt_lookup_num_tokens": s.gamma,
                                       "max_matching_ngram_size": s.lookup_max_ngram}, spec),
                uses_gamma=True))
