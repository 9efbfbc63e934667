"""Plain ASGI middleware (no BaseHTTPMiddleware: it would buffer streams and hide disconnects):
the request log and counts, the running-requests limit, the API-key check that runs before a body
is read, and the body cap."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from .auth import key_id, matching_key
from .errors import APIError, Busy, ClientGone, HeadersTooLarge, RequestTimeout, TooLarge, Unauthorized
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


_FAILED_IN_STREAM = "pie_failed_in_stream"


def failed_in_stream(request, err: APIError) -> None:
    """A stream that began with 200 and then failed: counted and logged with the error's status."""
    request.scope.setdefault("state", {})[_FAILED_IN_STREAM] = err.status


class RequestLog:
    """One log line per request when its response ends, and its count by endpoint and status (a
    stream that fails after its 200 began: the error's)."""

    def __init__(self, app, metrics: Metrics, replica: str | None = None):
        self.app, self.metrics = app, metrics
        self.who = f" [replica {replica}]" if replica else ""  # in a deployment: which replica served it
        self.replica_header = (b"x-pie-replica", replica.encode()) if replica else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500  # if the app raises before it responds

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if self.replica_header:
                    message = {**message, "headers": [*message.get("headers", []), self.replica_header]}
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"]
            status = scope.get("state", {}).get(_FAILED_IN_STREAM, status)
            self.metrics.requests.labels(endpoint(path), str(status)).inc()
            client = scope.get("client") or ("-", 0)
            log.info("%s %s %s %d %.1f ms%s", client[0], scope["method"], path, status,
                     (time.perf_counter() - t0) * 1e3, self.who)


class RunningLimit:
    """503 with Retry-After past `limit` requests being answered at once. It counts requests, not
    connections (uvicorn's limit_concurrency counts both): half-sent and idle connections, which
    the header timeout ends, never take the places of requests, and /health and /metrics, which
    cost nothing, are answered whatever runs."""

    EXEMPT = ("/health", "/metrics")

    def __init__(self, app, limit: int):
        self.app, self.limit, self.running = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.EXEMPT:
            return await self.app(scope, receive, send)
        if self.running >= self.limit:
            err = Busy(f"this server is answering {self.running} requests, its limit (pie serve --limit-concurrency)")
            return await send_error(send, err, [(b"retry-after", b"1")])
        self.running += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.running -= 1


class ApiKeys:
    """401 for /v1/ requests without a valid bearer key, before the body is read or anything runs;
    a request with one is owned by it (scope["state"]["owner"], its key_id: instances, limits)."""

    def __init__(self, app, keys: list[str] | None, metrics: bool = False):
        self.app, self.keys, self.metrics = app, keys, metrics  # metrics: /metrics needs a key too

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and self.keys is not None and (
                path.startswith("/v1/") or self.metrics and path == "/metrics"):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            key = matching_key(self.keys, header)
            if key is not None:
                scope.setdefault("state", {})["owner"] = key_id(key)
            else:
                err = Unauthorized("a valid API key is required: send `Authorization: Bearer KEY`")
                return await send_error(send, err, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


async def send_error(send, err: APIError, headers: list | None = None) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """431 for headers past `header_limit` bytes (h11 bounds only headers that arrive in pieces).
    413 for a body past `limit` bytes, before anything parses it: known by its Content-Length or
    as soon as the bytes read pass it; either way the rest of a body up to 4x the cap is read
    and dropped before the answer. The body is read here whole and handed on; `exempt`
    routes (the upload, which streams its body under its own limit) read it themselves. A client
    that leaves mid-body is logged as 499, not an error of the app."""

    def __init__(self, app, limit: int, header_limit: int, timeout: float, exempt: set[tuple[str, str]]):
        self.app, self.limit, self.header_limit, self.timeout, self.exempt = app, limit, header_limit, timeout, exempt
        self.drain = 4 * limit  # a body this long is read past the cap and dropped, so its 413 arrives

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        head = sum(len(k) + len(v) + 4 for k, v in scope["headers"]) + len(scope.get("raw_path") or b"")
        if head > self.header_limit:
            return await send_error(send, HeadersTooLarge(f"the request's headers are larger than this server's "
                                                          f"limit of {self.header_limit >> 10} KiB (pie serve "
                                                          "--max-header-kb)"), [(b"connection", b"close")])
        if (scope["method"], scope["path"]) in self.exempt:
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        try:
            async with asyncio.timeout(self.timeout):  # a body dribbled byte by byte holds a task
                if declared.isdigit() and int(declared) > self.limit:
                    body = self._too_large()
                    if int(declared) <= self.drain:
                        await self._discard(receive, int(declared))
                else:
                    body = await self._read(receive)
        except TimeoutError:
            body = RequestTimeout(f"the request body did not arrive within {self.timeout:g} s (pie serve "
                                  "--timeout-body)")
        if isinstance(body, APIError):
            return await send_error(send, body, [(b"connection", b"close")])
        whole: dict | None = {"type": "http.request", "body": body, "more_body": False}

        async def replay():
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # after the body: the disconnect, when it comes
        await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes | APIError:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return ClientGone("the client went away while sending its body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                if message.get("more_body", False):
                    await self._discard(receive, self.drain - size)
                return self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> APIError:
        return TooLarge(f"the request body is larger than this server's limit of {self.limit >> 20} MiB "
                        "(pie serve --max-body-mb)")

    @staticmethod
    async def _discard(receive, most: int) -> None:
        """Read and drop up to `most` bytes of the body. Closing on unread bytes makes the kernel reset
        the connection, and a reset can destroy the 413 before the client reads it."""
        while most > 0:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return
            most -= len(message.get("body", b""))
