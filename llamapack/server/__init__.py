"""``llamapack serve``: an OpenAI-compatible HTTP server for one loaded model (see ``create_app``)."""

from .app import create_app

__all__ = ["create_app"]
