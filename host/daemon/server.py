"""uvicorn serving the app, with a shutdown that cancels the running instances first (uvicorn
would otherwise wait for every open stream to end by itself)."""

from __future__ import annotations

import logging
import signal
import socket

import uvicorn

from .app import create_app
from .service import Service

log = logging.getLogger("pie.serve")


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:  # SIGINT / SIGTERM
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl+C: stop waiting for open connections
        self.stop()

    def stop(self) -> None:
        self.should_exit = True
        # cancelled instances end their streams, so uvicorn's wait for open connections ends
        cancelled = self.service.instances.close(timeout=0)
        if cancelled:
            log.info("shutting down: cancelled %d running instance(s)", cancelled)


class Daemon:
    def __init__(self, service: Service, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info"):
        self.service = service
        config = uvicorn.Config(create_app(service), host=host, port=port, access_log=False, log_level=log_level,
                                timeout_graceful_shutdown=10, lifespan="off")
        self.server = _Uvicorn(config, service)

    @property
    def started(self) -> bool:
        return self.server.started

    def run(self, sock: socket.socket | None = None) -> None:
        """Serve until SIGINT/SIGTERM (in the main thread) or stop(); then wait for the instances to end."""
        try:
            self.server.run(sockets=[sock] if sock is not None else None)
        finally:
            self.service.instances.close()  # pages freed: every run has returned
            log.info("stopped; %d KV pages in use", self.service.engine.pool.used_pages)

    def stop(self) -> None:
        self.server.stop()
