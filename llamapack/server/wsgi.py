"""The production WSGI server for the Flask app: waitress, with bounded threads, connections and timeouts.

waitress reads requests on one event-loop thread and hands only complete ones to ``threads`` worker threads,
so idle or half-sent connections cost no thread (at most ``MAX_CONNECTIONS`` of them, each closed after
``IDLE_TIMEOUT_S`` without activity) and a body larger than ``max_body_bytes`` is refused before it is read.
A streamed response holds a worker thread until it ends or its client goes away.
"""
from __future__ import annotations

from dataclasses import dataclass

from waitress.server import create_server
from waitress.wasyncore import close_all

EXTRA_THREADS = 4  # besides one per admitted generation: /stats, /v1/models, refusals (429, 400) stay quick
MAX_CONNECTIONS = 100
IDLE_TIMEOUT_S = 60
BODY_SLACK = 64 << 10  # waitress refuses only beyond the app's own limit, which answers 413 in JSON


@dataclass
class Server:
    """A bound server: ``run()`` serves until ``close()`` (from another thread)."""

    _server: object

    @property
    def port(self) -> int:
        return self._server.effective_port

    def run(self) -> None:
        self._server.run()

    def close(self) -> None:
        """Close every socket on the event-loop thread itself (its loop then ends), then stop the workers."""
        try:
            self._server.trigger.pull_trigger(lambda: close_all(self._server._map))
        except OSError:  # the trigger's pipe is already closed (the loop has ended): close from here
            close_all(self._server._map)
        self._server.task_dispatcher.shutdown()


def make_server(app, host: str, port: int, *, queue_size: int, max_body_bytes: int) -> Server:
    """Bind ``host:port`` (0: a free port) for ``app`` with ``queue_size + EXTRA_THREADS`` worker threads."""
    return Server(create_server(app, host=host, port=port, threads=queue_size + EXTRA_THREADS,
                                connection_limit=MAX_CONNECTIONS, channel_timeout=IDLE_TIMEOUT_S,
                                max_request_body_size=max_body_bytes + BODY_SLACK, ident="llamapack"))
