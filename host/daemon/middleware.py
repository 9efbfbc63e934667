"""Plain ASGI middleware (no BaseHTTPMiddleware: it would buffer streams and hide disconnects):
the request log and counts, and the API-key check that runs before a body is read."""

from __future__ import annotations

import json
import logging
import time

from .auth import key_id, matching_key
from .errors import Unauthorized
from .metrics import Metrics

log = logging.getLogger("pie.serve")

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/inferlets", "/v1/instances", "/metrics",
             "/health")


def endpoint(path: str) -> str:
    """A bounded label value: the path of a known endpoint, an instance's routes by template."""
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/instances/"):
        rest = path[len("/v1/instances/"):].partition("/")[2]
        return "/v1/instances/{id}" + (f"/{rest}" if rest in ("events", "cancel") else "")
    return "other"


class RequestLog:
    """One log line per request when its response ends, and its count by endpoint and status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500  # if the app raises before it responds

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"]
            self.metrics.requests.labels(endpoint(path), str(status)).inc()
            client = scope.get("client") or ("-", 0)
            log.info("%s %s %s %d %.1f ms", client[0], scope["method"], path, status,
                     (time.perf_counter() - t0) * 1e3)


class ApiKeys:
    """401 for /v1/ requests without a valid bearer key, before the body is read or anything runs;
    a request with one is owned by it (scope["state"]["owner"], its key_id: instances, limits)."""

    def __init__(self, app, keys: list[str] | None):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.keys is not None and scope["path"].startswith("/v1/"):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            key = matching_key(self.keys, header)
            if key is not None:
                scope.setdefault("state", {})["owner"] = key_id(key)
            else:
                err = Unauthorized("a valid API key is required: send `Authorization: Bearer KEY`")
                body = json.dumps(err.body()).encode()
                await send({"type": "http.response.start", "status": err.status,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
