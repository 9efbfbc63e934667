"""What Ray Serve's HTTP proxy adds to every request (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=
host.cluster.proxy.middlewares, set by `pie serve --replicas`): a call on an instance carries its
replica's pin for the router (router.py); a stream whose replica died ends with an error event,
as the server ends a stream that fails, never with a cut connection; the proxy's own plain-text
errors (a replica that died before answering, none up) are in OpenAI's shape."""

from __future__ import annotations

import json

from ..daemon.errors import APIError
from .router import PIN, pinned_replica

INSTANCES = "/v1/instances/"


def _failed(status: int) -> APIError:
    e = APIError(f"the replica serving this request failed or is unavailable (HTTP {status} from the proxy); "
                 "the deployment restarts it: retry", code="replica_failed")
    e.status = status
    return e


def _end_of_stream(path: str) -> bytes:
    """The error event that ends a cut stream: the inferlet API's `error` event, or OpenAI's
    error chunk and [DONE]."""
    body = json.dumps(_failed(502).body())
    if path.startswith(INSTANCES):
        return f"event: error\ndata: {body}\n\n".encode()
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


class EndCutStreams:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope = pinned(scope)
        state = {"started": False, "ended": False, "stream": False, "held": None}

        async def watch(message):
            if message["type"] == "http.response.start":
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                kind = headers.get(b"content-type", b"")
                state["stream"] = kind.startswith(b"text/event-stream")
                if message["status"] >= 500 and not kind.startswith(b"application/json"):
                    state["held"] = message["status"]  # the proxy's own text: rewritten below
                    return
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
                if state["held"] is not None:
                    await _send_error(send, _failed(state["held"]))
                    state["started"] = True
                    return
            elif state["held"] is not None:
                return
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if state["started"] and not state["ended"]:  # the replica died mid-response
                tail = _end_of_stream(scope.get("path", "")) if state["stream"] else b""
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            elif not state["started"] and state["held"] is not None:
                await _send_error(send, _failed(state["held"]))


def _session_header() -> bytes:
    from ray.serve._private.constants import SERVE_SESSION_ID  # where the proxy reads the session id

    return SERVE_SESSION_ID.lower().encode()


def pinned(scope: dict) -> dict:
    """The request with its pin as its session id: its replica's on an instance's path, none
    elsewhere (a client's own session id would pin nothing, and is dropped)."""
    key = _session_header()
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower().replace(b"_", b"-") != key.replace(b"_", b"-")]
    replica = pinned_replica(scope.get("path", ""))
    if replica is not None:
        headers.append((key, (PIN + replica).encode()))
    return {**scope, "headers": headers}


async def _send_error(send, e: APIError) -> None:
    body = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def middlewares() -> list:
    from starlette.middleware import Middleware

    return [Middleware(EndCutStreams)]
