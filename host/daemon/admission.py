"""Admission: which requests may start an instance now, which wait, and which are refused.

At most `slots` instances run at once (--max-instances); past them a request waits in a FIFO
queue of at most `queue` places (--max-queue) and starts when a slot frees; past that, or past
its key's `per_key` instances (--max-instances-per-key, running and waiting together), it is
refused with 429 and Retry-After at once. Nothing is dropped: every request either starts,
is refused with a status, or leaves the queue because its client went away (logged as 499).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from .errors import Busy, ClientGone, TooManyRequests


@dataclass(eq=False)
class _Waiter:
    owner: str | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(init=False)

    def __post_init__(self):
        self.future = self.loop.create_future()


class Admission:
    """Slots are taken on the event loop and freed from any thread (an instance's waiter)."""

    def __init__(self, slots: int, queue: int = 0, per_key: int | None = None):
        self.slots, self.queue, self.per_key = slots, queue, per_key
        self._lock = threading.Lock()
        self._running = 0
        self._waiting: collections.deque[_Waiter] = collections.deque()
        self._by_key: collections.Counter[str | None] = collections.Counter()  # running + waiting
        self._closed = False

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def closed(self) -> bool:
        return self._closed

    async def acquire(self, owner: str | None, gone: Callable[[], Awaitable] | None = None) -> None:
        """Take a slot for `owner`, waiting in the queue if need be. `gone()` (awaited only while
        queued) returns when the client has gone away: the request then leaves the queue (ClientGone)."""
        with self._lock:
            if self._closed:
                raise Busy("the server is shutting down", code="shutting_down")
            if self.per_key is not None and self._by_key[owner] >= self.per_key:
                raise TooManyRequests(f"this API key has {self.per_key} instances running or waiting "
                                      "(--max-instances-per-key); retry when one has ended", code="key_limit_reached")
            if self._running < self.slots and not self._waiting:
                self._running += 1
                self._by_key[owner] += 1
                return
            if len(self._waiting) >= self.queue:
                raise TooManyRequests(f"all {self.slots} instance slots (--max-instances) and {self.queue} queue "
                                      "places (--max-queue) are taken; retry later")
            waiter = _Waiter(owner, asyncio.get_running_loop())
            self._waiting.append(waiter)
            self._by_key[owner] += 1
        watch = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            if watch is None:
                await asyncio.shield(waiter.future)
            else:
                await asyncio.wait([waiter.future, watch], return_when=asyncio.FIRST_COMPLETED)
                if not waiter.future.done():
                    raise ClientGone("the client went away while its request was queued")
            waiter.future.result()  # a shutdown's Busy
        except BaseException:
            self._abandon(waiter)
            raise
        finally:
            if watch is not None and not watch.done():
                watch.cancel()

    def _abandon(self, waiter: _Waiter) -> None:
        """A waiter that will not run: out of the queue, or its granted slot given back."""
        with self._lock:
            queued = waiter in self._waiting
            if queued:
                self._waiting.remove(waiter)
                self._by_key[waiter.owner] -= 1
        granted = not queued and waiter.future.done() and not waiter.future.cancelled() \
            and waiter.future.exception() is None
        if not queued and not waiter.future.done():
            waiter.future.cancel()  # granted, the grant not yet delivered: _grant gives it back
        elif granted:
            self.release(waiter.owner)

    def release(self, owner: str | None) -> None:
        """An instance has ended (from any thread): its slot goes to the first waiter."""
        with self._lock:
            self._running -= 1
            self._by_key[owner] -= 1
            if self._by_key[owner] <= 0:
                del self._by_key[owner]
            while self._waiting and self._running < self.slots:
                waiter = self._waiting.popleft()
                self._running += 1
                waiter.loop.call_soon_threadsafe(self._grant, waiter)

    def _grant(self, waiter: _Waiter) -> None:
        if waiter.future.done():  # it left (its client went away) after the slot was given
            self.release(waiter.owner)
        else:
            waiter.future.set_result(None)

    def close(self) -> None:
        """Refuse new requests and the waiting ones (503 shutting down)."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            for w in waiting:
                self._by_key[w.owner] -= 1
        for w in waiting:
            w.loop.call_soon_threadsafe(_fail, w.future, Busy("the server is shutting down", code="shutting_down"))


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
