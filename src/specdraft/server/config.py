"""How the server runs: one typed dataclass, built by `specdraft serve` and by tests alike."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecdraftError

MAX_BATCH_LIMIT = 64  # the largest --max-batch (and the largest batch auto times)
# auto where requests' passes are not shared (the transformers backend): they take turns, so this many interleave
# for an earlier first token at no cost in throughput (one request's either way)
INTERLEAVED_MAX_BATCH = 16


@dataclass(frozen=True)
class ServerConfig:
    """Serving settings. Model and speculative defaults live in ModelConfig and SpecConfig."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # the id clients send as `model`; None: the target's name as given
    max_queue: int = 16  # requests waiting for a place in the running batch; one more gets 429
    # choices generated together, each target pass scoring all of them; None (auto): the largest batch this machine's
    # measured passes say pays (verify_curve.max_batch_that_pays; docs/server.md), resolved by create_app
    max_batch: int | None = None
    prefill_chunk: int = 128  # prompt tokens prefilled between two passes of the running requests
    prefix_cache_mb: int = 512  # prompts' K/V kept for later prompts that begin the same way (0: none)
    retry_after_s: int = 2  # the Retry-After header of a 429
    max_tokens_limit: int = 2048  # the largest max_tokens a request may ask for
    default_max_tokens: int = 256  # when a request gives none (cut to what the context leaves)
    max_choices: int = 8  # prompts x n in one request
    max_body_bytes: int = 1_000_000
    shutdown_timeout_s: float = 30.0  # on SIGTERM, requests still unfinished after this end with an error
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise SpecdraftError(f"port must be between 0 and 65535, got {self.port}")
        if self.max_queue < 0:
            raise SpecdraftError(f"max queue must be >= 0 (0: no request waits), got {self.max_queue}")
        if self.max_batch is not None and not 1 <= self.max_batch <= MAX_BATCH_LIMIT:
            raise SpecdraftError(f"max batch must be between 1 and {MAX_BATCH_LIMIT} (or auto), got {self.max_batch}")
        if not 1 <= self.prefill_chunk <= 65536:
            raise SpecdraftError(f"prefill chunk must be between 1 and 65536 tokens, got {self.prefill_chunk}")
        if not 0 <= self.prefix_cache_mb <= 1 << 20:
            raise SpecdraftError(f"prefix cache must be between 0 and {1 << 20} MiB, got {self.prefix_cache_mb}")
        if self.retry_after_s < 1:
            raise SpecdraftError(f"retry-after must be >= 1 second, got {self.retry_after_s}")
        if self.max_tokens_limit < 1:
            raise SpecdraftError(f"max tokens limit must be >= 1, got {self.max_tokens_limit}")
        if not (1 <= self.default_max_tokens <= self.max_tokens_limit):
            raise SpecdraftError(f"default max tokens must be between 1 and the max tokens limit "
                                 f"({self.max_tokens_limit}), got {self.default_max_tokens}")
        if self.max_choices < 1:
            raise SpecdraftError(f"max choices must be >= 1, got {self.max_choices}")
        if self.max_body_bytes < 1024:
            raise SpecdraftError(f"max body bytes must be >= 1024, got {self.max_body_bytes}")
        if self.shutdown_timeout_s < 0:
            raise SpecdraftError(f"shutdown timeout must be >= 0 seconds, got {self.shutdown_timeout_s}")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise SpecdraftError(f"unknown log level {self.log_level!r}; choose critical, error, warning, info, "
                                 "debug or trace")
