"""A packaged model folder's config, generation config and tokenizer, read without importing transformers.

A GGUF on the native backend needs no transformers model object, and importing transformers (1.1 s), resolving
its config classes (0.7 s) and building its tokenizer class (1.6 s against 0.6 s for the `tokenizers` library
alone) were most of a `specdraft generate` start (Xeon model 207, 2026-12-06: load_engine 4.8 s of 7.9). The
folders `specdraft models fetch` writes hold what transformers saved (config.json with every field,
tokenizer.json serialized from the very tokenizer object transformers builds), so these readers give the same
values and the same token ids (tests/test_model_files.py compares them with transformers' on each packaged
model). A folder they do not vouch for (another tokenizer class, a config saved by an older transformers) gets
None, and the caller loads it with transformers.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

# config.json keys the native backend reads without a default; a file missing one is left to transformers
_REQUIRED_CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                         "num_key_value_heads", "num_hidden_layers", "rms_norm_eps", "vocab_size", "rope_parameters")
# tokenizer classes this reader builds as transformers builds them (checked per packaged model by
# tests/test_model_files.py): TokenizersBackend runs tokenizer.json as it is; Qwen2Tokenizer takes the file's
# vocabulary, merges, added tokens and post-processor but sets its normalizer, pre-tokenizer and decoder in code
# (`_as_qwen2_builds_it`: the NFC step, which the packaged files lack, changes the ids of decomposed accents).
PLAIN_TOKENIZER_CLASSES = ("Qwen2Tokenizer", "TokenizersBackend")
# Qwen2's pre-tokenizer split (the published Qwen2 tokenizer's regular expression)
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class JsonConfig:
    """A config file's keys as attributes. A key the file lacks raises AttributeError, so `getattr(config, key,
    default)` takes the default as it does for a transformers config without that attribute."""

    def __init__(self, values: Mapping):
        self.__dict__.update(values)

    def to_dict(self) -> dict:
        return copy.deepcopy(self.__dict__)

    def __repr__(self) -> str:
        return f"JsonConfig({self.__dict__!r})"


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_model_config(folder: str | Path) -> JsonConfig | None:
    """config.json as written by transformers 5 (every field our native backend reads present, RoPE settings as
    `rope_parameters`); None for any other file."""
    values = _read_json(Path(folder) / "config.json")
    if values is None or not str(values.get("transformers_version", "")).startswith("5."):
        return None
    if any(key not in values for key in _REQUIRED_CONFIG_KEYS) or not isinstance(values["rope_parameters"], dict):
        return None
    return JsonConfig(values)


def read_generation_config(folder: str | Path, config: JsonConfig) -> JsonConfig:
    """generation_config.json, or (without one) the token ids transformers derives from the model config."""
    values = _read_json(Path(folder) / "generation_config.json")
    if values is None:
        values = {key: getattr(config, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if getattr(config, key, None) is not None}
    return JsonConfig(values)


class FastTokenizer:
    """tokenizer.json run by the `tokenizers` library, with the calls of transformers' tokenizer that specdraft
    makes: `__call__`/`encode`, `decode`, `apply_chat_template` (its template rendered as transformers renders
    it: a sandboxed jinja2 environment with trimmed blocks, `tojson`, `raise_exception`, `strftime_now`, the
    special tokens as variables), `get_vocab` and the special token ids."""

    def __init__(self, backend, settings: dict, chat_template: str | None, name_or_path: str):
        self.backend = backend  # tokenizers.Tokenizer (shared by tokenizers of byte-identical files)
        self.name_or_path = name_or_path
        self.chat_template = chat_template
        self.special_tokens_map = {name: settings[name] for name in _SPECIAL_TOKEN_NAMES
                                   if isinstance(settings.get(name), str)}

    @classmethod
    def from_folder(cls, folder: str | Path, backend=None) -> FastTokenizer | None:
        """The folder's tokenizer, or None where its class is not one this reader vouches for. backend: an already
        loaded tokenizers.Tokenizer of the same tokenizer.json."""
        folder = Path(folder)
        settings = _read_json(folder / "tokenizer_config.json")
        if (settings is None or settings.get("tokenizer_class") not in PLAIN_TOKENIZER_CLASSES
                or not (folder / "tokenizer.json").is_file() or "chat_template" in settings
                or settings.get("split_special_tokens") or settings.get("clean_up_tokenization_spaces")):
            return None
        if backend is None:
            from tokenizers import Tokenizer

            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
            backend.no_padding()
            backend.no_truncation()
            if settings["tokenizer_class"] == "Qwen2Tokenizer" and not _as_qwen2_builds_it(backend):
                return None
        template = folder / "chat_template.jinja"
        chat_template = template.read_text(encoding="utf-8") if template.is_file() else None
        if chat_template is not None and re.search(r"\{%-?\s*generation\s*-?%\}", chat_template):
            return None  # transformers' own tag for assistant masks
        return cls(backend, settings, chat_template, str(folder))

    def with_template(self, chat_template: str | None, name_or_path: str) -> FastTokenizer:
        """Another folder's view of the same vocabulary: its own chat template and name."""
        other = copy.copy(self)
        other.chat_template, other.name_or_path = chat_template, name_or_path
        return other

    # ---------------------------------------------------------------------------------------------- ids
    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text to encode must be a string, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        elif isinstance(ids, Mapping):
            ids = ids["input_ids"]
        elif hasattr(ids, "tolist"):  # a tensor or an array
            ids = ids.tolist()
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -------------------------------------------------------------------------------------- chat template
    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, return_dict: bool = True,
                            **template_variables):
        """The conversation rendered by the chat template (messages' None-valued keys dropped, as transformers
        does), then, with `tokenize`, its ids without special tokens added (a dict with `input_ids` where
        `return_dict`, as transformers returns by default)."""
        if self.chat_template is None:
            raise ValueError(f"{self.name_or_path} has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        messages = []
        for message in conversation:
            if not isinstance(message, Mapping):
                raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
            messages.append({key: copy.deepcopy(value) for key, value in message.items() if value is not None})
        text = _compiled_template(self.chat_template).render(
            messages=messages, tools=copy.deepcopy(tools), documents=None,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **template_variables})
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids


def _as_qwen2_builds_it(backend) -> bool:
    """Give a Qwen2 tokenizer.json's backend the normalizer, pre-tokenizer and decoder transformers' Qwen2Tokenizer
    sets; False where the file's BPE model has settings that class would not keep."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    model = backend.model
    if not isinstance(model, BPE) or (model.dropout, model.unk_token, model.continuing_subword_prefix,
                                      model.end_of_word_suffix, model.fuse_unk, model.byte_fallback,
                                      model.ignore_merges) != (None, None, "", "", False, False, False):
        return False
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return True


_templates: dict[str, object] = {}


def _compiled_template(source: str):
    """A chat template compiled once, in the environment transformers renders chat templates in."""
    compiled = _templates.get(source)
    if compiled is None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # jinja2's own filter escapes HTML characters; templates expect plain JSON
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[jinja2.ext.loopcontrols])
        environment.filters["tojson"] = tojson
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        compiled = _templates[source] = environment.from_string(source)
    return compiled
