"""The benchmark's methods, in one registry: a method builds, from the loaded models and a speculative
configuration, a function that generates one turn and times the whole call.

Our own methods are the drafters of registry.py (each backed by `load_engine`), so a drafter that registers
there joins the benchmark too; the transformers baselines and the llama.cpp peer (peers.py) are
registered below. A new method that is none of these calls `register(Method(...))`; the runner never names a
method. A method's generate function may have a `close()` (a server to stop): the runner calls it at the end of
the run, errors included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..api import load_engine
from ..config import ModelConfig, SamplingParams, SpecConfig
from ..errors import SpecdraftError
from ..models.adapter import LoadedModel
from ..registry import DRAFTERS, method_names, resolve_method
from .peers import PEER_DRAFT_N_MAX, PeerCompletion


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
    # what gamma auto means for a method outside our loop (it has no per-pass choice); None: HF_AUTO_GAMMA
    auto_gamma: int | None = None
    # a check that needs no model, run before any model loads (e.g. an outside program is not built)
    preflight: Callable[[ModelConfig], None] | None = None


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    """A registered benchmark method, or our engine's method of that name (any drafter in registry.py, however
    late it registered)."""
    if name in METHODS:
        return METHODS[name]
    if resolve_method(name) is not None:
        return engine_method(name)
    raise SpecdraftError(f"unknown benchmark method {name!r}; choose from {', '.join([*method_names(), *METHODS])}")


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


def engine_method(name: str) -> Method:
    """The benchmark method of a drafter in the registry (registry.py), any spelling (NAME-tree drafts trees, which
    take their depth from the tree settings, not gamma)."""
    drafter, tree = resolve_method(name)
    info = DRAFTERS[drafter]
    return Method(name, f"specdraft engine, method {name!r}", _build_ours(name), needs_draft=info.needs_draft_model,
                  uses_gamma=info.drafts and not tree)


# ------------------------------------------------------------------------------------------------ transformers

def _hf_generate(models: BenchModels, extra: Callable[[SpecConfig], dict], spec: SpecConfig) -> GenerateTurn:
    """transformers' `generate` on the same target. Every sampling knob is passed explicitly so that nothing in
    the model's generation_config (e.g. a repetition penalty) makes it decode differently from ours."""
    target = models.target
    model = target.transformers_model("transformers' generate (the hf-* methods)")
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
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
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


def _hf_assisted(models: BenchModels, spec: SpecConfig) -> GenerateTurn:
    assistant = _require_draft(models).transformers_model("hf-assisted's draft (transformers' generate)")
    return _hf_generate(models, lambda s: {"assistant_model": assistant}, spec)


register(Method("hf-assisted", "transformers generate(assistant_model=draft), its own draft-length schedule",
                _hf_assisted, needs_draft=True))
# gamma auto for transformers' prompt lookup: its own default length (PromptLookupCandidateGenerator's
# num_output_tokens); it has no per-pass choice of length
HF_AUTO_GAMMA = 10
register(Method("hf-prompt-lookup",
                f"transformers generate(prompt_lookup_num_tokens=gamma; auto: {HF_AUTO_GAMMA}, its default)",
                lambda models, spec: _hf_generate(
                    models, lambda s: {"prompt_lookup_num_tokens": s.gamma,
                                       "max_matching_ngram_size": s.setting("lookup_max_ngram")}, spec),
                uses_gamma=True))


# ------------------------------------------------------------------------------------------------ llama.cpp

def _peer_preflight(speculative: bool) -> Callable[[ModelConfig], None]:
    def check(config: ModelConfig) -> None:
        from ..models.fetch import cache_root
        from .peers import gguf_path, require_peer

        cache = cache_root(config.cache_dir)
        require_peer(cache)
        gguf_path(config.target, cache)
        if speculative:
            if not config.draft:
                raise SpecdraftError("method 'llama.cpp-spec' needs a draft model (--draft NAME)")
            gguf_path(config.draft, cache)

    return check


def peer_stats(completion: PeerCompletion, version: str = "") -> dict:
    """A llama-server completion's figures as a record's stats: its own timings (`peer_*`), and the fields our
    records share (finish reason, backend). No target_passes: the report keeps the peer out of our loop's figures."""
    timings = completion.timings
    stats = {"backend": "llama.cpp", "peer_version": version,
             "finish_reason": {"eos": "stop", "word": "stop", "limit": "length"}.get(completion.stop_type,
                                                                                   completion.stop_type),
             # prefill by its clock: the report's decode-only figures leave it out, as they do our prefill
             "time_prefill_s": timings["prompt_ms"] / 1000,
             "peer_stop_type": completion.stop_type, "peer_eos_token": completion.eos_token,
             "peer_http_wall_s": completion.http_wall_s}
    for name in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "draft_n", "draft_n_accepted", "cache_n"):
        if name in timings:
            stats[f"peer_{name}"] = timings[name]
    return stats


def _build_llama_cpp(speculative: bool) -> Callable[[BenchModels, SpecConfig], GenerateTurn]:
    """llama-server on the target's GGUF file (and the draft's, for its speculative decoding), started once per
    run; each turn's prompt ids go to it as they are, and its tokens/s come from its own timings."""
    def build(models: BenchModels, spec: SpecConfig) -> GenerateTurn:
        from ..models.fetch import cache_root
        from .peers import (DEFAULT_CONTEXT, PEER_VERSION, LlamaServer, ServerSpec, existing_gguf, peer_binary,
                            peer_info, require_peer)

        config = models.config
        cache = cache_root(config.cache_dir)
        require_peer(cache)
        server_spec = ServerSpec(
            binary=peer_binary(cache, "llama-server"), model=existing_gguf(config.target, cache),
            threads=config.threads or torch.get_num_threads(),
            context=min(DEFAULT_CONTEXT, models.target.max_positions or DEFAULT_CONTEXT),
            draft=existing_gguf(config.draft, cache) if speculative else None,
            draft_n_max=spec.gamma or PEER_DRAFT_N_MAX)
        server = LlamaServer(server_spec).start()
        commit = (peer_info(cache).get("llama_cpp_commit") or "")[:10] or "commit unknown"
        version = f"llama-cpp-python {PEER_VERSION}'s llama.cpp ({commit})"
        tokenizer = models.target.tokenizer

        def generate(prompt_ids: list[int], params: SamplingParams) -> TurnOutput:
            completion = server.complete(prompt_ids, params.max_new_tokens, params.temperature, params.top_k,
                                         params.top_p, params.seed)
            text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)  # as our engine's text
            return TurnOutput(completion.token_ids, text, completion.own_wall_s, peer_stats(completion, version))

        generate.close = server.stop  # type: ignore[attr-defined]
        return generate

    return build


register(Method("llama.cpp", "llama.cpp's llama-server (make peers), plain decoding on the target's GGUF",
                _build_llama_cpp(False), preflight=_peer_preflight(False)))
register(Method("llama.cpp-spec", "llama.cpp's llama-server, its speculative decoding with the draft's GGUF "
                f"(draft length gamma; auto: {PEER_DRAFT_N_MAX}, its default)", _build_llama_cpp(True),
                uses_gamma=True, auto_gamma=PEER_DRAFT_N_MAX, preflight=_peer_preflight(True)))
