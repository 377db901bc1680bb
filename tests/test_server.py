"""The OpenAI-compatible server, driven by the official `openai` client against uvicorn on loopback.

Tiny random models (tests/tiny.py) with a 32768-token context and a one-line chat template. Torch runs on one
thread here: on a shared 2-core machine, tiny matrices on two threads are ~10x slower, not faster.
A "long" request asks for 30000 tokens (minutes of work, the detokenizer being O(n^2)); tests that need the
worker busy start one and then stop it by disconnecting, so nothing here waits for it to finish.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from specdraft import ModelConfig, SamplingParams, SpecConfig, load_engine, load_model
from specdraft.server import ServerConfig, build_server, create_app
from specdraft.server.config import INTERLEAVED_MAX_BATCH
from tiny import build_model

MODEL = "tiny"
CONTEXT = 32768
LONG = 30000  # max_tokens of a request that would keep the worker busy for minutes
QUEUED_TOKENS = 48  # a generation long enough (a few hundred ms) that answers sent in turn arrive in turn
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }} {{ m['content'] }}.{% endfor %}"
                 "{% if add_generation_prompt %}a {% endif %}")
DEFAULT_SPEC = SpecConfig(method="draft", gamma=3)


# ---- fixtures ----


def _server_model(path: Path, seed: int, layers: int) -> Path:
    build_model(path, seed=seed, layers=layers)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (path / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-models")
    return {"target": _server_model(root / "target", seed=1, layers=2),
            "draft": _server_model(root / "draft", seed=2, layers=1)}


@pytest.fixture(scope="module")
def models(model_dirs):
    return {name: load_model(str(path), dtype="float32") for name, path in model_dirs.items()}


def direct(models, prompt_ids: list[int], spec: SpecConfig = DEFAULT_SPEC, **params):
    """The engine called directly, with the server's models and the request's settings."""
    engine = load_engine(ModelConfig(target="unused", draft="unused", threads=1), spec,
                         target=models["target"], draft=models["draft"])
    return engine.generate(prompt_ids, SamplingParams(**params))


def encode(models, text: str) -> list[int]:
    return list(models["target"].tokenizer(text, add_special_tokens=True)["input_ids"])


def encode_chat(models, messages: list[dict]) -> list[int]:
    return list(models["target"].tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                tokenize=True, return_dict=False))


class LiveServer:
    """create_app + uvicorn in a thread, on a loopback socket the test opened."""

    def __init__(self, models, **config):
        config.setdefault("max_batch", 16)  # not auto: a batch that follows this machine's timing would too
        self.config = ServerConfig(model_name=MODEL, max_tokens_limit=LONG, log_level="warning", **config)
        self.target = models["target"]
        app = create_app(self.config, DEFAULT_SPEC, models["target"], models["draft"])
        self.server = build_server(app, self.config)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.http = httpx.Client(base_url=self.url, timeout=60)
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def health(self) -> dict:
        return self.http.get("/health").json()

    def wait_idle(self, timeout: float = 10.0) -> float:
        """Seconds until nothing runs or waits; fails after `timeout`."""
        started = time.monotonic()
        while True:
            health = self.health()
            if health["running"] == 0 and health["queued"] == 0:
                return time.monotonic() - started
            assert time.monotonic() - started < timeout, f"worker still busy: {health}"
            time.sleep(0.02)

    def wait_for(self, running: int, queued: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while (health := self.health())["running"] != running or health["queued"] != queued:
            assert time.monotonic() < deadline, f"expected running={running} queued={queued}, got {health}"
            time.sleep(0.01)

    def metrics(self) -> dict[tuple, float]:
        """Every sample as {(name, sorted label items): value}, read with Prometheus' own text parser."""
        response = self.http.get("/metrics")
        assert response.status_code == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(response.text) for s in family.samples}

    def start_long_stream(self) -> "LongStream":
        return LongStream(self)


class LongStream:
    """A streamed completion that would run for many seconds; `close()` disconnects it."""

    def __init__(self, server: LiveServer):
        self.client = httpx.Client(base_url=server.url, timeout=60)
        body = {"model": MODEL, "prompt": "abc", "max_tokens": LONG, "temperature": 0, "stream": True,
                "speculative": {"method": "ar"}}
        self.context = self.client.stream("POST", "/v1/completions", json=body)
        self.response = self.context.__enter__()
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines()
        self.first = next(line for line in self.lines if line.startswith("data: "))  # generation has begun

    def close(self) -> None:
        self.context.__exit__(None, None, None)
        self.client.close()


@pytest.fixture(scope="module")
def server(models):
    with LiveServer(models, max_queue=4) as live:
        yield live


@pytest.fixture(scope="module")
def serial_server(models):
    """One request at a time (max_batch=1), so the queue's limit and order show."""
    with LiveServer(models, max_queue=4, max_batch=1) as live:
        yield live


@pytest.fixture
def idle_server(server):
    server.wait_idle()
    yield server
    server.wait_idle()


# ---- completions and chat, against the engine called directly ----


def test_seeded_completion_equals_engine(idle_server, models):
    response = idle_server.client.completions.create(
        model=MODEL, prompt="abc", max_tokens=24, temperature=0.9, top_p=0.95, seed=7,
        extra_body={"speculative": {"method": "draft", "gamma": 4}})
    expected = direct(models, encode(models, "abc"), SpecConfig(method="draft", gamma=4), max_new_tokens=24,
                      temperature=0.9, top_p=0.95, seed=7)
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == expected.stats.finish_reason
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.prompt_tokens == 3
    stats = response.model_extra["speculative_stats"]
    assert (stats["method"], stats["gamma"]) == ("draft", 4)
    assert stats["target_passes"] == expected.stats.target_passes
    assert stats["accepted"] == expected.stats.accepted


def test_seeded_chat_equals_engine(idle_server, models):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a bad cab"}]
    response = idle_server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                          temperature=0.8, seed=11)
    expected = direct(models, encode_chat(models, messages), max_new_tokens=20, temperature=0.8, seed=11)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(encode_chat(models, messages))
    assert response.model_extra["speculative_stats"]["method"] == DEFAULT_SPEC.method


def test_a_conversation_s_next_turn_takes_the_cached_prompt_and_gives_the_same_text(model_dirs):
    """bf16 weights (their K/V are the same bits whoever computed them): the second turn resends the first turn
    and its answer; the prefix cache gives their K/V and the answer is the engine's own (which prefills whole)."""
    bf16 = {name: load_model(str(path), dtype="bfloat16") for name, path in model_dirs.items()}
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a bad cab"}]
    with LiveServer(bf16, max_queue=4) as live:
        answers, cached = [], []
        messages = list(first)
        for turn in ("dab a cab", "bad"):
            response = live.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                           temperature=0.8, seed=5)
            expected = direct(bf16, encode_chat(bf16, messages), max_new_tokens=12, temperature=0.8, seed=5)
            assert response.choices[0].message.content == expected.text
            cached.append(response.usage.prompt_tokens_details.cached_tokens)
            answers.append(response.choices[0].message.content)
            messages += [{"role": "assistant", "content": answers[-1]}, {"role": "user", "content": turn}]
        assert cached[0] == 0 and cached[1] >= len(encode_chat(bf16, first)) - 1
        assert live.metrics()[("specdraft_cached_prompt_tokens_total", ())] == cached[1]


def test_streamed_completion_equals_unstreamed(idle_server):
    kwargs = dict(model=MODEL, prompt="jab", max_tokens=30, temperature=0.7, seed=3)
    whole = idle_server.client.completions.create(**kwargs)
    chunks = list(idle_server.client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len([c for c in chunks if c.choices[0].text]) > 1  # it streamed, not one blob


def test_streamed_chat_sends_role_then_content_then_usage(idle_server, models):
    messages = [{"role": "user", "content": "cab"}]
    chunks = list(idle_server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=25, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    expected = direct(models, encode_chat(models, messages), max_new_tokens=25)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].model_extra["speculative_stats"]["target_passes"] == expected.stats.target_passes


def test_stream_ends_with_done(idle_server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 8, "temperature": 0, "stream": True}
    with idle_server.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_n_choices_use_consecutive_seeds_and_count_the_prompt_once(idle_server, models):
    response = idle_server.client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=1.0,
                                                     seed=5, n=2)
    texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    expected = [direct(models, encode(models, "abc"), max_new_tokens=12, temperature=1.0, seed=s) for s in (5, 6)]
    assert texts == [e.text for e in expected]
    assert response.usage.prompt_tokens == 3
    assert response.usage.completion_tokens == sum(len(e.token_ids) for e in expected)


def test_stop_string_ends_the_text_before_it(idle_server, models):
    free = direct(models, encode(models, "abc"), max_new_tokens=30).text
    stop = free[8:10]  # two characters from inside the free-running text
    response = idle_server.client.completions.create(model=MODEL, prompt="abc", max_tokens=30, temperature=0,
                                                     stop=[stop])
    assert response.choices[0].text == free[: free.index(stop)]
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("method", ["ar", "draft", "prompt-lookup"])
def test_every_method_gives_the_greedy_text(idle_server, models, method):
    expected = direct(models, encode(models, "hello"), SpecConfig(method="ar"), max_new_tokens=30).text
    response = idle_server.client.completions.create(model=MODEL, prompt="hello", max_tokens=30, temperature=0,
                                                     extra_body={"speculative": {"method": method} | (
                                                         {"gamma": 2} if method != "ar" else {})})
    assert response.choices[0].text == expected
    stats = response.model_extra["speculative_stats"]
    assert stats["method"] == method
    assert stats["drafted"] > 0 if method != "ar" else stats["drafted"] == 0


def test_lookup_first_per_request_gives_the_greedy_text_and_counts_both_drafters(idle_server, models):
    prompt = "abcabcabc abcabc"
    expected = direct(models, encode(models, prompt), SpecConfig(method="ar"), max_new_tokens=30).text
    response = idle_server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
        extra_body={"speculative": {"method": "draft", "gamma": 2, "lookup_first": 3}})
    assert response.choices[0].text == expected
    assert response.choices[0].model_extra["speculative_stats"]["drafter"]["drafted_by"].get("lookup", 0) > 0


@pytest.mark.parametrize("method, lookup_first, expected_ngram", [
    ("draft", None, 2), ("draft", "auto", 2), ("draft", 0, 0), ("draft", 3, 3),
    ("prompt-lookup", None, 0), ("prompt-lookup", "auto", 0), ("ar", "auto", 0)])
def test_lookup_first_is_auto_unless_a_request_sets_it(idle_server, models, method, lookup_first, expected_ngram):
    prompt = "abcabcabc abcabc"
    expected = direct(models, encode(models, prompt), SpecConfig(method="ar"), max_new_tokens=12).text
    options = {"method": method} | ({} if lookup_first is None else {"lookup_first": lookup_first})
    response = idle_server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                     extra_body={"speculative": options})
    assert response.choices[0].text == expected
    # 0: no lookup first, so nothing in the statistics says so
    assert response.choices[0].model_extra["speculative_stats"]["drafter"].get("lookup_first", 0) == expected_ngram


def test_gamma_auto_per_request_gives_the_greedy_text(idle_server, models):
    prompt = "abcabcabc abcabc"
    expected = direct(models, encode(models, prompt), SpecConfig(method="ar"), max_new_tokens=20).text
    response = idle_server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
        extra_body={"speculative": {"method": "prompt-lookup", "gamma": "auto"}})
    assert response.choices[0].text == expected
    stats = response.choices[0].model_extra["speculative_stats"]
    assert stats["gamma_auto"] is True and stats["drafted"] > 0
    # the length the passes chose, not the cap, alongside "auto"
    assert (stats["gamma"], stats["gamma_max"]) == ("auto", 8)
    assert stats["mean_draft_len"] == pytest.approx(stats["drafted"] / stats["target_passes"])
    totals = response.model_extra["speculative_stats"]
    assert (totals["gamma"], totals["mean_draft_len"]) == ("auto", pytest.approx(stats["mean_draft_len"]))


def test_models_health_and_model_card(idle_server):
    assert [m.id for m in idle_server.client.models.list().data] == [MODEL]
    assert idle_server.client.models.retrieve(MODEL).id == MODEL
    health = idle_server.health()
    assert (health["status"], health["model"], health["max_queue"], health["max_batch"]) == ("ok", MODEL, 4, 16)


def test_max_batch_auto_takes_what_the_measured_passes_say_pays(models, monkeypatch):
    """No --max-batch: the batch the machine's measured passes of several sequences say pays; the transformers
    backend (no curve: its passes are not shared) lets INTERLEAVED_MAX_BATCH take turns."""
    from specdraft.server import app

    asked = []
    zen3 = (1.0, 1.07, 1.29, 2.25, 4.25, 8.4, 16.8)  # pays up to 16 (test_draft_length.py)
    steep = (1.0, 1.9, 3.8, 7.6, 15.2, 30.4, 60.8)  # pays up to 2 only
    for curve, expected in ((zen3, 16), (steep, 2), (None, INTERLEAVED_MAX_BATCH)):
        monkeypatch.setattr(app, "batch_curve", lambda target, curve=curve: asked.append(target) or curve)
        with LiveServer(models, max_batch=None) as live:
            assert live.health()["max_batch"] == expected
    assert asked == [models["target"]] * 3


# ---- bad input ----

BAD_COMPLETIONS = {
    "invalid json": b'{"model": "tiny", "prompt": ',
    "not an object": [1, 2],
    "missing prompt": {"model": MODEL},
    "missing model": {"prompt": "abc"},
    "prompt of wrong type": {"model": MODEL, "prompt": 5},
    "max_tokens as string": {"model": MODEL, "prompt": "abc", "max_tokens": "5"},
    "max_tokens as float": {"model": MODEL, "prompt": "abc", "max_tokens": 5.5},
    "max_tokens zero": {"model": MODEL, "prompt": "abc", "max_tokens": 0},
    "max_tokens negative": {"model": MODEL, "prompt": "abc", "max_tokens": -3},
    "max_tokens over the limit": {"model": MODEL, "prompt": "abc", "max_tokens": LONG + 1},
    "temperature as string": {"model": MODEL, "prompt": "abc", "temperature": "hot"},
    "temperature too high": {"model": MODEL, "prompt": "abc", "temperature": 2.5},
    "temperature negative": {"model": MODEL, "prompt": "abc", "temperature": -0.1},
    "top_p zero": {"model": MODEL, "prompt": "abc", "top_p": 0},
    "top_p above one": {"model": MODEL, "prompt": "abc", "top_p": 1.5},
    "n zero": {"model": MODEL, "prompt": "abc", "n": 0},
    "n too large": {"model": MODEL, "prompt": "abc", "n": 100},
    "seed negative": {"model": MODEL, "prompt": "abc", "seed": -1},
    "seed as bool": {"model": MODEL, "prompt": "abc", "seed": True},
    "stream as string": {"model": MODEL, "prompt": "abc", "stream": "yes"},
    "five stop strings": {"model": MODEL, "prompt": "abc", "stop": ["a", "b", "c", "d", "e"]},
    "empty stop string": {"model": MODEL, "prompt": "abc", "stop": [""]},
    "empty prompt": {"model": MODEL, "prompt": ""},
    "empty prompt list": {"model": MODEL, "prompt": []},
    "token id outside the vocabulary": {"model": MODEL, "prompt": [2, 3, 99999]},
    "prompt longer than the context": {"model": MODEL, "prompt": "a" * (CONTEXT + 10), "max_tokens": 1},
    "prompt plus max_tokens over the context": {"model": MODEL, "prompt": "a" * (CONTEXT - 5), "max_tokens": 10},
    "unsupported logprobs": {"model": MODEL, "prompt": "abc", "logprobs": 2},
    "unsupported echo": {"model": MODEL, "prompt": "abc", "echo": True},
    "speculative gamma zero": {"model": MODEL, "prompt": "abc", "speculative": {"gamma": 0}},
    "speculative gamma too large": {"model": MODEL, "prompt": "abc", "speculative": {"gamma": 99}},
    "speculative unknown method": {"model": MODEL, "prompt": "abc", "speculative": {"method": "magic"}},
    "speculative unknown key": {"model": MODEL, "prompt": "abc", "speculative": {"gama": 4}},
    "speculative lookup_first without a drafter": {"model": MODEL, "prompt": "abc",
                                                   "speculative": {"method": "ar", "lookup_first": 2}},
    "speculative lookup_first too long": {"model": MODEL, "prompt": "abc",
                                          "speculative": {"method": "draft", "lookup_first": 9}},
    "speculative lookup_first a word": {"model": MODEL, "prompt": "abc",
                                        "speculative": {"method": "draft", "lookup_first": "often"}},
    "speculative gamma a word": {"model": MODEL, "prompt": "abc", "speculative": {"gamma": "often"}},
    "speculative not an object": {"model": MODEL, "prompt": "abc", "speculative": "draft"},
    # JSON may escape a lone surrogate, which no tokenizer takes (it was a 500)
    "prompt with a lone surrogate": {"model": MODEL, "prompt": "\ud800 hi"},
    "prompt list with a lone surrogate": {"model": MODEL, "prompt": ["hi", "\udfff"]},
    "stop string with a lone surrogate": {"model": MODEL, "prompt": "abc", "stop": ["\ud800"]},
    "prompt nested too deep": {"model": MODEL, "prompt": [[[2, 3]]]},
    "prompt mixing text and ids": {"model": MODEL, "prompt": ["abc", 3]},
    "speculative gamma with method ar": {"model": MODEL, "prompt": "abc", "speculative": {"method": "ar", "gamma": 4}},
    "speculative lookup_max_ngram unbounded": {"model": MODEL, "prompt": "abc",
                                               "speculative": {"method": "prompt-lookup", "lookup_max_ngram": 10**6}},
}

BAD_CHATS = {
    "empty messages": {"model": MODEL, "messages": []},
    "messages not a list": {"model": MODEL, "messages": "hi"},
    "message without role": {"model": MODEL, "messages": [{"content": "hi"}]},
    "unknown role": {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
    "content of wrong type": {"model": MODEL, "messages": [{"role": "user", "content": 7}]},
    "max_completion_tokens zero": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                   "max_completion_tokens": 0},
    "unsupported tools": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]},
}


def _assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize("case", sorted(BAD_COMPLETIONS))
def test_bad_completion_request_is_a_400(server, case):
    body = BAD_COMPLETIONS[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = server.http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    error = _assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("case", sorted(BAD_CHATS))
def test_bad_chat_request_is_a_400(server, case):
    response = server.http.post("/v1/chat/completions", json=BAD_CHATS[case])
    _assert_openai_error(response, 400)


def test_infinite_top_p_names_its_parameter(server):
    content = ('{"model": "%s", "prompt": "abc", "top_p": Infinity}' % MODEL).encode()  # Python's JSON reads it
    response = server.http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert _assert_openai_error(response, 400)["param"] == "top_p"


def test_chat_message_with_a_lone_surrogate_is_a_400(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "\ud800 hi"}]}
    response = server.http.post("/v1/chat/completions", content=json.dumps(body).encode(),
                                headers={"content-type": "application/json"})
    _assert_openai_error(response, 400)


# ---- the choices vLLM's OpenAI server makes, where OpenAI's reference leaves room ----


def test_prompt_shapes_as_vllm_takes_them(idle_server, models):
    """A list of token-id lists is several prompts; a prompt of blanks is text (only one without any token is
    refused, as the bad-input table shows); a wrongly nested prompt names every accepted shape."""
    ids = [encode(models, "abc"), encode(models, "bead")]
    response = idle_server.client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert [c.text for c in response.choices] == [direct(models, p, max_new_tokens=5).text for p in ids]
    blank = idle_server.client.completions.create(model=MODEL, prompt="   ", max_tokens=3, temperature=0)
    assert blank.usage.prompt_tokens == len(encode(models, "   ")) > 0
    error = _assert_openai_error(idle_server.http.post("/v1/completions", json={"model": MODEL,
                                                                               "prompt": [[[2]]]}), 400)
    assert "list of lists of token ids" in error["message"] and error["param"] == "prompt"


@pytest.mark.parametrize("content", [None, "", [], [{"type": "text", "text": ""}]])
def test_chat_message_without_content_is_answered(idle_server, content):
    """As vLLM: a message with null or empty content is part of the conversation (the template renders it)."""
    response = idle_server.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "system", "content": content}, {"role": "user", "content": "hi"}],
        "max_tokens": 3})
    assert response.status_code == 200, response.text


def test_n_null_means_one_choice(idle_server):
    response = idle_server.http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "n": None,
                                                              "max_tokens": 2})
    assert response.status_code == 200 and len(response.json()["choices"]) == 1


def test_chunked_body_over_the_limit_is_a_413(server):
    """A body sent in chunks (no Content-Length) over the limit is refused (uvicorn drains what the app leaves)."""
    limit = server.config.max_body_bytes

    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(2 * limit // 65536):
            yield b"a" * 65536
        yield b'"}'

    response = server.http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    _assert_openai_error(response, 413)


def test_a_chunked_body_is_read_only_up_to_the_limit():
    """The app stops reading (and holding) a body once it passes the limit, instead of reading it whole first."""
    import asyncio

    from specdraft.server.app import read_body
    from specdraft.server.protocol import ApiError

    pulled = []

    class Chunked:  # a request whose body comes in 64 KiB chunks, 64 MiB in all
        headers: dict = {}

        async def stream(self):
            for _ in range(1024):
                pulled.append(65536)
                yield b"a" * 65536

    with pytest.raises(ApiError) as caught:
        asyncio.run(read_body(Chunked(), 1_000_000))
    assert caught.value.status == 413
    assert sum(pulled) <= 1_000_000 + 65536


def test_queue_places_go_in_arrival_order():
    """A place is taken on arrival, before tokenizing: when the queue is full the refusals fall on the latest
    arrivals, and requests that finish tokenizing out of order still queue in arrival order."""
    import asyncio

    from specdraft.server.metrics import ServerMetrics
    from specdraft.server.scheduler import Job, QueueFull, Scheduler

    scheduler = Scheduler(max_queue=2, metrics=ServerMetrics(), max_batch=1)  # never started: nothing runs
    tickets = [scheduler.reserve() for _ in range(3)]  # one for the free batch place, two waiting places
    with pytest.raises(QueueFull):
        scheduler.reserve()
    loop = asyncio.new_event_loop()
    jobs = [Job([], loop, []) for _ in tickets]
    for job, ticket in reversed(list(zip(jobs, tickets))):
        scheduler.submit(job, ticket)
    assert list(scheduler._waiting) == jobs
    scheduler.cancel(-1)  # cancelling an unknown ticket is harmless
    loop.close()


def test_unknown_model_is_a_404(server):
    with pytest.raises(openai.NotFoundError) as caught:
        server.client.completions.create(model="gpt-9", prompt="abc", max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"
    _assert_openai_error(server.http.post("/v1/chat/completions", json={
        "model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}), 404)
    _assert_openai_error(server.http.get("/v1/models/gpt-9"), 404)


def test_oversized_body_is_a_413(server):
    body = {"model": MODEL, "prompt": "a" * (server.config.max_body_bytes + 1)}
    _assert_openai_error(server.http.post("/v1/completions", json=body), 413)


def test_unknown_route_is_an_openai_shaped_404(server):
    _assert_openai_error(server.http.post("/v1/embeddings", json={"model": MODEL, "input": "abc"}), 404)


def test_openai_client_raises_bad_request_for_max_tokens_zero(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client.completions.create(model=MODEL, prompt="abc", max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"


def test_worker_still_serves_after_the_bad_input_suite(idle_server, models):
    for body in list(BAD_COMPLETIONS.values())[:10]:  # a burst of bad requests, then a good one
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        idle_server.http.post("/v1/completions", content=content)
    response = idle_server.client.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0)
    assert response.choices[0].text == direct(models, encode(models, "abc"), max_new_tokens=6).text


# ---- load: queue, 429, order, disconnect, a free event loop ----


def test_health_and_metrics_answer_while_a_generation_runs(idle_server):
    long = idle_server.start_long_stream()
    try:
        for path in ("/health", "/metrics", "/v1/models"):
            started = time.monotonic()
            response = idle_server.http.get(path)
            assert response.status_code == 200
            assert time.monotonic() - started < 1.0, f"{path} waited for the generation"
        assert idle_server.health()["running"] == 1
    finally:
        long.close()


def test_streaming_disconnect_stops_the_generation_and_frees_the_slot(idle_server):
    before = idle_server.metrics()
    long = idle_server.start_long_stream()
    idle_server.wait_for(running=1, queued=0)
    long.close()
    assert idle_server.wait_idle(timeout=5) < 5
    after = idle_server.metrics()
    closed = ("specdraft_requests_total", (("endpoint", "/v1/completions"), ("status", "499")))
    assert after[closed] - before.get(closed, 0) == 1
    generated = after[("specdraft_generated_tokens_total", ())] - before[("specdraft_generated_tokens_total", ())]
    assert 0 < generated < LONG / 2  # stopped early, not run to max_tokens
    response = idle_server.client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0)
    assert response.usage.completion_tokens == 4  # the slot is free: the next request runs


def test_unstreamed_disconnect_frees_the_slot(idle_server):
    before = idle_server.metrics()
    body = {"model": MODEL, "prompt": "abc", "max_tokens": LONG, "temperature": 0, "speculative": {"method": "ar"}}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(idle_server.url + "/v1/completions", json=body, timeout=1.0)
    assert idle_server.wait_idle(timeout=5) < 5
    after = idle_server.metrics()
    generated = after[("specdraft_generated_tokens_total", ())] - before[("specdraft_generated_tokens_total", ())]
    assert generated < LONG / 2


def test_full_queue_answers_429_with_retry_after_and_loses_nothing(serial_server, models):
    idle_server = serial_server
    idle_server.wait_idle()
    prompts = ["a", "b", "c", "d", "e", "f", "g"]  # 4 fit in the queue (max_queue=4), 3 are refused
    expected = {p: direct(models, encode(models, p), max_new_tokens=5).text for p in prompts}
    long = idle_server.start_long_stream()
    idle_server.wait_for(running=1, queued=0)

    def ask(prompt):
        try:
            return idle_server.client.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
        except openai.RateLimitError as exc:
            return exc

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = {p: pool.submit(ask, p) for p in prompts}
        idle_server.wait_for(running=1, queued=4)
        deadline = time.monotonic() + 10
        while sum(f.done() for f in futures.values()) < 3:  # the refused ones answer while the worker is busy
            assert time.monotonic() < deadline
            time.sleep(0.01)
        long.close()
        outcomes = {p: f.result() for p, f in futures.items()}
    refused = [o for o in outcomes.values() if isinstance(o, openai.RateLimitError)]
    assert len(refused) == 3
    assert all(int(o.response.headers["retry-after"]) >= 1 for o in refused)
    served = {p: o.parse() for p, o in outcomes.items() if not isinstance(o, openai.RateLimitError)}
    assert len(served) == 4
    assert all(r.choices[0].text == expected[p] for p, r in served.items())


def test_queued_requests_are_served_in_arrival_order(serial_server):
    """With max_batch 1 the worker serves one request at a time, so answer i + 1 is sent a whole generation after
    answer i. Each
    asks for QUEUED_TOKENS tokens so that gap dwarfs thread scheduling: with 3-token answers a client thread that
    read its answer late was once recorded after the next one (in CI), the server's order being right."""
    idle_server = serial_server
    idle_server.wait_idle()
    finished: list[int] = []
    long = idle_server.start_long_stream()
    idle_server.wait_for(running=1, queued=0)

    def ask(i: int) -> None:
        answer = idle_server.client.completions.create(model=MODEL, prompt="abc", max_tokens=QUEUED_TOKENS,
                                                        temperature=0)
        assert answer.usage.completion_tokens == QUEUED_TOKENS  # no early stop that would shrink the gap
        finished.append(i)

    with ThreadPoolExecutor(3) as pool:
        futures = []
        for i in range(3):
            futures.append(pool.submit(ask, i))
            idle_server.wait_for(running=1, queued=i + 1)  # the next one arrives only once this one waits
        long.close()
        for f in futures:
            f.result()
    assert finished == [0, 1, 2]


def test_many_concurrent_clients_all_get_their_own_complete_answer(models):
    prompts = [f"{a}{b}" for a in "abcd" for b in "efg"]  # 12 clients
    expected = {p: direct(models, encode(models, p), max_new_tokens=16, temperature=0.8, seed=i).text
                for i, p in enumerate(prompts)}
    with LiveServer(models, max_queue=len(prompts)) as live:
        def ask(i, prompt):
            if i % 2:
                chunks = live.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                        temperature=0.8, seed=i, stream=True)
                return "".join(c.choices[0].text for c in chunks)
            return live.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.8,
                                                  seed=i).choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = dict(zip(prompts, pool.map(ask, range(len(prompts)), prompts)))
    assert answers == expected


# ---- several requests in each target pass ----

# (prompt, speculative settings, max_tokens): prompts of 1 to ~70 tokens, so that with prefill chunks of 8 tokens
# some requests prefill across several passes while others decode
LOAD = [("abc" * 20, {"method": "ar"}, 24), ("hello", {"method": "draft", "gamma": 3}, 30),
        ("deed" * 15 + "e", {"method": "prompt-lookup", "gamma": 4}, 40), ("cab", {"method": "draft", "gamma": 2}, 9),
        ("bead", {"method": "ar"}, 17), ("ace" * 6, {"method": "prompt-lookup", "gamma": 2}, 33),
        ("dab" * 23, {"method": "draft", "gamma": 4}, 12), ("e", {"method": "ar"}, 26),
        ("bad" * 9, {"method": "draft", "gamma": "auto"}, 28), ("face", {"method": "prompt-lookup", "gamma": "auto"}, 21)]


def ask_load(live: LiveServer, i: int) -> str:
    prompt, speculative, max_tokens = LOAD[i]
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                  extra_body={"speculative": speculative})
    if i % 2:
        return "".join(c.choices[0].text for c in live.client.completions.create(stream=True, **kwargs))
    return live.client.completions.create(**kwargs).choices[0].text


def alone_and_together(live: LiveServer) -> tuple[list[str], list[str], dict]:
    """Each LOAD request served alone, then all at once; and the metrics of the second part."""
    alone = [ask_load(live, i) for i in range(len(LOAD))]
    before = live.metrics()
    with ThreadPoolExecutor(len(LOAD)) as pool:
        together = list(pool.map(lambda i: ask_load(live, i), range(len(LOAD))))
    after = live.metrics()
    return alone, together, {key: after[key] - before.get(key, 0) for key in after}


def test_greedy_answers_under_load_equal_each_request_served_alone(models):
    """Ten clients at once on a server that batches up to 4 (gamma auto among them: lengths chosen with the pass's
    load, drafters begun late): every greedy answer is the one the request gets alone, and the passes really held
    several requests (the pass histogram)."""
    with LiveServer(models, max_queue=16, max_batch=4, prefill_chunk=8) as live:
        alone, together, delta = alone_and_together(live)
        health = live.health()
    assert together == alone
    assert all(alone)
    passes = delta[("specdraft_pass_requests_count", ())]
    single = delta[("specdraft_pass_requests_bucket", (("le", "1.0"),))]
    assert passes > single, "no pass held more than one request"
    assert delta[("specdraft_pass_requests_bucket", (("le", "4.0"),))] == passes  # never more than max_batch
    assert delta[("specdraft_prefill_tokens_total", (("pass_kind", "shared"),))] > 0, "no prefill chunk rode along"
    assert delta[("specdraft_queue_wait_seconds_count", ())] == len(LOAD)
    assert health["max_batch"] == 4


def test_negative_control_mixed_up_rows_change_answers_under_load(models, monkeypatch):
    """The same check must fail when a pass hands requests each other's logits."""
    from specdraft.server import scheduler

    verify_together = scheduler.verify_together

    def mixed_up(loops, drafts, errors=None, prefill=None):
        logits = verify_together(loops, drafts, errors, prefill)
        if len(loops) < 2:
            return logits
        # request i gets request i + 1's rows, cut or repeated to its own length
        shifted = logits[1:] + logits[:1]
        return [other[torch.arange(mine.shape[0]) % other.shape[0]] for mine, other in zip(logits, shifted)]

    monkeypatch.setattr(scheduler, "verify_together", mixed_up)
    with LiveServer(models, max_queue=16, max_batch=4, prefill_chunk=8) as live:
        alone, together, _ = alone_and_together(live)
    assert together != alone


def test_negative_control_a_riding_prefill_chunk_out_of_order_changes_answers(models, monkeypatch):
    """The same check must fail when the prefill chunks that ride in the running requests' pass go in reversed."""
    from specdraft.server import scheduler

    verify_together = scheduler.verify_together

    def reversed_chunk(loops, drafts, errors=None, prefill=None):
        return verify_together(loops, drafts, errors, None if prefill is None else (prefill[0], prefill[1][::-1]))

    monkeypatch.setattr(scheduler, "verify_together", reversed_chunk)
    with LiveServer(models, max_queue=16, max_batch=4, prefill_chunk=8) as live:
        alone, together, delta = alone_and_together(live)
    assert delta[("specdraft_prefill_tokens_total", (("pass_kind", "shared"),))] > 0
    assert together != alone


def stream_beside_a_failing_request(models, failing_prompt: str):
    """A greedy stream of "abc" (ar) running when a request for `failing_prompt` arrives: (the stream's text, the
    text "abc" gets alone, the other request's response, the server's metrics at the end)."""
    expected = direct(models, encode(models, "abc"), SpecConfig(method="ar"), max_new_tokens=600).text
    with LiveServer(models, max_batch=4) as live:
        stream = live.client.completions.create(model=MODEL, prompt="abc", max_tokens=600, temperature=0,
                                                stream=True, extra_body={"speculative": {"method": "ar"}})
        chunks = iter(stream)
        text = next(chunks).choices[0].text  # decoding when the other arrives
        failed = live.http.post("/v1/completions", json={"model": MODEL, "prompt": failing_prompt, "max_tokens": 50,
                                                          "temperature": 0, "speculative": {"method": "ar"}})
        text += "".join(chunk.choices[0].text for chunk in chunks)
        metrics = live.metrics()
    return text, expected, failed, metrics


def test_one_request_failing_leaves_the_others_in_its_passes_running(models, monkeypatch):
    """A failure in one request's own work (here its acceptance step raises) ends that request with a 500; the
    request sharing its passes gets its whole, exact answer."""
    from specdraft.engine import Generation

    poison, original = encode(models, "ded"), Generation.accept

    def accept(self, rows):
        if self.prompt_ids == poison and len(self.checker.token_ids) >= 2:
            raise RuntimeError("boom")
        return original(self, rows)

    monkeypatch.setattr(Generation, "accept", accept)
    text, expected, failed, metrics = stream_beside_a_failing_request(models, "ded")
    error = _assert_openai_error(failed, 500)
    assert "boom" in error["message"]
    assert text == expected
    shared = (metrics[("specdraft_pass_requests_count", ())]
              - metrics[("specdraft_pass_requests_bucket", (("le", "1.0"),))])
    assert shared > 0, "the two requests never shared a pass: the test showed nothing"


def test_a_riding_prefill_that_fails_at_its_end_leaves_the_pass_it_rode_in_running(models, monkeypatch):
    """The end of a prefill that rode in another request's pass (prefix cache, drafter) raising ends that request
    alone with a 500; the request whose pass it rode in gets its whole, exact answer."""
    from specdraft.engine import DecodeLoop

    poison, original = encode(models, "ded" * 5), DecodeLoop.prefill_ran

    def prefill_ran(self, n, seconds):
        if self.context[: len(poison)] == poison:
            raise RuntimeError("boom at the prompt's end")
        return original(self, n, seconds)

    monkeypatch.setattr(DecodeLoop, "prefill_ran", prefill_ran)
    text, expected, failed, metrics = stream_beside_a_failing_request(models, "ded" * 5)
    error = _assert_openai_error(failed, 500)
    assert "boom at the prompt's end" in error["message"]
    assert text == expected
    assert metrics[("specdraft_prefill_tokens_total", (("pass_kind", "shared"),))] > 0, "the prefill never rode"


def test_drafters_are_built_on_the_worker_before_the_request_queues(models, monkeypatch):
    """A request in flight beside others needs a drafter of its own; it is built (a draft model's vocabulary, an
    EAGLE head from disk) while the request is prepared, before it queues, on the worker thread between two passes:
    the one thread that runs torch's parallel work (see Scheduler), and a pool keeps it for later requests."""
    from specdraft.server import app as server_app
    from specdraft.server.scheduler import Scheduler

    built_in, build, run_calls = [], server_app.build_drafter, Scheduler._run_calls
    asked = threading.local()  # whether the worker is running what other threads asked of it, not a pass

    def recording_build(*args, **kwargs):
        built_in.append((threading.current_thread().name, getattr(asked, "now", False)))
        return build(*args, **kwargs)

    def recording_run_calls(self):
        asked.now = True
        try:
            run_calls(self)
        finally:
            asked.now = False

    monkeypatch.setattr(server_app, "build_drafter", recording_build)
    monkeypatch.setattr(Scheduler, "_run_calls", recording_run_calls)
    with LiveServer(models, max_batch=4) as live:
        response = live.client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0.8, seed=3,
                                                  n=3, extra_body={"speculative": {"method": "draft", "gamma": 2}})
        again = live.client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0.8, seed=3,
                                               n=3, extra_body={"speculative": {"method": "draft", "gamma": 2}})
    assert [c.text for c in response.choices] == [
        direct(models, encode(models, "abc"), SpecConfig(method="draft", gamma=2), max_new_tokens=20,
               temperature=0.8, seed=3 + i).text for i in range(3)]
    assert [c.text for c in again.choices] == [c.text for c in response.choices]
    # the server's default engine at start (built where the test built the app); then this setting's engine and two
    # more drafters for three choices in flight, on the worker; the second request found them in the pool
    # (asked by the request's preparation, not built when a pass admitted it)
    assert len(built_in) == 1 + 3 and built_in[1:] == [("specdraft-worker", True)] * 3


def test_a_long_prompt_is_prefilled_in_chunks_while_others_stream(models):
    """The scheduler driven step by step: a 300-token prompt prefills 16 tokens per step, and a request already
    decoding gets a pass (and tokens) at every one of those steps; the long prompt's answer equals its answer
    served alone."""
    import asyncio

    from specdraft.engine import Engine
    from specdraft.server.metrics import ServerMetrics
    from specdraft.server.scheduler import Job, Scheduler

    engine = Engine(models["target"])
    long_prompt, loop = encode(models, "abcde" * 60), asyncio.new_event_loop()
    params = SamplingParams(max_new_tokens=8, temperature=0)
    expected = engine.generate(long_prompt, params).token_ids
    scheduler = Scheduler(max_queue=4, metrics=ServerMetrics(), max_batch=4, prefill_chunk=16)  # not started
    streaming = Job([engine.stream(encode(models, "abc"), SamplingParams(max_new_tokens=500, temperature=0))],
                    loop, [True])
    scheduler.submit(streaming, scheduler.reserve())
    scheduler._admit()
    with torch.inference_mode():
        scheduler._step()  # prefilled (3 tokens) and its first pass
        long = Job([engine.stream(long_prompt, params)], loop, [True])
        scheduler.submit(long, scheduler.reserve())
        scheduler._admit()
        steps, gained = 0, []
        while long.generations[0].loop is None or long.generations[0].loop.prefilling:
            before = len(streaming.generations[0].checker.token_ids)
            scheduler._step()
            steps += 1
            gained.append(len(streaming.generations[0].checker.token_ids) - before)
        while long.running:
            scheduler._step()
    scheduler.abort_all()
    with torch.inference_mode():
        scheduler._step()  # the streaming request leaves
    loop.close()
    assert steps == -(-(len(long_prompt) - 1) // 16)  # one chunk per step
    assert all(n >= 1 for n in gained)  # the other request decoded at every step of that prefill
    assert long.generations[0].result().token_ids == expected


# ---- metrics ----


def test_metrics_parse_and_count_what_was_sent(models):
    with LiveServer(models, max_queue=4) as live:
        responses = [live.client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0.5, seed=1)
                     for p in ("abc", "hij")]
        responses.append(live.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "cab"}], max_tokens=8, temperature=0, n=2))
        streamed = list(live.client.completions.create(model=MODEL, prompt="dead", max_tokens=7, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
        for _ in range(3):
            live.http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 0})
        live.http.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
        metrics = live.metrics()

    def requests(endpoint, status):
        return metrics.get(("specdraft_requests_total", (("endpoint", endpoint), ("status", status))), 0)

    assert requests("/v1/completions", "200") == 3
    assert requests("/v1/chat/completions", "200") == 1
    assert requests("/v1/completions", "400") == 3
    assert requests("/v1/chat/completions", "404") == 1
    usages = [r.usage for r in responses] + [streamed[-1].usage]
    assert metrics[("specdraft_prompt_tokens_total", ())] == sum(u.prompt_tokens for u in usages)
    assert metrics[("specdraft_generated_tokens_total", ())] == sum(u.completion_tokens for u in usages)
    stats = [c.model_extra["speculative_stats"] for r in responses for c in r.choices]
    stats += [c.choices[0].model_extra["speculative_stats"] for c in streamed if c.choices and
              c.choices[0].finish_reason]
    assert len(stats) == 5
    for metric, key in (("target_passes", "target_passes"), ("drafted_tokens", "drafted"),
                        ("accepted_tokens", "accepted")):
        assert metrics[(f"specdraft_{metric}_total", ())] == sum(s[key] for s in stats), metric
    histogram_count = metrics[("specdraft_accepted_tokens_per_pass_count", ())]
    assert histogram_count == sum(s["target_passes"] for s in stats)
    assert metrics[("specdraft_accepted_tokens_per_pass_sum", ())] == sum(s["accepted"] for s in stats)
    assert metrics[("specdraft_time_to_first_token_seconds_count", ())] == 4
    assert metrics[("specdraft_request_latency_seconds_count", ())] == 4
    assert metrics[("specdraft_queue_depth", ())] == 0


# ---- shutdown ----


def test_sigterm_finishes_running_work_and_errors_the_rest(model_dirs):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    command = [sys.executable, "-m", "specdraft.cli", "serve", "--target", str(model_dirs["target"]),
               "--draft", str(model_dirs["draft"]), "--dtype", "float32", "--threads", "1", "--port", str(port),
               "--model-name", MODEL, "--max-tokens-limit", str(LONG), "--shutdown-timeout", "600", "--max-batch", "2",
               "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        health = httpx.Client(base_url=url, timeout=5)
        outcomes: dict[str, object] = {}

        def ask(name: str, max_tokens: int) -> None:
            try:
                chunks = client.completions.create(model=MODEL, prompt="abc", max_tokens=max_tokens, temperature=0,
                                                   stream=True, extra_body={"speculative": {"method": "ar"}})
                outcomes[name] = [c.choices[0].finish_reason for c in chunks][-1]
            except openai.APIError as exc:
                outcomes[name] = exc

        # running when SIGTERM comes, and finishing within the grace period; beside it (--max-batch 2) and
        # finishing too; queued last and still running when the second SIGTERM ends the grace period. Nothing here depends
        # on how fast the machine is: the grace period (600 s) is the failsafe, the second signal the event.
        threads = [threading.Thread(target=ask, args=args) for args in (("running", 300), ("queued", 10),
                                                                          ("too long", LONG))]
        deadline = time.monotonic() + 30  # its own: a slow start must not eat the wait for the queue
        for admitted, thread in enumerate(threads, 1):
            thread.start()
            # in this order: each request admitted (running or queued, or on a fast machine the first one already
            # done) before the next is sent, so the long one is queued last. The finished count is read before the
            # server's: a request leaves `running` before its stream ends, so one that ends in between is counted
            # nowhere (the loop asks again), never twice (read the other way round, a request ending between the two
            # reads counted twice, and the signal went out before the last request arrived)
            while len(outcomes) + (state := health.get("/health").json())["running"] + state["queued"] < admitted:
                assert state["running"] <= 2 and time.monotonic() < deadline, state
                time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        for thread in threads[:2]:
            thread.join(120)
        assert "too long" not in outcomes, "the long request should still be running"  # 30000 tokens: minutes
        process.send_signal(signal.SIGTERM)  # ends the grace period: the long request gets the error
        threads[2].join(60)
        assert process.wait(60) == 0
        output = process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "Traceback" not in output
    assert (outcomes["running"], outcomes["queued"]) == ("length", "length")
    assert isinstance(outcomes["too long"], openai.APIError), "the long stream should end with an error event"
    assert "shutting down" in outcomes["too long"].message


def test_run_on_worker_runs_on_the_worker_thread_and_hands_back_results_and_errors():
    """The server's torch work (loading, engines, drafters) runs on the scheduler's worker, the thread that runs
    the passes: a call from another thread gets the result or the exception; before the worker starts and on the
    worker itself it runs at once; after close it is refused."""
    from specdraft.server.metrics import ServerMetrics
    from specdraft.server.scheduler import Scheduler, ShuttingDown

    scheduler = Scheduler(max_queue=4, metrics=ServerMetrics())
    assert scheduler.run_on_worker(lambda: threading.current_thread().name) == threading.current_thread().name
    scheduler.start()
    scheduler.start()  # a second start does nothing
    try:
        assert scheduler.run_on_worker(lambda: threading.current_thread().name) == "specdraft-worker"
        nested = scheduler.run_on_worker(lambda: scheduler.run_on_worker(lambda: threading.current_thread().name))
        assert nested == "specdraft-worker"
        with pytest.raises(ZeroDivisionError):
            scheduler.run_on_worker(lambda: 1 / 0)
        assert scheduler.run_on_worker(lambda: 2) == 2  # the worker lives on after a call that failed
    finally:
        scheduler.close()
    with pytest.raises(ShuttingDown):
        scheduler.run_on_worker(lambda: 3)
