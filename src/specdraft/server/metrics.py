"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..config import MAX_GAMMA
from ..types import SpecStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
ACCEPTED_BUCKETS = tuple(float(n) for n in range(MAX_GAMMA + 1))
PASS_REQUESTS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
PASS_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# The status label of a request whose client went away before its answer was complete (nginx's convention).
CLIENT_CLOSED = "499"


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specdraft_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("specdraft_prompt_tokens", "Prompt tokens of generations run", registry=r)
        self.cached_prompt_tokens = Counter("specdraft_cached_prompt_tokens",
                                            "Prompt tokens whose K/V the prefix cache gave (not prefilled)", registry=r)
        self.generated_tokens = Counter("specdraft_generated_tokens", "Tokens generated (every choice)", registry=r)
        self.target_passes = Counter("specdraft_target_passes", "Forward passes of the target model", registry=r)
        self.drafted_tokens = Counter("specdraft_drafted_tokens", "Draft tokens proposed for verification",
                                      registry=r)
        self.accepted_tokens = Counter("specdraft_accepted_tokens", "Draft tokens the target kept", registry=r)
        self.accepted_per_pass = Histogram("specdraft_accepted_tokens_per_pass",
                                           "Draft tokens kept by each target pass", buckets=ACCEPTED_BUCKETS,
                                           registry=r)
        self.queue_depth = Gauge("specdraft_queue_depth", "Requests waiting for the worker", registry=r)
        self.running = Gauge("specdraft_running_requests", "Choices the worker is generating for (prefill included)",
                             registry=r)
        self.pass_requests = Histogram("specdraft_pass_requests", "Requests scored by each batched target pass",
                                       buckets=PASS_REQUESTS_BUCKETS, registry=r)
        self.pass_tokens = Histogram("specdraft_pass_tokens", "Tokens (pending, draft and a riding prefill chunk) in "
                                      "each batched target pass",
                                     buckets=PASS_TOKENS_BUCKETS, registry=r)
        self.prefill_tokens = Counter("specdraft_prefill_tokens", "Prompt tokens prefilled, by pass: shared (riding in "
                                      "the running requests' pass) or alone", ["pass_kind"], registry=r)
        self.queue_wait = Histogram("specdraft_queue_wait_seconds", "From a request's arrival in the queue to its "
                                    "admission into the running batch", buckets=LATENCY_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("specdraft_time_to_first_token_seconds",
                                             "From request arrival to its first generated text (queueing included)",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("specdraft_request_latency_seconds",
                                 "From request arrival to the end of its answer, for answered requests",
                                 buckets=LATENCY_BUCKETS, registry=r)

    def record_generation(self, stats: SpecStats, count_prompt: bool = True) -> None:
        """One finished (or stopped) generation's token and pass counts; choices 2..n of a prompt share its
        prompt tokens, so they pass count_prompt=False (as OpenAI's usage counts them once)."""
        if count_prompt:
            self.prompt_tokens.inc(stats.prompt_tokens)
            self.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        self.target_passes.inc(stats.target_passes)
        self.drafted_tokens.inc(stats.drafted)
        self.accepted_tokens.inc(stats.accepted)
        # acceptance keeps a prefix of each draft, so a pass kept position i exactly when it kept more than i
        # tokens: accepted_per_position[i] counts the passes with n_accepted > i, which gives the histogram.
        at_least = [stats.target_passes] + list(stats.accepted_per_position)
        for n_accepted in range(len(at_least)):
            passes = at_least[n_accepted] - (at_least[n_accepted + 1] if n_accepted + 1 < len(at_least) else 0)
            for _ in range(passes):
                self.accepted_per_pass.observe(n_accepted)

    def record_pass(self, requests: int, tokens: int) -> None:
        self.pass_requests.observe(requests)
        self.pass_tokens.observe(tokens)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
