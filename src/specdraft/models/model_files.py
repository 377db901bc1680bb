"""A packaged model folder's config, generation config and tokenizer, read without importing transformers.

A GGUF on the native backend needs no transformers model object, and importing transformers (1.1 s), resolving
its config classes (0.7 s) and building its tokenizer class (1.6 s against 0.6 s for the `tokenizers` library
alone) were most of a `specdraft generate` start (Xeon model 207, 2026-12-06: load_engine 4.8 s of 7.9). The
folders `specdraft models fetch` writes hold what transformers saved (config.json with every field,
tokenizer.json with the vocabulary, merges and added tokens transformers uses; the pipeline steps a tokenizer class
sets in code are set here the same way), so these readers give the same values and the same token ids
(tests/test_model_files.py compares them with transformers' on each packaged model). A folder they do not vouch for
(another tokenizer class, settings or a RoPE they do not reproduce, a config saved by an older transformers) gets
None, and the caller loads it with transformers.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

import numpy as np

# config.json keys the native backend reads without a default; a file missing one (or holding null) is left to
# transformers, whose config classes fill them in
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

    def __repr__(self) -> str:
        return f"JsonConfig({self.__dict__!r})"


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_model_config(folder: str | Path) -> JsonConfig | None:
    """config.json as written by transformers 5 (every field our native backend reads present, the default RoPE
    as `rope_parameters` with its theta); None for any other file (other RoPE types are computed by transformers'
    own functions, which need its config class)."""
    values = _read_json(Path(folder) / "config.json")
    if values is None or not str(values.get("transformers_version", "")).startswith("5."):
        return None
    if any(values.get(key) is None for key in _REQUIRED_CONFIG_KEYS):
        return None
    rope = values["rope_parameters"]
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
        return None
    return JsonConfig(values)


def read_generation_config(folder: str | Path, config: JsonConfig) -> JsonConfig | None:
    """generation_config.json, or (without one) the token ids transformers derives from the model config; None for
    a file that is there but not a JSON object (transformers reports it)."""
    path = Path(folder) / "generation_config.json"
    if path.exists():
        values = _read_json(path)
        return None if values is None else JsonConfig(values)
    return JsonConfig({key: getattr(config, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                       if getattr(config, key, None) is not None})


class _SharedBackend:
    """One loaded tokenizer.json, referenced by every FastTokenizer over it (the weakly held key of the sharing in
    adapter.load_tokenizer: it lives as long as any of them)."""

    def __init__(self, backend):
        self.backend = backend


class FastTokenizer:
    """tokenizer.json run by the `tokenizers` library, with the calls of transformers' tokenizer that specdraft
    makes: `__call__`/`encode`, `decode`, `apply_chat_template` (its template rendered as transformers renders
    it: a sandboxed jinja2 environment with trimmed blocks, `tojson`, `raise_exception`, `strftime_now`, the
    special tokens as variables), `get_vocab` and the special token ids. What transformers' tokenizer takes and
    this one does not (batches of conversations, continuing a final message, tensors, padding) is refused."""

    def __init__(self, shared: _SharedBackend, settings: dict, chat_template: str | None, name_or_path: str):
        self.shared = shared
        self.name_or_path = name_or_path
        self.chat_template = chat_template
        self.special_tokens_map = {name: settings[name] for name in _SPECIAL_TOKEN_NAMES
                                   if isinstance(settings.get(name), str)}

    @classmethod
    def from_folder(cls, folder: str | Path, shared: _SharedBackend | None = None) -> FastTokenizer | None:
        """The folder's tokenizer, or None where its files ask for something this reader does not reproduce (another
        tokenizer class, settings it does not know, a special token the vocabulary lacks, transformers' own
        template tag). shared: an already loaded backend of the same tokenizer.json."""
        folder = Path(folder)
        settings = _read_json(folder / "tokenizer_config.json")
        if (settings is None or not _plain_settings(settings) or not (folder / "tokenizer.json").is_file()
                or (folder / "chat_template.json").exists() or (folder / "additional_chat_templates").exists()):
            return None  # (transformers reads templates from those too)
        template = folder / "chat_template.jinja"
        chat_template = template.read_text(encoding="utf-8") if template.is_file() else None
        if not _plain_template(chat_template):
            return None
        if shared is None:
            from tokenizers import Tokenizer

            try:
                backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
            except Exception:  # the Rust library's error for a file it cannot read: transformers reports it
                return None
            backend.no_padding()
            backend.no_truncation()
            if settings["tokenizer_class"] == "Qwen2Tokenizer" and not _as_qwen2_builds_it(backend):
                return None
            shared = _SharedBackend(backend)
        special = {token.content for token in shared.backend.get_added_tokens_decoder().values() if token.special}
        if any(isinstance(settings.get(name), str) and settings[name] not in special for name in _SPECIAL_TOKEN_NAMES):
            return None  # transformers would add it to the vocabulary
        return cls(shared, settings, chat_template, str(folder))

    @property
    def backend(self):
        """The tokenizers.Tokenizer (shared by the tokenizers of byte-identical files)."""
        return self.shared.backend

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

    @property
    def all_special_ids(self) -> list[int]:
        """The ids of the named special tokens (a draft vocabulary always keeps them: an answer must be able to end)."""
        ids = [self.backend.token_to_id(token) for token in self.special_tokens_map.values()]
        return sorted({i for i in ids if i is not None})

    @property
    def added_tokens_decoder(self) -> dict:
        """id -> AddedToken for the tokens added to the vocabulary (special ones among them)."""
        return self.backend.get_added_tokens_decoder()

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """One entry's id (None: not in the vocabulary)."""
        return self.backend.token_to_id(token)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text to encode must be a string, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, *, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
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
                            documents: list[dict] | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True, **template_variables):
        """The conversation rendered by the chat template as transformers renders it (messages' None-valued keys
        dropped, older names of reasoning aliased, everything the template sees rebuilt from plain types), then,
        with `tokenize`, its ids without special tokens added (a dict with `input_ids` where `return_dict`, as
        transformers returns by default)."""
        for name, default in _TRANSFORMERS_ONLY.items():
            if name in template_variables and template_variables.pop(name) != default:
                raise NotImplementedError(f"{name} is not supported without transformers; load this tokenizer with "
                                          f"specdraft.models.adapter.load_tokenizer({self.name_or_path!r})")
        if self.chat_template is None:
            raise ValueError(f"{self.name_or_path} has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if isinstance(conversation[0], (list, tuple)):
            raise NotImplementedError("a batch of conversations is not supported without transformers")
        for tool in tools or ():
            if not isinstance(tool, Mapping):
                raise ValueError("tools must be JSON schemas (dicts) without transformers")
        for document in documents or ():
            if not isinstance(document, Mapping):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        messages = []
        for message in conversation:
            if not isinstance(message, Mapping):
                raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
            message = {key: value for key, value in _plain(message).items() if value is not None}
            reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            messages.append(message)
        text = _compiled_template(self.chat_template).render(
            messages=messages, tools=_plain(tools), documents=_plain(documents),
            add_generation_prompt=add_generation_prompt, **_plain({**self.special_tokens_map, **template_variables}))
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids


# apply_chat_template's arguments in transformers that are not template variables, and their defaults
_TRANSFORMERS_ONLY = {"continue_final_message": False, "chat_template": None, "return_tensors": None, "padding": False,
                      "truncation": False, "max_length": None, "tokenizer_kwargs": None,
                      "sanitize_control_tokens": False, "return_assistant_tokens_mask": False}
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read
# tokenizer_config.json keys this reader reproduces, with the values it reproduces them for (None: any)
_KNOWN_SETTINGS = {"backend": ("tokenizers",), "is_local": None, "local_files_only": None, "model_max_length": None,
                   "add_prefix_space": (None, False), "clean_up_tokenization_spaces": (None, False),
                   "split_special_tokens": (None, False), "tokenizer_class": PLAIN_TOKENIZER_CLASSES}
# Qwen2Tokenizer fills these in when tokenizer_config.json leaves them out: the file must name them
_QWEN2_NAMED = ("unk_token", "eos_token", "pad_token")


def _plain_settings(settings: dict) -> bool:
    """Whether this reader builds the tokenizer these settings describe as transformers would."""
    for key, value in settings.items():
        if key in _SPECIAL_TOKEN_NAMES:
            if value is not None and not isinstance(value, str):  # e.g. an AddedToken's dict
                return False
        elif key not in _KNOWN_SETTINGS or (_KNOWN_SETTINGS[key] is not None and value not in _KNOWN_SETTINGS[key]):
            return False
    if settings.get("tokenizer_class") not in PLAIN_TOKENIZER_CLASSES:
        return False
    return settings["tokenizer_class"] != "Qwen2Tokenizer" or all(key in settings for key in _QWEN2_NAMED)


def _plain_template(chat_template: str | None) -> bool:
    """A template this reader renders as transformers does: not using transformers' own `generation` tag."""
    return chat_template is None or not re.search(r"\{%-?\s*generation\s*-?%\}", chat_template)


def _plain(value):
    """What a template sees, rebuilt from plain JSON types (as transformers rebuilds it: a template must not reach
    an object's methods); anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # a pydantic model
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


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
