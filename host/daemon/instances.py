"""The inferlet instances serving requests: admission (--max-instances) and each instance's
text as an async stream, cut at stop strings."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import AsyncIterator, Callable

from ..runtime.limits import Limits
from ..runtime.runtime import RunHandle, RunResult, Runtime
from .errors import Busy, from_instance_error
from .metrics import Metrics
from .stops import StopCutter


class Instances:
    """The running instances of one server: at most `limit` at once; one more is refused with
    Busy (503) at once rather than queued, so a client can retry elsewhere or later."""

    def __init__(self, runtime: Runtime, wasm: Path, limit: int, metrics: Metrics):
        self.runtime, self.wasm, self.limit, self.metrics = runtime, wasm, limit, metrics
        self._lock = threading.Lock()
        self._live: set[RunHandle] = set()
        self._count = 0  # slots taken: counted before the instance starts, freed when it has ended
        self._closed = False

    @property
    def running(self) -> int:
        return self._count

    def start(self, args: list[str], *, prompt_tokens: int, stops: list[str]) -> "Generation":
        gen = Generation(self, args, prompt_tokens, stops)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        return gen

    def spawn(self, wasm: Path | bytes, args: list[str], *, name: str, on_text: Callable[[str], None] | None,
              on_result: Callable[[RunResult], None], limits: Limits | None = None) -> RunHandle:
        """Start one instance in a free slot (else Busy); `on_result` is called from a waiter
        thread once its run has returned and its slot is free. Every instance of the server,
        an OpenAI request's or a launched inferlet's, starts here."""
        with self._lock:
            if self._closed:
                raise Busy("the server is shutting down", code="shutting_down")
            if self._count >= self.limit:
                raise Busy(f"all {self.limit} instance slots are busy (--max-instances); retry later")
            self._count += 1
        self.metrics.running.inc()
        try:
            handle = self.runtime.start(wasm, args, name=name, on_text=on_text, limits=limits)
        except BaseException:
            self._ended(None, None)
            raise
        with self._lock:
            self._live.add(handle)
            closed = self._closed
        if closed:  # shutdown began while it started
            handle.cancel("the server is shutting down")

        def wait() -> None:
            result = handle.result()
            self._ended(handle, result)
            on_result(result)
        threading.Thread(target=wait, name="pie-serve-wait", daemon=True).start()
        return handle

    def _ended(self, handle: RunHandle | None, result: RunResult | None) -> None:
        """Called from the waiter thread when an instance's run has returned (its pages are freed)."""
        with self._lock:
            self._count -= 1
            self._live.discard(handle)
        self.metrics.running.dec()
        if result is not None:
            self.metrics.generation_tokens.inc(len(result.token_ids))

    def close(self, reason: str = "the server is shutting down", timeout: float = 30.0) -> int:
        """Refuse new instances, cancel the running ones and wait for them to end; how many were cancelled."""
        with self._lock:
            self._closed = True
            live = list(self._live)
        for h in live:
            h.cancel(reason)
        for h in live:
            h.thread.join(timeout)
        return len(live)


class Generation:
    """One instance serving one request. `text()` yields its text as it is generated; leaving
    it before the end (a client gone, a stop string) cancels the instance."""

    def __init__(self, instances: Instances, args: list[str], prompt_tokens: int, stops: list[str]):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[str | RunResult] = asyncio.Queue()
        self._cut = StopCutter(stops)
        self._instances = instances
        self._eos = set(instances.runtime.engine.info.eos_ids)
        self.prompt_tokens = prompt_tokens
        self.stopped = False  # a stop string was reached
        self.result: RunResult | None = None  # set by the waiter thread when the run has returned
        # on_text runs on the instance's or the compute thread: it only hands the text over
        self.handle = instances.spawn(instances.wasm, args, name=instances.wasm.stem, on_text=self._post,
                                      on_result=self._ended)

    def _post(self, item: str | RunResult) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def _ended(self, result: RunResult) -> None:
        self.result = result
        self._post(result)

    async def text(self) -> AsyncIterator[str]:
        """The text, cut before the first stop string; raises the instance's failure as an APIError."""
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, RunResult):
                    if self.stopped:
                        return  # cancelled by us: its error is ours
                    if not item.ok:
                        raise from_instance_error(item.error or "internal: no error given")
                    tail = self._cut.flush()
                    if tail:
                        yield tail
                    return
                if self.stopped:
                    continue  # text generated after the stop string, before the cancel took effect
                out, hit = self._cut.push(item)
                if out:
                    yield out
                if hit:
                    self.stopped = True
                    self.handle.cancel("a stop string was generated")
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Cancel the instance unless its run has ended (the client went away)."""
        if self.result is None:
            self.handle.cancel("the client went away")

    async def all_text(self) -> str:
        return "".join([t async for t in self.text()])

    @property
    def finish_reason(self) -> str:
        ids = self.result.token_ids
        return "stop" if self.stopped or (ids and ids[-1] in self._eos) else "length"

    def usage(self) -> dict:
        n = len(self.result.token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}
