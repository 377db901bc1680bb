"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions (streamed as server-sent events or
not), /v1/models, /health and /metrics.

A generation request goes through three steps:
  1. parse and validate (event loop; JSON only): a mistake is a 400/404 in OpenAI's error shape;
  2. prepare (a thread pool): tokenize, have the worker build (between two passes) the engine for its
     speculative settings and the drafters the requests in flight will need, one Generation per choice; a prompt
     that does not fit the context is a 400 here, before it takes a place in the queue;
  3. submit to the Scheduler (full queue: 429 with Retry-After) and relay its events as they come.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import SpecConfig
from ..drafters import build_drafter
from ..engine import Engine, Generation, check_text
from ..errors import SpecdraftError
from ..models.adapter import LoadedModel
from ..models.verify_curve import batch_curve, draft_price, max_batch_that_pays, verify_curve
from ..prefix_cache import PrefixCache
from ..types import GenerationResult
from .config import INTERLEAVED_MAX_BATCH, ServerConfig
from .metrics import CLIENT_CLOSED, ServerMetrics
from .protocol import (ApiError, ChatRequest, CompletionRequest, bad_request, parse_request, sampling_params,
                       spec_config)
from .scheduler import ChoiceEvent, DoneEvent, ErrorEvent, Job, QueueFull, Scheduler, ShuttingDown, TextEvent

log = logging.getLogger("specdraft.server")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENGINE_CACHE_SIZE = 8  # engines by SpecConfig; building one checks the draft's vocabulary (~0.1 s on Qwen)


@dataclass
class ServerState:
    """Everything a handler needs; lives on app.state.server."""

    config: ServerConfig
    spec: SpecConfig  # the defaults a request's `speculative` field overrides
    target: LoadedModel
    draft: LoadedModel | None
    model_name: str
    metrics: ServerMetrics
    scheduler: Scheduler
    created: int

    def __post_init__(self) -> None:
        self._engines: dict[SpecConfig, Engine] = {}
        self._engines_lock = threading.Lock()
        # one for every engine of the target: methods share the prompts' K/V
        self.prefix_cache = PrefixCache(self.config.prefix_cache_mb << 20) if self.config.prefix_cache_mb else None

    def engine(self, spec: SpecConfig) -> Engine:
        """An engine for `spec`, built once, on the worker thread once it runs (before, on the caller's:
        `create_app`'s callers that load their models themselves should start the scheduler and load through it,
        as `serve` does). Requests in flight together each take a drafter of their own from its pool
        (`Engine.acquire_drafter`, in the worker; `prepare` fills the pool beforehand)."""
        with self._engines_lock:
            engine = self._engines.get(spec)
        return engine if engine is not None else self.on_worker(lambda: self._build_engine(spec))

    def on_worker(self, fn):
        """fn() on the scheduler's worker, the one thread that runs torch's parallel work (see Scheduler); a 503
        once the server shuts down."""
        try:
            return self.scheduler.run_on_worker(fn)
        except ShuttingDown:
            raise shutting_down() from None

    def _build_engine(self, spec: SpecConfig) -> Engine:
        with self._engines_lock:
            engine = self._engines.get(spec)
            if engine is None:
                drafter = build_drafter(spec, self.target, self.draft)  # fails at once where it cannot be built
                curve = verify_curve(self.target, spec.draft_len + 1) if spec.adaptive_gamma else None
                price = draft_price(self.target, drafter) if spec.adaptive_gamma else 1.0
                engine = Engine(self.target, drafter, spec,
                                new_drafter=lambda: build_drafter(spec, self.target, self.draft), curve=curve,
                                prefix_cache=self.prefix_cache, draft_price=price)
                if len(self._engines) >= ENGINE_CACHE_SIZE:
                    self._engines.pop(next(iter(self._engines)))
                self._engines[spec] = engine
            return engine


def new_scheduler(config: ServerConfig) -> Scheduler:
    """The scheduler for `config` (an auto max batch is set by create_app, once the target is loaded)."""
    return Scheduler(config.max_queue, ServerMetrics(), config.max_batch or INTERLEAVED_MAX_BATCH, config.prefill_chunk)


def resolve_max_batch(config: ServerConfig, target: LoadedModel, scheduler: Scheduler) -> ServerConfig:
    """`config` with max_batch auto (None) made a number: the largest batch whose passes pay on this machine
    (`batch_curve`, measured on the worker once per machine and cached; `max_batch_that_pays`), or
    INTERLEAVED_MAX_BATCH where requests' passes are not shared."""
    if config.max_batch is not None:
        return config
    curve = scheduler.run_on_worker(lambda: batch_curve(target))
    return replace(config, max_batch=INTERLEAVED_MAX_BATCH if curve is None else max_batch_that_pays(curve))


def create_app(config: ServerConfig, spec: SpecConfig, target: LoadedModel,
               draft: LoadedModel | None = None, scheduler: Scheduler | None = None) -> FastAPI:
    """The app for already-loaded models. The worker thread starts (unless `scheduler`'s already has: `serve`
    loads the models on it, the thread that runs them; see Scheduler for why) and stops with the app's lifespan."""
    scheduler = scheduler or new_scheduler(config)
    config = resolve_max_batch(config, target, scheduler)
    scheduler.max_batch = config.max_batch
    metrics = scheduler.metrics
    state = ServerState(config=config, spec=spec, target=target, draft=draft,
                        model_name=config.model_name or target.name, metrics=metrics,
                        scheduler=scheduler, created=int(time.time()))
    state.engine(spec)  # the server's own settings must work before it listens (e.g. draft vocabulary)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        yield
        state.scheduler.close()

    app = FastAPI(title="specdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(ApiError(exc.status_code, str(exc.detail),
                                       type="invalid_request_error" if exc.status_code < 500 else "server_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(bad_request(str(exc.errors()[0].get("msg", "invalid request"))))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    @app.get("/health")
    async def health():
        draining = state.scheduler.draining
        body = {"status": "draining" if draining else "ok", "model": state.model_name,
                "running": state.scheduler.running, "queued": state.scheduler.queued,
                "max_queue": config.max_queue, "max_batch": config.max_batch,
                "speculative": {"method": spec.name, "gamma": spec.gamma_shown}}
        return JSONResponse(body, status_code=503 if draining else 200)

    @app.get("/metrics")
    async def prometheus_metrics():
        content, content_type = metrics.exposition()
        return Response(content, media_type=content_type)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        check_model(state, model_id)
        return model_card(state)

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        return await handle_generation(state, request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request):
        return await handle_generation(state, request, CHAT)

    return app


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "specdraft"}


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


# ---- one generation request ----


@dataclass
class Prepared:
    """A validated request turned into generations, one per choice (prompt-major: prompt p, sample i)."""

    request: CompletionRequest | ChatRequest
    spec: SpecConfig
    generations: list[Generation]
    new_prompt: list[bool]  # per choice: first of its prompt


async def handle_generation(state: ServerState, request: Request, endpoint: str) -> Response:
    arrived = time.perf_counter()
    try:
        model = CompletionRequest if endpoint == COMPLETIONS else ChatRequest
        parsed = parse_request(await read_body(request, state.config.max_body_bytes), model, state.config)
        check_model(state, parsed.model)
        # the place in the queue is taken now, in arrival order (429 falls on the latest arrivals), and
        # tokenizing happens after
        ticket = reserve(state)
        try:
            prepared = await run_in_threadpool(prepare, state, parsed, endpoint)
        except BaseException:
            state.scheduler.cancel(ticket)
            raise
        job = Job(prepared.generations, asyncio.get_running_loop(), prepared.new_prompt)
        submit(state, job, ticket)
    except ApiError as error:
        state.metrics.requests.labels(endpoint, str(error.status)).inc()
        return error_response(error)
    reply = Reply(state, endpoint, prepared, job, arrived)
    if parsed.stream:
        return EventStream(reply)
    return await reply.collect(request)


class EventStream(StreamingResponse):
    """The SSE response of one job. A client can go before the first event is even asked for, in which case
    the event generator never starts (and its `finally` never runs): the job is abandoned here instead."""

    def __init__(self, reply: "Reply"):
        super().__init__(reply.events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.reply = reply

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.reply.abandon()


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` bytes: before reading it when its length is
    declared, while reading it when it comes in chunks."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes")
    return bytes(body)


def reserve(state: ServerState) -> int:
    try:
        return state.scheduler.reserve()
    except QueueFull:
        raise ApiError(429, f"the server is busy: {state.scheduler.queued} requests are waiting (the limit); "
                            f"retry after {state.config.retry_after_s} s", type="rate_limit_error",
                       code="queue_full", headers={"Retry-After": str(state.config.retry_after_s)}) from None
    except ShuttingDown:
        raise shutting_down() from None


def submit(state: ServerState, job: Job, ticket: int) -> None:
    try:
        state.scheduler.submit(job, ticket)
    except ShuttingDown:
        raise shutting_down() from None


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another instance", type="server_error",
                    code="server_shutting_down")


def prepare(state: ServerState, request: CompletionRequest | ChatRequest, endpoint: str) -> Prepared:
    """Tokenize, choose the engine, and build one Generation per choice (runs in a thread pool)."""
    spec = spec_config(request, state.spec)
    try:
        engine = state.engine(spec)
    except SpecdraftError as exc:
        raise bad_request(f"speculative: {exc}", "speculative") from None
    prompts = encode_prompts(engine, request, endpoint)
    if len(prompts) > state.config.max_choices:
        raise bad_request(f"at most {state.config.max_choices} prompts in one request, got {len(prompts)}", "prompt")
    if not (1 <= request.n <= state.config.max_choices // len(prompts)):
        raise bad_request(f"n must be between 1 and {state.config.max_choices // len(prompts)} for "
                          f"{len(prompts)} prompt(s) on this server, got {request.n}", "n")
    generations, new_prompt = [], []
    for prompt_ids in prompts:
        params = sampling_params(request, state.config, len(prompt_ids), engine.max_positions)
        for i in range(request.n):
            # choice i of a seeded request uses seed + i: choice 0 is what the engine gives for that seed
            choice_params = params if params.seed is None else replace(params, seed=params.seed + i)
            try:
                generations.append(engine.stream(prompt_ids, choice_params))
            except SpecdraftError as exc:
                raise bad_request(str(exc)) from None
            new_prompt.append(i == 0)
    # the drafters the requests in flight will need, built before the request queues rather than when a pass
    # admits it (3 ms for the 0.5B draft, an EAGLE head read from disk): at most max_batch, or this request's choices
    wanted = max(min(state.scheduler.running + len(generations), state.config.max_batch), len(generations))
    try:
        if engine.drafters_missing(wanted):
            state.on_worker(lambda: engine.ensure_drafters(wanted))
    except SpecdraftError as exc:
        raise bad_request(f"speculative: {exc}", "speculative") from None
    return Prepared(request, spec, generations, new_prompt)


def encode_prompts(engine: Engine, request: CompletionRequest | ChatRequest, endpoint: str) -> list[list[int]]:
    if endpoint == CHAT:
        if not request.messages:
            raise bad_request("messages must not be empty", "messages")
        if not getattr(engine.target.tokenizer, "chat_template", None):
            raise bad_request(f"the model {engine.target.name!r} has no chat template; use /v1/completions",
                              "messages")
        try:
            ids = engine.encode_messages([m.as_template_message() for m in request.messages])
        except SpecdraftError as exc:
            raise bad_request(str(exc), "messages") from None
        except Exception as exc:  # the model's own template rejected the conversation (jinja raise_exception)
            raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
        return [ids]
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt, list) and all(isinstance(p, list) for p in prompt):  # token ids, one list per prompt
        try:
            return [engine.check_prompt_ids(ids) for ids in prompt]  # the engine's own check, before queueing
        except SpecdraftError as exc:
            raise bad_request(str(exc), "prompt") from None
    texts = [prompt] if isinstance(prompt, str) else prompt
    prompts = []
    for text in texts:
        try:
            check_text(text, "the prompt")
        except SpecdraftError as exc:
            raise bad_request(str(exc), "prompt") from None
        # as vLLM: a prompt of blanks is text like any other; one with no tokens at all is refused
        ids = list(engine.target.tokenizer(text, add_special_tokens=True)["input_ids"])
        if not ids:
            raise bad_request("prompt must not be empty" if not text else
                              f"the prompt {text!r} has no tokens", "prompt")
        prompts.append(ids)
    return prompts


class Reply:
    """Turns a job's events into an OpenAI response: one JSON body, or server-sent event chunks."""

    def __init__(self, state: ServerState, endpoint: str, prepared: Prepared, job: Job, arrived: float):
        self.state, self.endpoint, self.prepared, self.job, self.arrived = state, endpoint, prepared, job, arrived
        self.chat = endpoint == CHAT
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.results: dict[int, GenerationResult] = {}
        self.texts: dict[int, list[str]] = {}
        self.first_text_at: float | None = None
        self.finished = False  # the request's outcome is counted; later, nothing is stopped or counted again

    # -- shared bookkeeping --

    def _on_text(self, event: TextEvent) -> None:
        if self.first_text_at is None:
            self.first_text_at = time.perf_counter()
            self.state.metrics.time_to_first_token.observe(self.first_text_at - self.arrived)
        self.texts.setdefault(event.choice, []).append(event.text)

    def _finish(self, status: str) -> None:
        if self.finished:
            return
        self.finished = True
        self.state.metrics.requests.labels(self.endpoint, status).inc()
        if status == "200":
            self.state.metrics.latency.observe(time.perf_counter() - self.arrived)

    def abandon(self) -> None:
        """The client went away, or the response was cancelled: stop the job (freeing its slot) and count it."""
        if not self.finished:
            self.job.stop(None)
            self._finish(CLIENT_CLOSED)

    def _usage(self) -> dict:
        prompt = sum(len(r.prompt_ids) for i, r in self.results.items() if self.prepared.new_prompt[i])
        completion = sum(len(r.token_ids) for r in self.results.values())
        cached = sum(r.stats.cached_prompt_tokens for i, r in self.results.items() if self.prepared.new_prompt[i])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _summary(self) -> dict:
        """The request's acceptance statistics over all its choices (the extra response field)."""
        stats = [r.stats for r in self.results.values()]
        passes, drafted, accepted = (sum(getattr(s, k) for s in stats) for k in ("target_passes", "drafted",
                                                                                  "accepted"))
        new_tokens = sum(s.new_tokens for s in stats)
        return {"method": self.prepared.spec.name, "gamma": self.prepared.spec.gamma_shown,
                "target_passes": passes, "drafted": drafted, "accepted": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_draft_len": drafted / passes if passes else 0.0, "tau": new_tokens / passes if passes else 0.0}

    # -- not streamed --

    async def collect(self, request: Request) -> Response:
        watcher = asyncio.create_task(self._stop_on_disconnect(request))
        try:
            while True:
                event = await self.job.events.get()
                if isinstance(event, TextEvent):
                    self._on_text(event)
                elif isinstance(event, ChoiceEvent):
                    self.results[event.choice] = event.result
                elif isinstance(event, ErrorEvent):
                    self._finish(str(event.error.status))
                    return error_response(event.error)
                elif isinstance(event, DoneEvent):
                    body = self._body()
                    self._finish("200")
                    return JSONResponse(body)
        finally:
            watcher.cancel()
            self.abandon()

    async def _stop_on_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.abandon()
        self.job.events.put_nowait(ErrorEvent(ApiError(int(CLIENT_CLOSED), "the client closed the request")))

    def _body(self) -> dict:
        choices = []
        for index in sorted(self.results):
            result = self.results[index]
            choice = {"index": index, "logprobs": None, "finish_reason": result.stats.finish_reason,
                      "speculative_stats": result.stats.to_dict()}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice["text"] = result.text
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.state.model_name, "choices": choices,
                "usage": self._usage(), "speculative_stats": self._summary()}

    # -- streamed --

    def _chunk(self, index: int, text: str | None, finish_reason: str | None = None, **extra) -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        choice.update(extra)
        return self._envelope([choice])

    def _envelope(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.state.model_name, "choices": choices, **extra}

    async def events(self):
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""

        def sse(payload) -> str:
            return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

        try:
            if self.chat:  # the role comes first, in a chunk of its own, as OpenAI sends it
                for index in range(len(self.job.generations)):
                    first = self._chunk(index, None)
                    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield sse(first)
            while True:
                event = await self.job.events.get()
                if isinstance(event, TextEvent):
                    self._on_text(event)
                    yield sse(self._chunk(event.choice, event.text))
                elif isinstance(event, ChoiceEvent):
                    self.results[event.choice] = event.result
                    stats = event.result.stats
                    yield sse(self._chunk(event.choice, None if self.chat else "", stats.finish_reason,
                                          speculative_stats=stats.to_dict()))
                elif isinstance(event, ErrorEvent):
                    self._finish(str(event.error.status))  # before the last yields: a client leaving now is late
                    yield sse(event.error.body())
                    yield sse("[DONE]")
                    return
                elif isinstance(event, DoneEvent):
                    self._finish("200")
                    options = self.prepared.request.stream_options
                    if options is not None and options.include_usage:
                        yield sse(self._envelope([], usage=self._usage(), speculative_stats=self._summary()))
                    yield sse("[DONE]")
                    return
        finally:
            self.abandon()  # the client went away (the response was cancelled): stop and free the slot
