"""The OpenAI request shapes the server accepts, its error shape, and the translation into the project's
configs (SamplingParams, SpecConfig). Validation is strict: a wrong type is a 400, never coerced."""

from __future__ import annotations

import json
import typing
from dataclasses import fields, replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from ..config import SamplingParams, SpecConfig
from ..engine import check_text
from ..errors import SpecdraftError
from ..registry import option_classes
from .config import ServerConfig

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_TEMPERATURE = 2.0  # as OpenAI
MAX_SEED = 2**63 - 1 - 1024  # torch.Generator's range, with room for seed + i over n choices


class ApiError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


class _Strict(BaseModel):
    # unknown fields are ignored (clients send many); known ones must have exactly the right JSON type
    model_config = ConfigDict(strict=True, extra="ignore")


class SpeculativeBase(_Strict):
    """The extra request field: per-request speculative settings; what is left out comes from the server. Its
    fields besides these: every drafter setting that the registry (registry.py) lets a request set."""

    model_config = ConfigDict(strict=True, extra="forbid")
    method: str | None = None
    gamma: int | Literal["auto"] | None = None  # "auto": SpecConfig's None (each pass chooses its length)
    lookup_first: int | Literal["auto"] | None = None  # "auto": SpecConfig's None, whatever the server's default
    tree: bool | None = None  # draft token trees (a method spelled NAME-tree says so too)


_speculative_models: dict[tuple, type[SpeculativeBase]] = {}


def speculative_options() -> type[SpeculativeBase]:
    """The `speculative` field's model for the drafters registered now (built once per set of settings)."""
    allowed = []
    for cls in option_classes():
        hints = typing.get_type_hints(cls)
        allowed += [(f.name, hints[f.name]) for f in fields(cls) if f.metadata.get("server")
                    and f.name not in {name for name, _ in allowed}]
    key = tuple(allowed)
    if key not in _speculative_models:
        _speculative_models[key] = create_model("SpeculativeOptions", __base__=SpeculativeBase,
                                                **{name: (kind | None, None) for name, kind in allowed})
    return _speculative_models[key]


class StreamOptions(_Strict):
    include_usage: bool = False


class _CommonRequest(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI, accepted as vLLM does
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = 1  # null: 1, as OpenAI and vLLM take it
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: dict[str, Any] | None = None  # validated against `speculative_options()` by parse_request
    user: str | None = None
    # OpenAI features this server does not implement: accepted only at their neutral values
    logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None

    UNSUPPORTED: ClassVar[tuple[tuple[str, tuple], ...]] = (
        ("logprobs", (None, False, 0)), ("logit_bias", (None, {})), ("presence_penalty", (None, 0, 0.0)),
        ("frequency_penalty", (None, 0, 0.0)))

    def check_supported(self) -> None:
        for name, neutral in self.UNSUPPORTED:
            value = getattr(self, name)
            if not any(value == ok and type(value) is type(ok) for ok in neutral):
                raise bad_request(f"{name} is not supported by this server; leave it out", name)

    def max_tokens_requested(self) -> int | None:
        return self.max_tokens


PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    UNSUPPORTED: ClassVar[tuple[tuple[str, tuple], ...]] = _CommonRequest.UNSUPPORTED + (
        ("echo", (None, False)), ("suffix", (None,)), ("best_of", (None, 1)))


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        # templates know system, user and assistant; OpenAI's newer "developer" role is the system prompt
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(_CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    response_format: Any = None
    UNSUPPORTED: ClassVar[tuple[tuple[str, tuple], ...]] = _CommonRequest.UNSUPPORTED + (
        ("top_logprobs", (None, 0)), ("tools", (None, [])), ("tool_choice", (None, "none")), ("functions", (None, [])))

    def check_supported(self) -> None:
        super().check_supported()
        if self.response_format not in (None, {"type": "text"}):
            raise bad_request("response_format other than {\"type\": \"text\"} is not supported", "response_format")

    def max_tokens_requested(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens disagree; give one of them", "max_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_request(body: bytes, model: type[_CommonRequest], limits: ServerConfig) -> _CommonRequest:
    """Bytes -> a validated request, or ApiError(400) saying which field is wrong and why."""
    if len(body) > limits.max_body_bytes:
        raise ApiError(413, f"request body is {len(body)} bytes; the limit is {limits.max_body_bytes}")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"invalid JSON in the request body: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        if exc.errors()[0]["loc"][:1] == ("prompt",):  # a union's error names one of its branches: say all
            raise bad_request(f"prompt must be {PROMPT_SHAPES}", "prompt") from None
        raise _invalid(exc) from None
    if request.n is None:
        request.n = 1
    if request.speculative is not None:
        try:
            request.speculative = speculative_options().model_validate(request.speculative)
        except ValidationError as exc:
            raise _invalid(exc, ("speculative",)) from None
    request.check_supported()
    return request


def _invalid(exc: ValidationError, within: tuple[str, ...] = ()) -> ApiError:
    """A 400 naming the first invalid field (its path under `within`) and why."""
    error = exc.errors()[0]
    loc = [*within, *(str(part) for part in error["loc"])]
    field = loc[0] if loc else None
    where = ".".join(loc) or "body"
    message = f"{where}: {error['msg']}" if error["type"] != "missing" else f"{field} is required"
    return bad_request(message, field)


def sampling_params(request: _CommonRequest, limits: ServerConfig, prompt_len: int,
                    context_len: int | None) -> SamplingParams:
    """The request's sampling settings as SamplingParams, with OpenAI's ranges and the server's limits."""
    max_tokens = request.max_tokens_requested()
    if max_tokens is None:
        room = context_len - prompt_len if context_len else limits.default_max_tokens
        max_tokens = max(1, min(limits.default_max_tokens, room))
    elif not (1 <= max_tokens <= limits.max_tokens_limit):
        raise bad_request(f"max_tokens must be between 1 and {limits.max_tokens_limit}, got {max_tokens}",
                          "max_tokens")
    if context_len and prompt_len + max_tokens > context_len:
        raise bad_request(f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                          f"context of {context_len} tokens; shorten the prompt or lower max_tokens", "max_tokens")
    temperature = 1.0 if request.temperature is None else request.temperature
    if not (0.0 <= temperature <= MAX_TEMPERATURE):
        raise bad_request(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {temperature}", "temperature")
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
    for text in stop:
        try:
            check_text(text, "a stop string")
        except SpecdraftError as exc:
            raise bad_request(str(exc), "stop") from None
    if request.seed is not None and not (0 <= request.seed <= MAX_SEED):
        raise bad_request(f"seed must be between 0 and {MAX_SEED}, got {request.seed}", "seed")
    for name, value in (("top_p", request.top_p), ("top_k", request.top_k)):
        if value is not None and (value != value or value < 0):  # NaN or negative
            raise bad_request(f"{name} must be >= 0, got {value}", name)
    try:
        return SamplingParams(temperature=temperature, top_k=request.top_k or 0,
                              top_p=1.0 if request.top_p is None else request.top_p, max_new_tokens=max_tokens,
                              stop=stop, seed=request.seed)
    except SpecdraftError as exc:
        raise bad_request(str(exc), _param_of(str(exc), ("temperature", "top-k", "top-p", "stop"))) from None


def spec_config(request: _CommonRequest, default: SpecConfig) -> SpecConfig:
    """The server's SpecConfig with the request's `speculative` overrides."""
    if request.speculative is None:
        return default
    overrides = {k: v for k, v in request.speculative.model_dump().items() if v is not None}
    for name in ("lookup_first", "gamma"):  # "auto" is SpecConfig's None (None above meant "the server's")
        if overrides.get(name) == "auto":
            overrides[name] = None
    if "method" in overrides and "tree" not in overrides:
        overrides["tree"] = None  # a request naming its method drafts what its spelling says (NAME-tree: trees)
    settings = {name: overrides.pop(name) for name in list(overrides)
                if name not in ("method", "gamma", "lookup_first", "tree")}
    if settings:  # drafter settings (registry.py)
        overrides["options"] = {**dict(default.options), **settings}
    try:
        spec = replace(default, **overrides)
    except SpecdraftError as exc:
        raise bad_request(f"speculative: {exc}", "speculative") from None
    if spec.method == "ar" and request.speculative.gamma is not None:
        raise bad_request("speculative.gamma has no effect with method 'ar' (it drafts nothing); leave gamma out or "
                          "choose a speculative method", "speculative")
    return spec


def _param_of(message: str, names: tuple[str, ...]) -> str | None:
    message = message.removeprefix("SamplingParams.")  # the config's own type checks name the field so
    for name in names:
        if message.startswith(name) or message.startswith(name.replace("-", "_")):
            return name.replace("-", "_")
    return None
