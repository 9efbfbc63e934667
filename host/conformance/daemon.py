"""The daemon adapter: runs cases on a `pie serve` daemon through its inferlet API, as any client
would (upload the probe to /v1/inferlets, launch with /v1/instances, attach to the events).

Over HTTP the suite sees only what a client sees: the instance's text and how it ended, never the
host's objects, so every case it runs is judged exactly as in process. What a daemon does not
show is absent from its capabilities: `cuda` (where the model runs is not part of the API), so a
case needing it SKIPs there; `mtp` is read from the model's facts through the probe itself, and
`grammar` from whether the probe can compile a regex there.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from ..daemon.client import ServerError, _ok, sse_events
from .adapter import Collected, HostAdapter
from .runner import MARK

PROBE_NAME = "conformance-probe"


class DaemonAdapter(HostAdapter):
    name = "daemon"

    def __init__(self, url: str, api_key: str | None = None):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # no read timeout by default: an event stream sets its own (collect)
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(30, read=None))
        try:
            self.served = self._request("GET", "/v1/models")["data"][0]["id"]
        except Exception:
            self.http.close()
            raise
        self.probe: str | None = None  # the uploaded probe's sha256
        self._caps: set[str] = set()

    def unavailable(self, model: str) -> str | None:
        if model != self.served:
            return f"the server serves {self.served!r}, not the case's model {model!r}"
        return None

    def capabilities(self) -> set[str]:
        return self._caps

    def install(self, wasm: Path) -> None:
        card = self._request("POST", "/v1/inferlets", params={"name": PROBE_NAME}, content=wasm.read_bytes(),
                             headers={"content-type": "application/wasm"})
        self.probe = card["hash"]  # launched by hash: a built-in of the same name cannot stand in for it
        steps = [{"call": "runtime.get-model-info"}, {"call": "grammars.compile", "args": ["regex", "a"]}]
        info = self.collect(self.launch(["--steps", json.dumps(steps)]), 60)
        facts = _probe_lines(info.text)
        if not info.ok or len(facts) < 2 or "ok" not in facts[0]:
            raise ServerError(f"{self.url}: the probe could not read the model's facts: {info.error or info.text!r}")
        self._caps = ({"mtp"} if facts[0]["ok"]["drafters"] else set()) | ({"grammar"} if "ok" in facts[1] else set())

    def launch(self, args: list[str]) -> str:
        # detached: reading a held instance's first lines (sent) leaves its stream before its end
        return self._request("POST", "/v1/instances", json={"inferlet": self.probe, "args": args,
                                                            "detach": True})["id"]

    def sent(self, launched: str, until, timeout_s: float) -> str:
        text = ""
        try:
            with self.http.stream("GET", f"/v1/instances/{launched}/events",
                                  timeout=httpx.Timeout(30, read=timeout_s)) as resp:
                _ok(resp)
                for event, data in sse_events(resp.iter_lines()):
                    if event == "text":
                        text += data["text"]
                        if until(text):
                            break
        except httpx.TimeoutException:
            pass  # silent for timeout_s: what it sent so far
        except httpx.HTTPError as e:
            raise ServerError(f"{self.url}: {e}") from None
        return text

    def cancel(self, launched: str) -> None:
        self._request("POST", f"/v1/instances/{launched}/cancel")

    def collect(self, launched: str, timeout_s: float) -> Collected:
        """The instance's end. The probe sends a line per step, so an instance silent for
        `timeout_s` is stuck: it is cancelled, and its events read again from the start to its end."""
        try:
            events = self._events(launched, timeout_s)
        except httpx.TimeoutException:
            self._request("POST", f"/v1/instances/{launched}/cancel")
            events = self._events(launched, None)
        result, failure = events.get("return"), events.get("error")
        if result is None:
            raise ServerError(f"{self.url}: instance {launched}'s events ended without its result")
        if result.get("model") != self.served:
            raise ServerError(f"{self.url}: instance {launched} ran on {result.get('model')!r}, not {self.served!r}")
        error = None if failure is None else result.get("error", failure["error"]["message"])
        return Collected(failure is None, error, result["text"])

    def _events(self, launched: str, silence_s: float | None) -> dict[str, dict]:
        """The last event of each kind, attached until the run ends (the server replays from its start)."""
        out = {}
        try:
            with self.http.stream("GET", f"/v1/instances/{launched}/events",
                                  timeout=httpx.Timeout(30, read=silence_s)) as resp:
                _ok(resp)
                for event, data in sse_events(resp.iter_lines()):
                    out[event] = data
        except httpx.TimeoutException:
            raise  # collect() cancels the instance
        except httpx.HTTPError as e:
            raise ServerError(f"{self.url}: {e}") from None
        return out

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kw) -> dict:
        try:
            return _ok(self.http.request(method, path, **kw)).json()
        except httpx.HTTPError as e:
            raise ServerError(f"{self.url}: {e}") from None


def _probe_lines(text: str) -> list[dict]:
    return [json.loads(ln[len(MARK):]) for ln in text.splitlines() if ln.startswith(MARK)]
