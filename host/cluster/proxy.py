"""What Ray Serve's HTTP proxy adds to every request (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=
host.cluster.proxy.middlewares, set by `pie serve --replicas`): a call on an instance carries its
replica's pin for the router (router.py), a completion its conversation's key; a stream whose replica died ends with an error event,
as the server ends a stream that fails, never with a cut connection; the proxy's own plain-text
errors (a replica that died before answering, none up) are in OpenAI's shape."""

from __future__ import annotations

import functools
import hashlib
import json

from ..daemon import sse
from ..daemon.errors import APIError
from .router import AFFINE, PIN, pinned_replica

INSTANCES = "/v1/instances/"
COMPLETIONS = ("/v1/chat/completions", "/v1/completions")
PREFIX_CHARS = 64  # a completion prompt's conversation key: its first characters
PREFIX_IDS = 16  # or its first token ids


def _failed(status: int) -> APIError:
    e = APIError(f"the replica serving this request failed or is unavailable (HTTP {status} from the proxy); "
                 "the deployment restarts it: retry", code="replica_failed")
    e.status = status
    return e


def _end_of_stream(path: str) -> bytes:
    """The error event that ends a cut stream: the inferlet API's `error` event, or OpenAI's
    error chunk and [DONE]."""
    body = _failed(502).body()
    if path.startswith(INSTANCES):
        return sse.event("error", body).encode()
    return (sse.data(body) + sse.data(sse.DONE)).encode()


class EndCutStreams:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope = pinned(scope)
        if scope.get("method") == "POST" and scope.get("path") in COMPLETIONS:
            receive, key = await _keyed(receive)
            if key is not None:
                scope = _with_session(scope, AFFINE + key)
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


@functools.cache
def _session_header() -> bytes:
    from ray.serve._private.constants import SERVE_SESSION_ID  # where the proxy reads the session id

    return SERVE_SESSION_ID.lower().encode()


def _with_session(scope: dict, session: str | None) -> dict:
    """`scope` with Ray's session-id header set to `session` (None: none; a client's own is dropped)."""
    key = _session_header()
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower().replace(b"_", b"-") != key.replace(b"_", b"-")]
    if session is not None:
        headers.append((key, session.encode()))
    return {**scope, "headers": headers}


def pinned(scope: dict) -> dict:
    """The request with its pin as its session id: its replica's on an instance's path, none
    elsewhere (a client's own session id would pin nothing, and is dropped)."""
    replica = pinned_replica(scope.get("path", ""))
    return _with_session(scope, None if replica is None else PIN + replica)


def affinity_key(body: bytes) -> str | None:
    """A completion's conversation, as far as its body shows one: the `user` it names, else a
    chat's messages up to its first user message (system prompt and first question: every later
    turn repeats them), else its prompt's first PREFIX_CHARS characters (PREFIX_IDS token ids;
    a batch's first prompt). None for a body that is not such JSON (the server refuses it)."""
    try:
        req = json.loads(body)
    except ValueError:
        return None
    if not isinstance(req, dict):
        return None
    if isinstance(req.get("user"), str) and req["user"]:
        head = ["user", req["user"]]
    elif isinstance(req.get("messages"), list):
        msgs = req["messages"]
        first = next((i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "user"), len(msgs) - 1)
        head = ["chat", req.get("model"), msgs[:first + 1]]
    elif "prompt" in req:
        p = req["prompt"]
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]  # a batch: its first prompt
        head = ["prompt", req.get("model"), p[:PREFIX_CHARS] if isinstance(p, str) else p[:PREFIX_IDS]
                if isinstance(p, list) else None]
    else:
        return None
    return hashlib.sha256(json.dumps(head, sort_keys=True, default=str).encode()).hexdigest()[:32]


async def _keyed(receive):
    """(a receive that replays the request's body, the body's affinity_key): the body is read
    whole first (the server bounds it; its own limits answer a body too large)."""
    held, body = [], bytearray()
    while True:
        message = await receive()
        held.append(message)
        if message["type"] != "http.request":
            break
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break

    async def replay():
        return held.pop(0) if held else await receive()

    return replay, affinity_key(bytes(body))


async def _send_error(send, e: APIError) -> None:
    body = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def middlewares() -> list:
    from starlette.middleware import Middleware

    return [Middleware(EndCutStreams)]
