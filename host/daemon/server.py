"""uvicorn serving the app, with a shutdown that cancels the running instances first (uvicorn
would otherwise wait for every open stream to end by itself)."""

from __future__ import annotations

import logging
import signal
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import create_app
from .service import Service

log = logging.getLogger("pie.serve")


def _h11_with_header_timeout(timeout: float, max_connections: int) -> type:
    """uvicorn's h11 protocol with what uvicorn lacks: a deadline for a request's headers, and a
    bound on open connections that is not one on requests (RunningLimit). A connection that sends
    no headers, or dribbles them (slowloris), is closed `timeout` s after it connected or after its
    last response ended; the keep-alive timer stops at the first byte. A connection past
    `max_connections` open is closed at once."""

    class Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.close()  # connection_lost takes it out of the server's set
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers have all arrived
                self._disarm()

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._arm()  # before a pipelined request's headers are handled in there
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Protocol


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
        lim = service.config.limits
        config = uvicorn.Config(create_app(service), host=host, port=port, access_log=False, log_level=log_level,
                                timeout_graceful_shutdown=10, lifespan="off",
                                http=_h11_with_header_timeout(lim.header_timeout_s, lim.connections),
                                timeout_keep_alive=lim.keep_alive_s,
                                h11_max_incomplete_event_size=lim.header_bytes)
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
