"""One worker thread runs generations one at a time, in arrival order, from a bounded queue.

The event loop never runs the model: a handler submits a Job and awaits its events, which the worker hands
back with `loop.call_soon_threadsafe`. A job is stopped between target passes when its client goes away or
the server shuts down; the worker then closes the generation (which ends the loop and frees its caches) and
takes the next job.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass, field

from ..engine import Generation
from ..errors import SpecdraftError
from ..types import GenerationResult
from .metrics import ServerMetrics
from .protocol import ApiError

log = logging.getLogger("specdraft.server")


@dataclass
class TextEvent:
    choice: int
    text: str


@dataclass
class ChoiceEvent:
    choice: int
    result: GenerationResult


@dataclass
class ErrorEvent:
    error: ApiError


@dataclass
class DoneEvent:
    pass


Event = TextEvent | ChoiceEvent | ErrorEvent | DoneEvent


@dataclass
class Job:
    """One request's generations (its choices, run in order) and the channel back to its handler."""

    generations: list[Generation]
    loop: asyncio.AbstractEventLoop
    new_prompt: list[bool]  # per choice: the first choice of its prompt (its prompt tokens count once)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stopped: threading.Event = field(default_factory=threading.Event)
    stop_error: ApiError | None = None

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def stop(self, error: ApiError | None = None) -> None:
        """Stop at the next pass; `error` is sent to the client (None: the client has gone)."""
        self.stop_error = error
        self.stopped.set()


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class Scheduler:
    def __init__(self, max_queue: int, metrics: ServerMetrics):
        self.max_queue = max_queue
        self.metrics = metrics
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._closed = False
        self.draining = False
        self._thread = threading.Thread(target=self._loop, name="specdraft-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def submit(self, job: Job) -> None:
        with self._cond:
            if self.draining or self._closed:
                raise ShuttingDown()
            if len(self._waiting) >= self.max_queue and (self._running is not None or self._waiting):
                raise QueueFull()
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def begin_drain(self, timeout_s: float) -> None:
        """Refuse new jobs; those queued or running still get `timeout_s` to finish, then end with an error. Called
        again while draining (a second SIGTERM or Ctrl-C), it ends the grace period at once."""
        with self._cond:
            again, self.draining = self.draining, True
        if again:
            log.info("second stop signal: ending what is left now")
            self.abort_all()
            return
        log.info("draining: %d running, %d queued; %.0f s to finish", int(self.busy), self.queued, timeout_s)
        timer = threading.Timer(timeout_s, self.abort_all)
        timer.daemon = True
        timer.start()

    def abort_all(self) -> None:
        error = ApiError(503, "the server is shutting down; retry on another instance",
                         type="server_error", code="server_shutting_down")
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
            self.metrics.queue_depth.set(0)
            running = self._running
        for job in waiting:
            job.stop(error)
            job.emit(ErrorEvent(error))
        if running is not None:
            running.stop(error)

    def close(self, timeout_s: float = 10.0) -> None:
        self.abort_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed and not self._waiting:
                    return
                job = self._running = self._waiting.popleft()
                self.metrics.queue_depth.set(len(self._waiting))
            self.metrics.running.set(1)
            try:
                self._run(job)
            except Exception as exc:  # a bug must not take the worker down with it
                log.exception("generation failed")
                job.emit(ErrorEvent(ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                             type="server_error")))
            finally:
                with self._cond:
                    self._running = None
                self.metrics.running.set(0)

    def _run(self, job: Job) -> None:
        for index, generation in enumerate(job.generations):
            if job.stopped.is_set():
                break
            chunks = iter(generation)
            try:
                for chunk in chunks:
                    job.emit(TextEvent(index, chunk.text))
                    if job.stopped.is_set():
                        break
            except SpecdraftError as exc:
                job.emit(ErrorEvent(ApiError(400, str(exc))))
                return
            finally:
                chunks.close()  # ends the loop at once: caches freed, nothing runs on
                self.metrics.record_generation(generation.stats, count_prompt=job.new_prompt[index])
            if not job.stopped.is_set():
                job.emit(ChoiceEvent(index, generation.result()))
        if job.stopped.is_set():
            if job.stop_error is not None:
                job.emit(ErrorEvent(job.stop_error))
            return
        job.emit(DoneEvent())
