"""specdraft: lossless speculative decoding for Hugging Face causal language models."""

from .api import load_engine
from .config import ModelConfig, SamplingParams, SpecConfig
from .engine import Engine, Generation
from .errors import SpecdraftError
from .models.adapter import LoadedModel, load_model
from .prefix_cache import PrefixCache
from .types import Acceptance, Draft, GenerationResult, SpecStats

__all__ = ["load_engine", "load_model", "Engine", "Generation", "LoadedModel", "PrefixCache", "ModelConfig",
           "SamplingParams", "SpecConfig", "SpecdraftError", "Acceptance", "Draft", "GenerationResult", "SpecStats"]
