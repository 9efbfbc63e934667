"""Inferlets launched through the inferlet API: each run's events, kept from its start so an
attach replays them, and the registry of runs by id."""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
from dataclasses import fields
from typing import AsyncIterator

from ..errors import PieError
from ..runtime.limits import Limits
from ..runtime.runtime import RunHandle, RunResult
from . import sse
from .errors import BadRequest, NotFound, from_instance_error
from .ids import instance_id
from .instances import Instances
from .inferlets import Inferlet

KEEP_ENDED = 64  # ended runs kept for a late attach or a look at their result

# the limits a launch may ask for, named and scaled as `pie run`'s flags (--memory-mb -> memory_mb)
LIMIT_KEYS = {f.metadata["flag"].lstrip("-").replace("-", "_"): f for f in fields(Limits) if f.metadata["flag"]}


def capped_limits(asked: dict[str, float], server: Limits) -> Limits:
    """The server's limits, lowered where a launch asks for less; asking for more is a 400 that
    names the cap (a launch is never served with less than it asked for, unsaid)."""
    kw = {}
    for key, value in asked.items():
        f = LIMIT_KEYS.get(key)
        if f is None:
            raise BadRequest(f"limits.{key}: unknown; known: {', '.join(LIMIT_KEYS)}", param=f"limits.{key}")
        m = f.metadata
        if not math.isfinite(value) or value <= 0:  # int(inf) and int(nan) raise: refused here
            raise BadRequest(f"limits.{key}: must be a positive finite number, not {value}", param=f"limits.{key}")
        cap = getattr(server, f.name)
        if value * m["unit"] > cap:
            raise BadRequest(f"limits.{key}: {value:g} exceeds this server's cap of {m['kind'](cap / m['unit']):g}",
                             param=f"limits.{key}")
        kw[f.name] = m["kind"](value * m["unit"])
    try:
        return Limits(**{f.name: getattr(server, f.name) for f in fields(Limits)} | kw)
    except PieError as e:
        raise BadRequest(str(e), param="limits") from None


class Run:
    """One launched instance. Its events are `text` as it streams, then at the end `tokens`,
    `stats`, `return` (the RunResult as `pie run --json` prints it) and, if it failed, `error`."""

    def __init__(self, runs: "Runs", inferlet: Inferlet, args: list[str], limits: Limits, detach: bool,
                 owner: str | None, arrived: float):
        self.id = instance_id(runs.replica)
        self.inferlet, self.args, self.limits, self.detach = inferlet, args, limits, detach
        self.owner = owner  # the key that launched it: only that key sees, attaches to or cancels it
        self.created = int(time.time())
        self.result: RunResult | None = None
        self._loop = asyncio.get_running_loop()
        self._events: list[str] = []
        self._grew = asyncio.Event()  # replaced on each append: a waiter holds the one it saw
        self._runs = runs
        self.handle: RunHandle = runs.instances.spawn(inferlet.path, args, name=inferlet.run_name, owner=owner,
                                                      arrived=arrived, on_text=self._on_text,
                                                      on_result=self._on_result, limits=limits,
                                                      label=inferlet.metric_label)

    # from the instance's threads: hand over to the event loop
    def _post(self, fn, *a) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *a)
        except RuntimeError:  # the loop has closed: nobody is listening
            pass

    def _on_text(self, text: str) -> None:
        self._post(self._append, sse.event("text", {"text": text}))

    def _on_result(self, result: RunResult) -> None:
        self._post(self._end, result)

    # on the event loop
    def _append(self, event: str) -> None:
        self._events.append(event)
        grew, self._grew = self._grew, asyncio.Event()
        grew.set()

    def _end(self, result: RunResult) -> None:
        self._append(sse.event("tokens", {"token_ids": result.token_ids}))
        self._append(sse.event("stats", result.stats))
        self._append(sse.event("return", result.to_json()))
        if not result.ok:
            err = from_instance_error(result.error or "internal: no error given", result.returned)
            self._append(sse.event("error", err.body() | {"log": result.log}))
        self.result = result  # last: an attach that sees it has every event
        self._runs._ended(self)

    @property
    def status(self) -> str:
        if self.result is None:
            return "running"
        if self.result.ok:
            return "succeeded"
        return "cancelled" if (self.result.error or "").startswith("cancelled:") else "failed"

    def card(self) -> dict:
        limits = {k: f.metadata["kind"](getattr(self.limits, f.name) / f.metadata["unit"])
                  for k, f in LIMIT_KEYS.items()}  # in the units a launch asks in
        out = {"id": self.id, "object": "inferlet.instance", "created": self.created, "status": self.status,
               "inferlet": self.inferlet.run_name, "hash": self.inferlet.hash, "args": self.args,
               "detach": self.detach, "limits": limits}
        if self.result is not None and not self.result.ok:
            out["error"] = self.result.error
        return out

    def cancel(self, reason: str) -> None:
        self.handle.cancel(reason)

    async def events(self) -> AsyncIterator[str]:
        """Every event from the start, then the new ones as they come, until the run has ended.
        Leaving early (the client went away) cancels the run unless it was launched detached."""
        i = 0
        try:
            while True:
                grew = self._grew
                if i < len(self._events):
                    i += 1
                    yield self._events[i - 1]
                elif self.result is not None:
                    return
                else:
                    await grew.wait()
        finally:
            if self.result is None and not self.detach:
                self.cancel("the client went away")


class Runs:
    """The launched runs by id: running ones, and the last KEEP_ENDED ended ones. A key sees only
    its own: another key's run is as unknown to it as one that never was."""

    def __init__(self, instances: Instances, replica: str | None = None):
        self.instances, self.replica = instances, replica  # replica: named in every id (None: one server)
        self._runs: dict[str, Run] = {}
        self._ended_ids: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()

    def launch(self, inferlet: Inferlet, args: list[str], limits: Limits, detach: bool, owner: str | None,
               arrived: float) -> Run:
        """Start the run in the slot `owner` holds (Admission.acquire)."""
        run = Run(self, inferlet, args, limits, detach, owner, arrived)
        with self._lock:
            self._runs[run.id] = run
        return run

    def _ended(self, run: Run) -> None:
        with self._lock:
            self._ended_ids.append(run.id)
            while len(self._ended_ids) > KEEP_ENDED:
                self._runs.pop(self._ended_ids.popleft(), None)

    def get(self, run_id: str, owner: str | None) -> Run:
        with self._lock:
            run = self._runs.get(run_id)
        if run is None or run.owner != owner:
            raise NotFound(f"no instance {run_id!r} (ended ones are kept for the last {KEEP_ENDED})",
                           param="instance_id", code="instance_not_found")
        return run

    def list(self, owner: str | None) -> list[Run]:
        with self._lock:
            return [r for r in self._runs.values() if r.owner == owner]
