"""OpenAI-compatible HTTP server: `specdraft serve`, or create_app() for models already loaded."""

from .app import create_app
from .config import ServerConfig
from .run import build_server, serve

__all__ = ["ServerConfig", "create_app", "build_server", "serve"]
