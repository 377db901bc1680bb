"""The one error type a user mistake raises: the CLI prints its message without a traceback."""


class SpecdraftError(Exception):
    """A problem the user can fix; the message says what to do."""


# What each command needs beyond the core (pyproject.toml's optional dependencies), by import name
COMMAND_EXTRAS = {"serve": ("server", ("fastapi", "uvicorn", "prometheus_client")),
                  "bench": ("bench", ("matplotlib",)), "train": ("train", ("matplotlib",)),
                  "answers": ("answers", ("matplotlib",))}


def require_extra(command: str) -> None:
    """Refuse, naming the pip extra to install, a command whose optional dependencies are missing (before it
    loads any model), instead of an ImportError's traceback."""
    import importlib.util

    if command not in COMMAND_EXTRAS:
        return
    extra, modules = COMMAND_EXTRAS[command]
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise SpecdraftError(f"`specdraft {command}` needs the {extra} extra ({', '.join(missing)} not installed): "
                             f"pip install 'specdraft[{extra}]'")
