from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import build_model  # noqa: E402

# Tiny models gain nothing from a second thread, and torch's thread barriers make every tiny op ~100x slower
# whenever another process holds a core. The real-model tests set all cores themselves (test_real_models.py).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def threads_restored():
    """Each test leaves torch's thread count as it found it. A test that loads models through the API or the CLI
    sets all cores (`set_threads`), and the tiny-model tests after it then ran on 2 threads: on a busy host, 20x
    slower (CI on the Zen 3, 2026-12-06: the transformers tree-sampling test 5 minutes instead of 15 s)."""
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def one_thread():
    """One thread for a module's tiny models whatever an earlier module set, restored after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session", autouse=True)
def verify_curves_elsewhere(tmp_path_factory):
    """gamma auto measures and caches the target's verify curve: keep the tiny models' curves (and those of any
    server a test starts) out of the user's cache."""
    import os

    os.environ["SPECDRAFT_VERIFY_CURVES"] = str(tmp_path_factory.mktemp("verify-curves"))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """A target, a different draft (same tokenizer), and a model with another vocabulary size."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "target": build_model(root / "target", seed=1),
        "draft": build_model(root / "draft", seed=2, layers=1),
        "llama": build_model(root / "llama", seed=3, arch="llama"),
    }


@pytest.fixture(scope="session", params=["native", "transformers"])
def tiny_models(tiny_dirs, request):
    """The tiny models on each backend: every engine test runs on both forwards."""
    from specdraft import load_model

    return {name: load_model(str(path), dtype="float32", backend=request.param) for name, path in tiny_dirs.items()}
