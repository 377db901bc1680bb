"""`specdraft serve`: load the models once, then run the app on uvicorn with a graceful SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

import uvicorn

from ..api import load_draft
from ..drafters import needs_draft_model
from ..models.fetch import vocabulary_mismatch
from ..config import ModelConfig, SpecConfig
from ..models.adapter import load_model, set_threads
from .app import create_app, new_scheduler
from .config import ServerConfig
from .scheduler import Scheduler


class DrainingServer(uvicorn.Server):
    """uvicorn, plus: on SIGTERM/SIGINT the scheduler refuses new work and gives what is queued or running
    `shutdown_timeout_s` to finish; whatever is left then ends with a 503 error (at once on a second signal).
    uvicorn itself stops listening and waits for the open responses, a few seconds longer than that, so none
    vanish."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, drain_timeout_s: float):
        super().__init__(config)
        self.scheduler, self.drain_timeout_s = scheduler, drain_timeout_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT):
            self.scheduler.begin_drain(self.drain_timeout_s)
        super().handle_exit(sig, frame)


def build_server(app, config: ServerConfig) -> DrainingServer:
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               timeout_graceful_shutdown=int(config.shutdown_timeout_s) + 5,
                               access_log=config.log_level in ("debug", "trace"))
    return DrainingServer(uv_config, app.state.server.scheduler, config.shutdown_timeout_s)


def serve(models: ModelConfig, spec: SpecConfig, config: ServerConfig, progress: bool = True) -> None:
    """Load the target (and the draft, when one is named: any request may then ask for method 'draft'), on the
    scheduler's worker thread: the thread that will run them (see Scheduler)."""
    scheduler = new_scheduler(config)
    scheduler.start()

    def load() -> tuple:
        set_threads(models.threads)
        target = load_model(models.target, models.dtype, models.cache_dir, progress, models.backend)
        if not needs_draft_model(spec.method) and vocabulary_mismatch(models.draft, target.tokenizer):
            print(f"specdraft: {models.draft!r} cannot draft for this target (another vocabulary): serving without a "
                  "draft model", file=sys.stderr, flush=True)
            return target, None
        return target, load_draft(models, target, progress)

    try:
        target, draft = scheduler.run_on_worker(load)
        app = create_app(config, spec, target, draft, scheduler)
    except KeyboardInterrupt:
        # the worker cannot be stopped inside a load, and a process that ends while it runs may crash in its
        # exit: leave at once, as an interrupted load on the main thread would
        print("specdraft: interrupted", file=sys.stderr, flush=True)
        os._exit(130)
    except BaseException:
        scheduler.close()
        raise
    server = build_server(app, config)
    print(f"specdraft: serving {app.state.server.model_name!r} ({spec.name}, gamma {spec.gamma_shown}, max batch "
          f"{app.state.server.config.max_batch}) on http://{config.host}:{config.port}/v1", flush=True)
    # uvicorn re-raises the signal it stopped on once it is done; by then the shutdown was graceful, so that
    # signal only has to end run() here (the CLI then exits 0)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("specdraft: server stopped", flush=True)
