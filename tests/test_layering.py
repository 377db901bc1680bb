"""The core (config, sampling, acceptance, engine, draft length, types, drafters, models/backends) imports none of
the apps built on it (bench, server, answers, train, the CLI): a walk over every import statement of every core
module, function-local ones included. And no function-local import hides an import cycle."""

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


def imported_modules(source: str, location: tuple[str, ...], top_level: bool | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, a module of the package at `location` (its
    path parts under specdraft/, e.g. ("models", "adapter.py")); with `top_level` True only the imports a module
    runs when it loads (its body, inside `if` and `try` included), with False only those inside functions."""
    package = ["specdraft", *location[:-1]]
    found = []
    tree = ast.parse(source)
    at_load = set()
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        at_load.add(node)
        if isinstance(node, (ast.If, ast.Try)):
            pending += node.body + node.orelse + getattr(node, "finalbody", []) + [
                statement for handler in getattr(node, "handlers", []) for statement in handler.body]
    for node in ast.walk(tree):
        if top_level is not None and (node in at_load) != top_level:
            continue
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


def module_name(path: Path) -> str:
    parts = ("specdraft", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def hidden_cycles(sources: dict[str, tuple[tuple[str, ...], str]]) -> list[str]:
    """Function-local imports of module B in module A where B's load-time imports lead back to A: moved to the
    top, each would be an import cycle. `sources` maps a module name to (its location, its source)."""
    def imports(name: str, top_level: bool) -> list[tuple[int, str]]:
        location, source = sources[name]
        return [(line, module) for line, module in imported_modules(source, location, top_level) if module in sources]

    at_load = {name: {module for _, module in imports(name, True)} for name in sources}

    def reaches(start: str, goal: str) -> bool:
        seen, stack = set(), [start]
        while stack:
            name = stack.pop()
            if name == goal:
                return True
            if name not in seen:
                seen.add(name)
                stack += at_load[name]
        return False

    return [f"{name}:{line} imports {module} inside a function; {module} imports {name} back"
            for name in sources for line, module in imports(name, False) if module != name and reaches(module, name)]


def test_no_function_local_import_hides_a_cycle():
    sources = {module_name(path): (path.relative_to(PACKAGE).parts, path.read_text())
               for path in sorted(PACKAGE.rglob("*.py"))}
    offences = hidden_cycles(sources)
    assert not offences, "\n".join(offences)


def test_negative_control_a_hidden_cycle_is_caught():
    sources = {"specdraft.a": (("a.py",), "from . import b\n"),
               "specdraft.b": (("b.py",), "def f():\n    from .a import g\n"),
               "specdraft.c": (("c.py",), "def f():\n    from .a import g\n")}
    assert hidden_cycles(sources) == ["specdraft.b:2 imports specdraft.a inside a function; specdraft.a imports "
                                      "specdraft.b back"]
