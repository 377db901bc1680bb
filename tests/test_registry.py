"""One drafter registry: a drafter registered once, with one options dataclass, shows up in `generate --help`,
the benchmark's method settings and the server's request schema, and runs in the engine."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from specdraft import Engine, SamplingParams, SpecConfig, SpecdraftError
from specdraft.drafters import Drafter, build_drafter
from specdraft.drafters.base import DraftTally
from specdraft.registry import (DRAFTERS, DrafterInfo, option_classes, option_fields, register, setting,
                                unregister)
from specdraft.types import Draft


@dataclasses.dataclass(frozen=True)
class EchoOptions:
    echo_span: int = setting(2, "method echo: how many of the context's last tokens to propose again", server=True)


class EchoDrafter(Drafter):
    """Proposes the context's last `span` tokens again (often wrong: the point is the plumbing)."""

    name = "echo"

    def __init__(self, span: int):
        self.span = span

    def begin(self, prompt_ids, features=None):
        pass

    def propose(self, context_ids, k, params, generator):
        return Draft(torch.tensor(context_ids[-self.span:][:k], dtype=torch.long))

    def on_accept(self, context_ids, features=None):
        pass

    def statistics(self):
        return {"echo_span": self.span}

    def new_tally(self):
        return EchoTally()


class EchoTally(DraftTally):
    """A drafter's own counters: passes where the whole echo was kept."""

    def __init__(self):
        self.whole = 0

    def record(self, draft, result):
        self.whole += int(draft.k > 0 and result.n_accepted == draft.k)

    def to_dict(self):
        return {"echo_whole": self.whole}


def build_echo(spec, target, draft):
    return EchoDrafter(spec.drafter_options(EchoOptions).echo_span)


@pytest.fixture
def echo_registered():
    register(DrafterInfo("echo", build_echo, (EchoOptions,)))
    yield
    unregister("echo")


def test_a_drafter_registered_once_shows_up_in_the_cli_the_bench_and_the_server(echo_registered):
    from specdraft.bench.methods import get_method
    from specdraft.bench.options import BenchSettings, parse_method
    from specdraft.bench.runner import variant_spec
    from specdraft.cli import build_parser
    from specdraft.knobs import drafter_knobs
    from specdraft.server.config import ServerConfig
    from specdraft.server.protocol import CompletionRequest, parse_request, spec_config, speculative_options

    # the command line: the flag with its help and default, the method among the choices, the value in options
    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    text = " ".join(generate.format_help().split())
    assert "--echo-span ECHO_SPAN method echo: how many of the context's last tokens" in text
    assert "(default: 2)" in text and "echo" in text.split("--method METHOD one of")[1].split("--")[0]
    args = parser.parse_args(["generate", "--method", "echo", "--echo-span", "5"])
    spec = SpecConfig(method=args.method, gamma=args.gamma, **drafter_knobs(args))
    assert spec.drafter_options(EchoOptions).echo_span == 5

    # the benchmark: a method of its own, its setting per column
    name, overrides = parse_method("echo[echo_span=4,gamma=2]")
    assert (name, overrides) == ("echo", {"gamma": 2, "options": {"echo_span": 4}})
    spec = variant_spec(BenchSettings(), get_method("echo"), 2, overrides)
    assert (spec.method, spec.gamma, spec.drafter_options(EchoOptions).echo_span) == ("echo", 2, 4)
    with pytest.raises(SpecdraftError, match="echo_span takes an integer, got 'many'"):
        parse_method("echo[echo_span=many]")

    # the server: in the request schema, and a request's value reaches its SpecConfig
    assert "echo_span" in speculative_options().model_json_schema()["properties"]
    body = {"model": "m", "prompt": "x", "speculative": {"method": "echo", "echo_span": 3}}
    request = parse_request(json.dumps(body).encode(), CompletionRequest, ServerConfig())
    spec = spec_config(request, SpecConfig(method="ar"))
    assert (spec.method, spec.drafter_options(EchoOptions).echo_span) == ("echo", 3)
    body["speculative"]["echo_span"] = "three"
    with pytest.raises(Exception, match="speculative.echo_span"):
        parse_request(json.dumps(body).encode(), CompletionRequest, ServerConfig())


def test_a_registered_drafter_runs_in_the_engine_and_stays_exact(echo_registered, tiny_models):
    target = tiny_models["target"]
    spec = SpecConfig(method="echo", gamma=3, options={"echo_span": 3})
    engine = Engine(target, build_drafter(spec, target, None), spec)
    ids = engine.encode("abc abc abc ab", chat=False)
    params = SamplingParams(max_new_tokens=16)
    got = engine.generate(ids, params)
    assert got.token_ids == Engine(target).generate(ids, params).token_ids
    assert got.stats.drafted > 0
    # its setup and its own counters reach the statistics without a word about them in the engine or SpecStats,
    # beside those of the lookup-first wrapper it runs in by default (its copies' and its own tokens per label)
    assert {"echo_span", "echo_whole", "lookup_first", "drafted_by"} <= set(got.stats.drafter)
    assert got.stats.drafter["echo_span"] == 3 and set(got.stats.drafter["drafted_by"]) <= {"lookup", "echo"}
    assert 0 <= got.stats.drafter["echo_whole"] <= got.stats.target_passes
    assert got.stats.to_dict()["drafter"] == got.stats.drafter


def test_unknown_settings_are_refused_and_gone_with_the_drafter(echo_registered):
    with pytest.raises(SpecdraftError, match="no registered drafter's setting"):
        SpecConfig(method="echo", options={"echo_spam": 3})
    with pytest.raises(SpecdraftError, match="no registered drafter's setting"):
        SpecConfig(method="echo", echo_spam=3)
    unregister("echo")
    assert "echo" not in DRAFTERS and "echo_span" not in option_fields()
    with pytest.raises(SpecdraftError, match="unknown method 'echo'"):
        SpecConfig(method="echo")


def test_every_setting_travels_in_options_whichever_way_it_was_given(echo_registered):
    """Keywords or the options dict, built in or registered from outside: one place, every registered setting
    present (its default where none was given), so configs that mean the same are equal and hash alike."""
    by_keyword = SpecConfig("echo", 2, echo_span=3, draft_confidence=0.25)
    by_dict = SpecConfig("echo", 2, options={"echo_span": 3, "draft_confidence": 0.25})
    assert by_keyword == by_dict and hash(by_keyword) == hash(by_dict)
    assert {name for name, _ in by_keyword.options} == set(option_fields())
    assert by_keyword.setting("echo_span") == 3 and by_keyword.setting("tree_budget") == 5
    assert SpecConfig() == SpecConfig(tree_budget=5, draft_context=16)  # the defaults, spelled out
    assert dataclasses.replace(by_keyword, gamma=4).options == by_keyword.options
    assert [f.name for f in dataclasses.fields(SpecConfig)] == ["method", "gamma", "lookup_first", "tree", "options"]


def test_tree_is_an_option_and_the_tree_spellings_stay():
    """A tree is SpecConfig.tree on a drafter that registers a tree builder; "draft-tree" is that spelled as a
    method. Front ends show the spelling (stats, server), drafters of chains only refuse it."""
    from specdraft.registry import method_names, resolve_method

    assert SpecConfig("draft-tree") == SpecConfig("draft", tree=True)
    spec = SpecConfig("eagle-tree", tree_depth=5, eagle_head="h")
    assert (spec.method, spec.tree, spec.name, spec.draft_len, spec.adaptive_gamma) == ("eagle", True, "eagle-tree",
                                                                                       5, False)
    assert dataclasses.replace(spec, gamma=3).tree  # replace keeps it
    assert {"draft-tree", "prompt-lookup-tree", "eagle-tree", "sorted-tree"} <= set(method_names())
    assert resolve_method("ar-tree") is None and resolve_method("draft") == ("draft", False)
    with pytest.raises(SpecdraftError, match="drafts chains only"):
        SpecConfig("ar", tree=True)
    with pytest.raises(SpecdraftError, match="unknown method 'ar-tree'"):
        SpecConfig("ar-tree")
    with pytest.raises(SpecdraftError, match="tree must be true or false"):
        SpecConfig("draft", tree="yes")
    with pytest.raises(SpecdraftError, match="drafts trees, and tree is false"):
        SpecConfig("draft-tree", tree=False)
    with pytest.raises(SpecdraftError, match="spells 'draft' drafting trees"):
        register(DrafterInfo("draft-tree", build_echo))


def test_the_tree_option_reaches_the_cli_the_bench_and_the_server(tiny_models):
    from specdraft.bench.methods import get_method
    from specdraft.bench.options import BenchSettings
    from specdraft.bench.runner import variant_spec
    from specdraft.cli import build_parser
    from specdraft.knobs import drafter_knobs
    from specdraft.server.config import ServerConfig
    from specdraft.server.protocol import CompletionRequest, parse_request, spec_config

    args = build_parser().parse_args(["generate", "--method", "prompt-lookup", "--tree", "--tree-budget", "6"])
    spec = SpecConfig(method=args.method, gamma=args.gamma, tree=args.tree, **drafter_knobs(args))
    assert (spec.name, spec.setting("tree_budget")) == ("prompt-lookup-tree", 6)
    method = get_method("prompt-lookup-tree")
    assert not method.uses_gamma and variant_spec(BenchSettings(), method, None, {}).name == "prompt-lookup-tree"

    def requested(speculative: dict, default: SpecConfig) -> SpecConfig:
        body = {"model": "m", "prompt": "x", "speculative": speculative}
        return spec_config(parse_request(json.dumps(body).encode(), CompletionRequest, ServerConfig()), default)

    assert requested({"method": "draft", "tree": True}, SpecConfig("ar")).name == "draft-tree"
    assert requested({"method": "draft-tree"}, SpecConfig("ar")).name == "draft-tree"
    assert requested({"method": "draft"}, SpecConfig("draft-tree")).name == "draft"  # naming a method: a chain
    assert requested({"gamma": 3}, SpecConfig("prompt-lookup-tree")).name == "prompt-lookup-tree"
    with pytest.raises(Exception, match="drafts trees, and tree is false"):
        requested({"method": "draft-tree", "tree": False}, SpecConfig("ar"))
    target = tiny_models["target"]
    spec = SpecConfig("prompt-lookup", tree=True)
    engine = Engine(target, build_drafter(spec, target, None), spec)
    ids = engine.encode("abc abc abc ab", chat=False)
    got = engine.generate(ids, SamplingParams(max_new_tokens=12))
    assert got.token_ids == Engine(target).generate(ids, SamplingParams(max_new_tokens=12)).token_ids
    assert got.stats.method == "prompt-lookup-tree" and got.stats.tree_passes > 0


def test_each_options_dataclass_checks_its_own_settings(echo_registered):
    """A setting's checks live with it: its options dataclass refuses a bad value, and SpecConfig says so."""
    for bad, message in (({"draft_confidence": 1.0}, "draft confidence must be in"),
                         ({"draft_context": -1}, "draft context must be >= 0"),
                         ({"tree_budget": 0}, "tree budget"), ({"lookup_min_ngram": 4}, "prompt lookup needs"),
                         ({"exit_rule": "sometimes"}, "exit rule"), ({"draft_vocab": "5"}, "draft_vocab must be")):
        with pytest.raises(SpecdraftError, match=message):
            SpecConfig(**bad)
    for cls in option_classes():
        cls()  # every default passes its own checks
