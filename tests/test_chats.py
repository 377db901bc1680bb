"""Chat-style training text (train/chats.py): prompts, the batched sampler, the resumable file, the corpus."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from specdraft.errors import SpecdraftError
from tiny import build_model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny model with a trivial chat template, on the transformers backend (the sampler's forward)."""
    from specdraft import load_model

    path = build_model(tmp_path_factory.mktemp("chats") / "m", seed=31, chars="abcdefghijklmnopqrstuvwxyz .?",
                       init_range=0.5)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}.{% endfor %}"
                               "{% if add_generation_prompt %}a:{% endif %}")
    config_path.write_text(json.dumps(config))
    model = load_model(str(path), dtype="float32", backend="transformers")
    with torch.no_grad():  # EOS often enough that some answers stop before the limit and leave the batch
        model.model.get_output_embeddings().weight[1].mul_(2.5)
    return model


def _encode(model, text: str) -> list[int]:
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def _gens(n: int, base: int = 7) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(base + i) for i in range(n)]


def test_a_padded_batch_samples_what_each_prompt_samples_alone(chat_model):
    from specdraft.train.chats import sample_batch

    texts = ("hello there", "a much longer prompt than the others", "hi", "what now?", "tell me.", "x",
             "and the last prompt is longer than any cache before it " * 3)
    prompts = [_encode(chat_model, t) for t in texts]
    batched = sample_batch(chat_model, prompts, 1.0, 40, _gens(len(prompts)))
    alone = [sample_batch(chat_model, [p], 1.0, 40, _gens(1, 7 + i))[0] for i, p in enumerate(prompts)]
    assert batched == alone
    # fewer rows than prompts: rows are refilled as answers end, joining a batch whose cache is longer or
    # shorter than their prompt, and the columns every remaining row pads are dropped; still each samples alone
    for rows in (2, 4):
        assert sample_batch(chat_model, prompts, 1.0, 40, _gens(len(prompts)), rows=rows) == alone
    # rows left the batch at different steps (EOS), others ran to the limit: the shrinking path ran
    assert {reason for _, reason in batched} == {"stop", "length"}
    assert all(len(ids) <= 40 for ids, _ in batched)
    # negative control: the same pad tokens, seen as text instead of masked, change what the short prompt samples
    pad = next(iter(chat_model.eos_token_ids))
    width = len(prompts[1])
    unmasked = [sample_batch(chat_model, [[pad] * (width - len(p)) + p], 1.0, 12, _gens(1, 7 + i))[0]
                for i, p in enumerate(prompts) if len(p) < width]
    assert unmasked != [a for a, p in zip(alone, prompts) if len(p) < width]


def _fake_prompts(per_kind: int, seed: int = 0, kinds=None):
    from specdraft.train.chats import ChatPrompt

    prompts = []
    for i in range(per_kind):
        prompts.append(ChatPrompt(f"chat-{i}", "chat", "generator:chat", f"hi number {i}?", "why?"))
        prompts.append(ChatPrompt(f"translate-{i}", "translate", "test", f"say {i} in german.",
                                  "say in english. {answer}", restart=True))
        prompts.append(ChatPrompt(f"math-{i}", "math", "generator:math", f"what is {i} plus {i}?"))
    return prompts


def test_generate_writes_conversations_resumes_and_refuses_other_settings(chat_model, tmp_path, monkeypatch):
    from specdraft.train import chats

    monkeypatch.setattr(chats, "build_prompts", _fake_prompts)
    monkeypatch.setattr("specdraft.models.adapter.load_model", lambda *a, **k: chat_model)
    config = chats.ChatsConfig(out=str(tmp_path / "c"), model="tiny", tokens=30, per_kind=6, batch=3,
                               max_new_tokens=10, temperature=1.0)
    path = chats.generate(config, progress=False)
    first = [json.loads(line) for line in path.read_text().splitlines()]
    assert sum(r["answer_tokens"] for r in first) >= 30
    by_id = {r["id"]: r for r in first}
    for r in first:
        roles = [role for role, _ in r["messages"]]
        assert roles[-1] == "assistant" and roles[0] == "user"
        if r["id"].endswith("/2"):
            parent = by_id[r["id"][:-2]]
            if r["kind"] == "translate":  # a restart: the German answer is the new prompt, alone
                assert len(r["messages"]) == 2 and parent["messages"][1][1] in r["messages"][0][1]
            else:  # a second turn: the first exchange, then the follow-up
                assert r["messages"][:2] == parent["messages"] and r["messages"][2] == ["user", "why?"]
    # resume: a larger budget keeps every finished line and continues with the next prompts
    path.write_text(path.read_text() + '{"id": "cut-by-a-kil')  # a line cut by a killed run is dropped
    more = chats.generate(chats.ChatsConfig(**{**config.__dict__, "tokens": 60}), progress=False)
    second = [json.loads(line) for line in more.read_text().splitlines()]
    assert any(r["id"].endswith("/2") for r in second if r["kind"] == "chat")
    assert second[: len(first)] == first and len(second) > len(first)
    assert len({r["id"] for r in second}) == len(second)
    with pytest.raises(SpecdraftError, match="other settings"):
        chats.generate(chats.ChatsConfig(**{**config.__dict__, "temperature": 0.5}), progress=False)
    with pytest.raises(SpecdraftError, match="other settings"):
        chats.generate(chats.ChatsConfig(**{**config.__dict__, "kinds": ("chat", "math")}), progress=False)
    # a file from before the kinds setting ran the package kinds: resumed only when asked for those
    older = tmp_path / "older" / "chats.jsonl"
    older.parent.mkdir()
    older.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "kinds"}) + "\n" for r in first))
    with pytest.raises(SpecdraftError, match="other settings"):
        chats.generate(chats.ChatsConfig(**{**config.__dict__, "out": str(older.parent)}), progress=False)
    chats.generate(chats.ChatsConfig(**{**config.__dict__, "out": str(older.parent), "kinds": chats.PACKAGE_KINDS}),
                   progress=False)
    # the file as a corpus: every conversation is a document
    docs = chats.corpus_docs(f"chats:{tmp_path / 'c'}")
    assert len(docs) == len(second) and all(d.source.startswith("chats:tiny:") for d in docs)


def test_a_first_answer_the_kind_rejects_gets_no_second_turn(chat_model, tmp_path, monkeypatch):
    from specdraft.train import chats

    monkeypatch.setattr(chats, "build_prompts", _fake_prompts)
    monkeypatch.setattr("specdraft.models.adapter.load_model", lambda *a, **k: chat_model)
    judged = []
    monkeypatch.setattr(chats, "followup_accepts", lambda kind, text: judged.append(kind) and False)
    config = chats.ChatsConfig(out=str(tmp_path / "c"), model="tiny", tokens=60, per_kind=6, batch=3,
                               max_new_tokens=10, temperature=1.0)  # the run above: its chats get second turns
    records = [json.loads(line) for line in chats.generate(config, progress=False).read_text().splitlines()]
    assert "chat" in judged and not any(r["id"].endswith("/2") for r in records)


def test_prompts_cover_every_kind_deterministically_and_interleaved():
    from specdraft.train.chats import KINDS, build_prompts

    prompts = build_prompts(3)
    assert prompts == build_prompts(3)
    assert [p.kind for p in prompts[: len(KINDS)]] == list(KINDS)
    assert sorted(p.kind for p in prompts) == sorted(KINDS * 3)
    assert len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        assert p.source.startswith("generator:") or "==" in p.source
        assert "bigbench" not in p.source and "human" not in p.source.split("==")[0]


def test_package_kinds_keep_their_prompts_whatever_else_is_asked_for():
    """Files written before the prose kinds existed resume with the same prompts: the package kinds' stream is
    unchanged (ids pinned from the builder before the change) and does not depend on the selection."""
    import hashlib

    from specdraft.train.chats import PACKAGE_KINDS, build_prompts
    from specdraft.train.prose import PROSE_KINDS

    package = build_prompts(3, kinds=PACKAGE_KINDS)
    ids = " ".join(p.id for p in package)
    assert hashlib.sha256(ids.encode()).hexdigest() == "d7fc2e38f66fcd9509b5a55a1d73e349d4c143ee7c5a98d27798eb0ca2d8ddc7"
    assert [p for p in build_prompts(3) if p.kind in PACKAGE_KINDS] == package
    assert build_prompts(3, kinds=("chat", "code")) == [p for p in package if p.kind in ("chat", "code")]
    prose = build_prompts(5, seed=4, kinds=PROSE_KINDS)
    assert [p for p in build_prompts(5, seed=4) if p.kind in PROSE_KINDS] == prose
    assert all(p.followup and p.restart and p.source == f"generator:{p.kind}" for p in prose)
    assert build_prompts(5, seed=5, kinds=PROSE_KINDS) != prose


def test_no_prose_subject_or_place_shares_a_topic_with_the_benchmark(tmp_path):
    """The prose kinds' subjects and places are ours: none is named in the benchmark's prompts (that would train
    the head on a benchmark topic; three subjects and a city were withdrawn for it). A chats file made before
    keeps its conversations on withdrawn subjects, and the corpus leaves them out. Negative control: a withdrawn
    name is found in the benchmark."""
    import re

    from specdraft.bench.suite import DEFAULT_PROMPTS, load_prompts
    from specdraft.train import prose
    from specdraft.train.chats import build_prompts, chat_docs

    suite = " ".join(" ".join(p["turns"]) for p in load_prompts(DEFAULT_PROMPTS))

    def named(phrase: str) -> bool:
        phrase = re.sub(r"^(the|der|die|das|a|an) ", "", phrase, flags=re.IGNORECASE)
        return re.search(r"\b" + re.escape(phrase) + r"\b", suite, re.IGNORECASE) is not None

    listed = prose._SUBJECTS + prose._GERMAN_SUBJECTS + prose._PLACES
    assert [s for s in listed if named(s)] == []
    assert all(named(w) for w in prose.WITHDRAWN)  # the control: the check finds what it looks for
    assert not any(prose.names_withdrawn(p.user) for p in build_prompts(100, kinds=prose.PROSE_KINDS))
    path = tmp_path / "old.jsonl"
    rows = [["user", "Write a paragraph about the Ottoman empire."], ["user", "Write a paragraph about the Alps."],
            ["user", "Summarize: ... the vaccination campaign ..."], ["user", "Translate: Die Burg liegt hoch."]]
    path.write_text("".join(json.dumps({"id": f"q{i}", "model": "m", "messages": [m, ["assistant", "a"]]}) + "\n"
                            for i, m in enumerate(rows)))
    assert sorted(d.messages[0][1] for d in chat_docs(str(path))) == sorted([rows[1][1], rows[3][1]])


@pytest.mark.parametrize("kind, answer, accepted", [
    ("trivia", "Which river flows through the city of Varanasi?", True),
    ("trivia", "The Ganges flows through Varanasi.", False),
    ("trivia", "Question one?\nQuestion two?", False),
    ("german", "Der Rhein ist ein Fluss in Mitteleuropa. Er entspringt in den Alpen und mündet in die Nordsee.", True),
    ("german", "The Rhine is a river in central Europe. It rises in the Alps and flows into the North Sea.", False),
    ("news", "A storm flooded streets. " * 12, True),
    ("news", "A storm.", False),
    ("chat", "anything", True),
    ("chat", "  ", False),
])
def test_a_second_turn_follows_only_fit_first_answers(kind, answer, accepted):
    from specdraft.train.prose import followup_accepts

    assert followup_accepts(kind, answer) is accepted


def test_mixed_corpus_spreads_the_shorter_source_over_the_whole_list(tmp_path):
    from specdraft.train.chats import corpus_docs

    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "model": "m", "messages": [["user", "q"], ["assistant", "a"]]})
                            + "\n" for i in range(10)))
    merged = corpus_docs(f"packages+chats:{path}")
    chat_positions = [i for i, d in enumerate(merged) if d.source.startswith("chats:")]
    assert len(chat_positions) == 10 and len(merged) > 100
    assert chat_positions[-1] > len(merged) * 0.8 and chat_positions[0] < len(merged) * 0.2


@pytest.mark.parametrize("spec, message", [("chats:", "unknown corpus"), ("pkgs", "unknown corpus"),
                                           ("", "empty"), ("chats:/nonexistent/x", "no chats at")])
def test_bad_corpus_specs_are_user_errors(spec, message):
    from specdraft.train.chats import corpus_docs

    with pytest.raises(SpecdraftError, match=message):
        corpus_docs(spec)


def test_bad_chats_settings_are_user_errors():
    from specdraft.train.chats import ChatsConfig

    with pytest.raises(SpecdraftError, match="--batch"):
        ChatsConfig(out="x", batch=0)
    with pytest.raises(SpecdraftError, match="temperature"):
        ChatsConfig(out="x", temperature=0)
    with pytest.raises(SpecdraftError, match="--kinds takes distinct kinds from chat"):
        ChatsConfig(out="x", kinds=("chat", "poems"))
    with pytest.raises(SpecdraftError, match="--kinds"):
        ChatsConfig(out="x", kinds=())


def test_a_committed_chats_file_is_unpacked_into_the_cache_once(tmp_path, monkeypatch):
    from specdraft.train import chats

    record = {"id": "chat/0", "kind": "chat", "source": "s", "model": "m", "temperature": 0.7, "seed": 0,
              "per_kind": 1, "kinds": ["chat"], "messages": [["user", "hi"], ["assistant", "hello"]],
              "finish": "stop", "answer_tokens": 1}
    bundled = tmp_path / "repo"
    bundled.mkdir()
    (bundled / "shipped.jsonl.gz").write_bytes(gzip.compress((json.dumps(record) + "\n").encode()))
    monkeypatch.setattr(chats, "BUNDLED_CHATS", bundled)
    monkeypatch.setattr(chats, "chats_root", lambda: tmp_path / "cache")
    path = chats.chats_file("shipped")
    assert path == tmp_path / "cache" / "shipped" / "chats.jsonl"
    assert [d.source for d in chats.chat_docs("shipped")] == ["chats:m:chat/0"]
    path.write_text("")  # the cache's copy wins once it exists (a resumed run appends to it)
    assert chats.chats_file("shipped").read_text() == ""
    assert chats.chats_file("elsewhere") == tmp_path / "cache" / "elsewhere" / "chats.jsonl"
    assert not (tmp_path / "cache" / "elsewhere").exists()


def test_the_committed_chats_files_are_whole_and_keep_off_the_benchmark():
    """Every file in data/eagle/chats reads, holds whole conversations (a second turn right after its first) and
    no benchmark turn; records naming a withdrawn subject may be there, since chat_docs leaves them out."""
    from specdraft.train import chats

    bench_turns = {turn.strip() for line in (chats.BUNDLED_CHATS.parents[1] / "bench" / "prompts.jsonl").open()
                   for turn in json.loads(line)["turns"]}
    files = sorted(chats.BUNDLED_CHATS.glob("*.jsonl.gz"))
    assert files
    for path in files:
        records = [json.loads(line) for line in gzip.open(path, "rt")]
        ids = [r["id"] for r in records]
        assert len(set(ids)) == len(ids), path.name
        for i, key in enumerate(ids):
            if key.endswith("/2"):
                assert ids[i - 1] == key[:-2], (path.name, key)
        assert all(r["messages"][-1][0] == "assistant" and r["answer_tokens"] > 0 for r in records), path.name
        assert not {text.strip() for r in records for role, text in r["messages"] if role == "user"} & bench_turns
