"""The core (config, sampling, acceptance, engine, draft length, types, drafters, models/backends) imports none of
the apps built on it (bench, server, answers, train, the CLI): a walk over every import statement of every core
module, function-local ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import specdraft

PACKAGE = Path(specdraft.__file__).parent
APPS = ("bench", "server", "answers", "train", "cli")


def app_of(module: str) -> str | None:
    """The app a dotted module name (absolute, within specdraft) belongs to, or None for the core."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "specdraft" and parts[1] in APPS else None


def imported_modules(source: str, location: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, a module of the package at `location` (its
    path parts under specdraft/, e.g. ("models", "adapter.py"))."""
    package = ["specdraft", *location[:-1]]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def core_files() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py"))
            if path.relative_to(PACKAGE).parts[0].removesuffix(".py") not in APPS]


def test_the_core_imports_no_app():
    offences = [f"{path.relative_to(PACKAGE)}:{line} imports {module}" for path in core_files()
                for line, module in imported_modules(path.read_text(), path.relative_to(PACKAGE).parts)
                if app_of(module)]
    assert not offences, "\n".join(offences)


def test_negative_control_an_import_of_an_app_is_caught():
    """The walk must see a function-local relative import of an app from a core module, and absolute ones."""
    local = "def f():\n    from ..train.eagle_data import CollectConfig\n"
    assert [m for _, m in imported_modules(local, ("models", "probe.py")) if app_of(m)]
    assert [m for _, m in imported_modules("import specdraft.server\n", ("engine.py",)) if app_of(m)]
    assert [m for _, m in imported_modules("from .. import bench\n", ("drafters", "probe.py")) if app_of(m)]
    assert not [m for _, m in imported_modules("from ..models import adapter\n", ("drafters", "probe.py"))
                if app_of(m)]


def test_the_command_line_checks_its_arguments_before_torch_loads():
    """`import specdraft.cli` stays light (the package's names load on first use), so that a mistyped path fails
    at once; every name the package exports still imports."""
    import subprocess
    import sys

    code = "import sys, specdraft.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    for name in specdraft.__all__:
        assert getattr(specdraft, name) is not None
    with pytest.raises(AttributeError):
        specdraft.no_such_name  # noqa: B018
