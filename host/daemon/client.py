"""`pie run --server URL`: run an inferlet on a `pie serve` daemon through the inferlet API,
printing what the in-process `pie run` prints (text to stdout, or with --json its one object;
a failure's log and error to stderr, exit status 1)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

from ..errors import PieError


class ServerError(PieError):
    """The daemon refused a request, or cannot be reached."""

    code = "server"


def _ok(resp: httpx.Response) -> httpx.Response:
    """The response, or its error (OpenAI's shape) as a ServerError."""
    if resp.status_code >= 400:
        resp.read()
        try:
            msg = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = resp.text.strip() or resp.reason_phrase
        raise ServerError(f"{resp.request.method} {resp.request.url.path}: {resp.status_code}: {msg}")
    return resp


RETRY_FOR_S = 60.0  # how long a launch waits out 429s (a full queue, the key's limit) before giving up


def _launch(http: httpx.Client, body: dict) -> dict:
    """POST /v1/instances; a 429 is tried again after the server's Retry-After, for up to RETRY_FOR_S."""
    deadline = time.monotonic() + RETRY_FOR_S
    while True:
        resp = http.post("/v1/instances", json=body)
        wait = _seconds(resp.headers.get("retry-after")) if resp.status_code == 429 else None
        if wait is None or time.monotonic() + wait > deadline:
            return _ok(resp).json()
        time.sleep(wait)


def _seconds(retry_after: str | None) -> float:
    """Retry-After in seconds (this server sends whole seconds; an HTTP date counts as 1)."""
    try:
        return max(float(retry_after), 0.0)
    except (TypeError, ValueError):
        return 1.0


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, dict]]:
    """(event, data) of a server-sent event stream; each event here is one `event:` and one `data:` line."""
    event, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))


def run_remote(server: str, api_key: str | None, inferlet: str, args: list[str], limits: dict, as_json: bool) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    path = Path(inferlet)
    try:
        with httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=httpx.Timeout(30, read=None)) as http:
            if path.suffix == ".wasm" or path.is_file():
                try:
                    wasm = path.read_bytes()
                except OSError as e:
                    raise ServerError(f"{inferlet}: {e.strerror}") from None
                # launched by hash: a built-in of the same name cannot stand in for it
                inferlet = _ok(http.post("/v1/inferlets", params={"name": path.stem}, content=wasm,
                                         headers={"content-type": "application/wasm"})).json()["hash"]
            run = _launch(http, {"inferlet": inferlet, "args": args, "limits": limits})
            result, failure = None, None
            with http.stream("GET", f"/v1/instances/{run['id']}/events") as resp:
                _ok(resp)
                for event, data in sse_events(resp.iter_lines()):
                    if event == "text" and not as_json:
                        sys.stdout.write(data["text"])
                        sys.stdout.flush()
                    elif event == "return":
                        result = data
                    elif event == "error":
                        failure = data
    except httpx.HTTPError as e:
        raise ServerError(f"{server}: {e}") from None
    if result is None:
        raise ServerError(f"{server}: the instance's stream ended without its result")
    if as_json:
        print(json.dumps(result, ensure_ascii=False))
    elif result["text"] and not result["text"].endswith("\n"):
        print()
    if failure is not None:
        log = failure.get("log", "")
        if log.strip():
            sys.stderr.write(log if log.endswith("\n") else log + "\n")
        print(f"pie: error: {result['inferlet']}: {result.get('error', failure['error']['message'])}", file=sys.stderr)
        return 1
    return 0
