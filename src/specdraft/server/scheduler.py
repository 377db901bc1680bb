"""One worker thread runs every generation, several in each target pass (continuous batching).

The event loop never runs the model: a handler submits a Job (one Generation per choice) and awaits its events,
which the worker hands back with `loop.call_soon_threadsafe`. Between two passes the worker
  0. runs what other threads asked of it (`run_on_worker`: loading, engines, drafters; see Scheduler);
  1. lets go of the requests that were stopped (client gone, shutdown): their caches are freed at once;
  2. admits waiting jobs, in arrival order, while the running choices stay within `max_batch`;
  3. takes one chunk (`prefill_chunk` tokens) of the oldest request still prefilling, so that a long
     prompt delays the running requests by one chunk per pass, not by its whole prefill;
  4. runs one target pass for every request past its prefill: each drafts for itself, knowing how full the
     pass is (`propose_together`), and the pending tokens and drafts of all go through the weights at once
     (`verify_together`), the prefill chunk with them (where nothing shares the pass, the chunk runs on its
     own first); each accepts on its own, streams its text and, at its end, leaves.
A request's tokens never depend on who shares its passes: the kernels are batch-invariant (a row's logits are
the same bits alone or in a pass of many), and each request has its own drafter, generator and statistics.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from ..engine import Generation, prefill_rides, propose_together, shares_pass, verify_together
from ..errors import SpecdraftError
from ..types import GenerationResult
from .config import INTERLEAVED_MAX_BATCH, ServerConfig
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


@dataclass(eq=False)
class Job:
    """One request's generations (its choices, run side by side) and the channel back to its handler."""

    generations: list[Generation]
    loop: asyncio.AbstractEventLoop
    new_prompt: list[bool]  # per choice: the first choice of its prompt (its prompt tokens count once)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stopped: threading.Event = field(default_factory=threading.Event)
    stop_error: ApiError | None = None
    submitted: float = field(default_factory=time.perf_counter)
    running: int = 0  # choices admitted and not yet ended
    completed: int = 0  # choices answered to the end
    ticket: int = -1  # its place in arrival order (Scheduler.reserve)

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def stop(self, error: ApiError | None = None) -> None:
        """Stop at the next pass; `error` is sent to the client (None: the client has gone)."""
        self.stop_error = error
        self.stopped.set()


@dataclass(eq=False)
class Slot:
    """One running choice of a job."""

    job: Job
    choice: int
    opened: bool = False  # its generation started (a request stopped while it waited never does)

    @property
    def generation(self) -> Generation:
        return self.job.generations[self.choice]

    @property
    def decoding(self) -> bool:
        """Past its prefill: in the next target pass."""
        loop = self.generation.loop
        return loop is not None and not loop.prefilling


def request_error(exc: Exception) -> ApiError:
    """A failure of one request's own work: a 400 for what the request asked (SpecdraftError), else a 500."""
    if isinstance(exc, SpecdraftError):
        return ApiError(400, str(exc))
    log.exception("a request failed")
    return internal_error(exc)


def internal_error(exc: Exception) -> ApiError:
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


T = TypeVar("T")


class Scheduler:
    """Runs every request's passes on one worker thread. That thread is also the only one of a server that runs
    torch's parallel work (loading, building engines and drafters: `run_on_worker`): a second thread with an
    OpenMP team of its own puts more OpenMP threads in the process than there are cores, and libgomp then stops
    spinning between parallel regions (its throttled spin count), so every region waits on a futex wake-up: one
    1.5B loaded on one thread and decoding on another ran 21 tok/s, 32 on one thread (Zen 3, 2026-12-04)."""

    def __init__(self, max_queue: int, metrics: ServerMetrics, max_batch: int = INTERLEAVED_MAX_BATCH,
                 prefill_chunk: int = ServerConfig.prefill_chunk):
        self.max_queue, self.metrics, self.max_batch, self.prefill_chunk = max_queue, metrics, max_batch, prefill_chunk
        self._waiting: collections.deque[Job] = collections.deque()  # in order of arrival (their tickets)
        self._reserved: set[int] = set()  # tickets of requests that arrived and are being tokenized
        self._next_ticket = 0
        self._slots: list[Slot] = []  # running choices, in admission order (the worker changes it under _cond)
        self._cond = threading.Condition()
        self._closed = False
        self.draining = False
        self._calls: collections.deque[tuple[Callable[[], object], concurrent.futures.Future]] = collections.deque()
        self._thread = threading.Thread(target=self._loop, name="specdraft-worker", daemon=True)

    def start(self) -> None:
        """Start the worker (once; later calls do nothing)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the scheduler was closed")
            if self._thread.ident is None:
                self._thread.start()

    def run_on_worker(self, fn: Callable[[], T]) -> T:
        """fn() on the worker thread, between two passes, and its result (or its exception) here; at once when
        called on the worker itself or before the worker starts."""
        if threading.current_thread() is self._thread or self._thread.ident is None:
            return fn()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed or not self._thread.is_alive():
                raise ShuttingDown()
            self._calls.append((fn, future))
            self._cond.notify()
        return future.result()

    def _run_calls(self) -> None:
        with self._cond:
            calls, self._calls = list(self._calls), collections.deque()
        for fn, future in calls:
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller gets it; the worker goes on
                future.set_exception(exc)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Choices admitted and not yet ended."""
        return len(self._slots)

    @property
    def busy(self) -> bool:
        return bool(self._slots)

    def reserve(self) -> int:
        """A place for a request that just arrived, taken before it is tokenized, so that places go in arrival
        order: a ticket for `submit` (or `cancel`). QueueFull when the free places of the batch and `max_queue`
        waiting places are all taken."""
        with self._cond:
            if self.draining or self._closed:
                raise ShuttingDown()
            places = self.max_queue + max(self.max_batch - len(self._slots), 0)
            if len(self._waiting) + len(self._reserved) >= places and (self._slots or self._waiting or self._reserved):
                raise QueueFull()
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
            self._reserved.add(ticket)
            return ticket

    def cancel(self, ticket: int) -> None:
        """The request of `ticket` will not come (it was refused while being prepared)."""
        with self._cond:
            self._reserved.discard(ticket)

    def submit(self, job: Job, ticket: int) -> None:
        """The job of a reserved place joins the queue, ahead of those that arrived after it."""
        with self._cond:
            self._reserved.discard(ticket)
            if self.draining or self._closed:
                raise ShuttingDown()
            job.ticket = ticket
            position = len(self._waiting)
            while position and self._waiting[position - 1].ticket > ticket:
                position -= 1
            self._waiting.insert(position, job)
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
        log.info("draining: %d running, %d queued; %.0f s to finish", self.running, self.queued, timeout_s)
        timer = threading.Timer(timeout_s, self.abort_all)
        timer.daemon = True
        timer.start()

    def abort_all(self) -> None:
        error = ApiError(503, "the server is shutting down; retry on another instance",
                         type="server_error", code="server_shutting_down")
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
            self.metrics.queue_depth.set(0)
            running = {id(slot.job): slot.job for slot in self._slots}
        for job in waiting:
            job.stop(error)
            for generation in job.generations:  # never opened: only their drafters go back to the pool
                generation.close()
            job.emit(ErrorEvent(error))
        for job in running.values():
            job.stop(error)

    def close(self, timeout_s: float = 10.0) -> None:
        self.abort_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        with self._cond:
            calls, self._calls = list(self._calls), collections.deque()
        for _, future in calls:
            future.set_exception(ShuttingDown())

    # ---- the worker ----

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._slots and not self._calls and not self._closed:
                    self._cond.wait()
                if self._closed and not self._waiting and not self._slots:
                    return
            self._run_calls()
            with self._cond:
                self._admit()
            try:
                with torch.inference_mode():
                    self._step()
            except Exception as exc:  # the shared pass failed: every request in it gets the error
                log.exception("a target pass failed")
                for job in {id(slot.job): slot.job for slot in self._slots}.values():
                    try:
                        self._fail(job, internal_error(exc))
                    except Exception:  # the worker must live on: the others are waiting for it
                        log.exception("ending a failed request failed")

    def _admit(self) -> None:
        """Waiting jobs join, in arrival order, while the running choices stay within max_batch (a job with more
        choices than that runs when nothing else does). Called under _cond."""
        while self._waiting:
            job = self._waiting[0]
            if self._slots and len(self._slots) + len(job.generations) > self.max_batch:
                break
            self._waiting.popleft()
            self.metrics.queue_depth.set(len(self._waiting))
            self.metrics.queue_wait.observe(time.perf_counter() - job.submitted)
            job.running = len(job.generations)
            self._slots.extend(Slot(job, choice) for choice in range(len(job.generations)))
        self.metrics.running.set(len(self._slots))

    def _step(self) -> None:
        # 1. stopped requests leave
        for slot in [slot for slot in self._slots if slot.job.stopped.is_set()]:
            self._end(slot)
        # 2. one chunk of the oldest prefill: it rides in this step's shared pass where it can (the weights are read
        # once for both), else it runs on its own first
        prefill: tuple[Slot, list[int]] | None = None
        waiting_prefill = next((slot for slot in self._slots if not slot.decoding), None)
        if waiting_prefill is not None:
            try:
                if waiting_prefill.generation.loop is None:
                    waiting_prefill.generation.open(prefill_by_chunks=True)
                    waiting_prefill.opened = True
                prefill = (waiting_prefill, waiting_prefill.generation.loop.prefill_chunk(self.prefill_chunk))
            except Exception as exc:  # this request's alone: the others go on
                self._fail(waiting_prefill.job, request_error(exc))
        running = [slot for slot in self._slots if slot.decoding]
        if prefill is not None and not (running and prefill[1]):
            self._prefill_alone(*prefill)
            prefill = None
            running = [slot for slot in self._slots if slot.decoding]  # the one whose prefill ended joins
        # 3. one target pass for every request past its prefill
        if not running:
            return
        loops = [slot.generation.loop for slot in running]
        errors: dict[int, Exception] = {}  # a request's own failure (its drafter, a pass of its own): it alone ends
        riding = 0 if prefill is None else len(prefill[1])
        drafts = propose_together(loops, joining=len(self._slots) - len(running), errors=errors, riding=riding)
        if prefill is not None and not prefill_rides(prefill[0].generation.loop, prefill[1], loops, drafts):
            self._prefill_alone(*prefill)
            prefill, riding = None, 0
        started = time.perf_counter()
        logits = verify_together(loops, drafts, errors,  # [k + 1, V] each (None where it failed)
                                 None if prefill is None else (prefill[0].generation.loop, prefill[1]))
        if prefill is not None:
            self.metrics.prefill_tokens.labels("shared").inc(riding)
            try:
                prefill[0].generation.loop.prefill_ran(riding, time.perf_counter() - started)
            except Exception as exc:  # its prompt's end (prefix cache, drafter begin) failed: it alone ends
                self._fail(prefill[0].job, request_error(exc))
        for i, exc in errors.items():
            if running[i] in self._slots:
                self._fail(running[i].job, request_error(exc))
        # the passes verify_together ran: one shared by those that could share it (two or more), one per other
        sharing = [shares_pass(loop, draft) for loop, draft in zip(loops, drafts)]
        together = sum(sharing) > 1
        if together or riding:
            verified = sum(draft.k + 1 for draft, shared in zip(drafts, sharing) if shared)
            self.metrics.record_pass(sum(sharing), riding + verified)
        for draft, shared in zip(drafts, sharing):
            if not ((together or riding) and shared):
                self.metrics.record_pass(1, draft.k + 1)
        for slot, rows in zip(running, logits):
            if slot not in self._slots:  # its job failed (with another of its choices)
                continue
            try:
                chunks, ended = slot.generation.accept(rows)
            except Exception as exc:  # this request's alone: the others go on
                self._fail(slot.job, request_error(exc))
                continue
            for chunk in chunks:
                slot.job.emit(TextEvent(slot.choice, chunk.text))
            if ended:
                slot.job.emit(ChoiceEvent(slot.choice, slot.generation.result()))
                slot.job.completed += 1
                self._end(slot)

    def _prefill_alone(self, slot: Slot, chunk: list[int]) -> None:
        """A prefill chunk in a pass of its own (nothing to share one with)."""
        if slot not in self._slots:
            return
        loop = slot.generation.loop
        started = time.perf_counter()
        try:
            if chunk:
                loop.state.forward(chunk, 1)
            loop.prefill_ran(len(chunk), time.perf_counter() - started)
            self.metrics.prefill_tokens.labels("alone").inc(len(chunk))
        except Exception as exc:  # this request's alone: the others go on
            self._fail(slot.job, request_error(exc))

    def _end(self, slot: Slot) -> None:
        """The choice leaves: its caches and drafter are let go, its counts recorded; the job's last choice to
        leave sends the job's end (done, or the error it was stopped with)."""
        job = slot.job
        generation = slot.generation
        with self._cond:
            self._slots.remove(slot)
            self.metrics.running.set(len(self._slots))
        job.running -= 1
        try:
            generation.close()
            if slot.opened:  # a request stopped before it ran counts nothing
                self.metrics.record_generation(generation.stats, count_prompt=job.new_prompt[slot.choice])
        except Exception:
            log.exception("closing a generation failed")
        finally:
            if job.running == 0:
                # every choice answered (a stop that came during the last pass is too late to matter): done
                if job.completed == len(job.generations) or not job.stopped.is_set():
                    job.emit(DoneEvent())
                elif job.stop_error is not None:
                    job.emit(ErrorEvent(job.stop_error))

    def _fail(self, job: Job, error: ApiError) -> None:
        """The job ends with `error`; its other choices leave too."""
        job.stop(error)
        for slot in [slot for slot in self._slots if slot.job is job]:
            self._end(slot)
