"""The inferlet instances serving requests (each in a slot admission.py gave it), and each
OpenAI request's text as an async stream, cut at stop strings."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Callable

from ..engine.pages import Quota
from ..runtime.detok import Detokenizer
from ..runtime.limits import Limits
from ..runtime.runtime import RunHandle, RunResult, Runtime
from . import memory
from .admission import Admission
from .errors import Busy, from_instance_error
from .metrics import Metrics
from .inferlets import Inferlet
from .logprobs import Released
from .stops import StopCutter

log = logging.getLogger("pie.serve")



def cache_namespace(owner: str | None) -> str:
    """Where a key's working sets find and leave prompt blocks in the prefix cache: its own (one
    for a server without keys), so no tenant reads another's rows or times their presence."""
    return owner or ""

class Instances:
    """The running instances of one server. Each starts in a slot its request took from
    `admission` (Admission.acquire) and gives it back when its run has returned."""

    def __init__(self, runtime: Runtime, admission: Admission, metrics: Metrics, key_share: float | None = None):
        self.runtime, self.admission, self.metrics = runtime, admission, metrics
        self.key_share = key_share  # each key's share of the KV pool (None: no per-key quota)
        self._key_quotas: dict[str, Quota] = {}  # one per key of --api-key-file: bounded by the file
        self._lock = threading.Lock()
        self._live: set[RunHandle] = set()
        self._closed = False

    def key_quota(self, owner: str | None) -> Quota | None:
        """The KV quota all of `owner`'s instances count against together."""
        if owner is None or self.key_share is None:
            return None
        with self._lock:
            q = self._key_quotas.get(owner)
            if q is None:
                q = self._key_quotas[owner] = self.runtime.engine.pool.quota(
                    self.key_share, whose="this API key's", flag="--kv-share-per-key")
            return q

    @property
    def running(self) -> int:
        return self.admission.running

    def spawn(self, wasm: Path | bytes, args: list[str], *, name: str, owner: str | None, arrived: float,
              on_text: Callable[[str], None] | None, on_result: Callable[[RunResult], None],
              limits: Limits | None = None, label: str | None = None, logprobs: int | None = None,
              on_logprobs: Callable[[list], None] | None = None) -> RunHandle:
        """Start one instance in the slot `owner` holds; `on_result` is called from a waiter
        thread once its run has returned and its slot is free. `arrived` (perf_counter) is when
        its request came, for the latency metrics. Every instance of the server, an OpenAI
        request's or a launched inferlet's, starts here."""
        timing = _Timing(arrived)

        def text(t: str) -> None:
            timing.token()
            if on_text is not None:
                on_text(t)
        try:
            if self._closed:
                raise Busy("the server is shutting down", code="shutting_down")
            handle = self.runtime.start(wasm, args, name=name, on_text=text, limits=limits,
                                        kv_parent=self.key_quota(owner), logprobs=logprobs, on_logprobs=on_logprobs,
                                        namespace=cache_namespace(owner))
        except BaseException:
            self.admission.release(owner)
            raise
        with self._lock:
            self._live.add(handle)
            closed = self._closed
        if closed:  # shutdown began while it started
            handle.cancel("the server is shutting down")

        def wait() -> None:
            result = handle.result()
            with self._lock:
                self._live.discard(handle)
            self.admission.release(owner)
            self.metrics.ended(label or name, result, handle.draft_stats, timing.first, time.perf_counter() - arrived)
            on_result(result)
            memory.trim()
        threading.Thread(target=wait, name="pie-serve-wait", daemon=True).start()
        return handle

    def close(self, reason: str = "the server is shutting down", timeout: float = 30.0) -> int:
        """Refuse new instances and the queued requests, cancel the running ones and wait for
        them to end; how many were cancelled."""
        self.admission.close()
        with self._lock:
            self._closed = True
            live = list(self._live)
        for h in live:
            h.cancel(reason)
        for h in live:
            h.thread.join(timeout)
        return len(live)


class _Timing:
    """When a run's first text came, for time to first token (from the request's arrival)."""

    def __init__(self, arrived: float):
        self.arrived = arrived
        self.first: float | None = None  # seconds from arrival

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.arrived


class Generation:
    """One instance serving one request. `text()` yields its text as it is generated; leaving
    it before the end (a client gone, a stop string) cancels the instance. With `logprobs`,
    `logprobs()` gives the tokens' logprobs whose text `text()` has yielded (then the rest)."""

    def __init__(self, instances: Instances, inferlet: Inferlet, args: list[str], prompt_tokens: int,
                 stops: list[str], owner: str | None, arrived: float, logprobs: int | None = None):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[str | list | RunResult] = asyncio.Queue()
        self._released = Released(instances.runtime.engine.tokenizer) if logprobs is not None else None
        self._sent = 0  # characters yielded by text()
        self._over = False  # text() has seen the run's result
        self._cut = StopCutter(stops)
        self._instances = instances
        self._eos = set(instances.runtime.engine.info.eos_ids)
        self.prompt_tokens = prompt_tokens
        self.stopped = False  # a stop string was reached
        self.limit: str | None = None  # the limit that ended the run (RunResult.limit): it finished at "length"
        self.result: RunResult | None = None  # set by the waiter thread when the run has returned
        self.ended = asyncio.Event()  # set on the event loop once the run has returned and its slot is free
        self.began = asyncio.Event()  # set once it has emitted (its prompt is in the prefix cache) or ended
        # on_text runs on the instance's or the compute thread: it only hands the text over
        self.handle_name = inferlet.run_name
        self.handle = instances.spawn(inferlet.path, args, name=inferlet.run_name, owner=owner, arrived=arrived,
                                      on_text=self._post, on_result=self._ended, label=inferlet.metric_label,
                                      logprobs=logprobs, on_logprobs=self._post if logprobs is not None else None)

    def _post(self, item: str | list | RunResult) -> None:
        try:
            self._loop.call_soon_threadsafe(self._arrive, item)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def _arrive(self, item: str | list | RunResult) -> None:
        self._queue.put_nowait(item)
        self.began.set()

    def _ended(self, result: RunResult) -> None:
        self.result = result
        self._post(result)
        try:
            self._loop.call_soon_threadsafe(self.ended.set)
        except RuntimeError:
            pass

    async def text(self) -> AsyncIterator[str]:
        """The text, cut before the first stop string; raises the instance's failure as an APIError."""
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, list):  # an emission's logprobs, before its text
                    self._released.add(item)
                    continue
                if isinstance(item, RunResult):
                    self._over = True
                    if self.stopped:
                        return  # cancelled by us: its error is ours
                    if not item.ok and item.limit is None:
                        raise from_instance_error(item.error or "internal: no error given", item.returned)
                    if not item.ok:  # a limit ended it: the text so far is the answer, cut at "length"
                        self.limit = item.limit
                        log.warning("%s ended by a limit after %d tokens: %s", self.handle_name,
                                    len(item.token_ids), item.limit)
                    tail = self._cut.flush()
                    if tail:
                        self._sent += len(tail)
                        yield tail
                    return
                if self.stopped:
                    continue  # text generated after the stop string, before the cancel took effect
                out, hit = self._cut.push(item)
                if out:
                    self._sent += len(out)
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

    def logprobs(self) -> list | None:
        """The logprobs (offset, TokenLogprob) not given yet whose tokens' text text() has yielded;
        once the run has ended, the rest of those the client was given (completion_tokens)."""
        if self._released is None:
            return None
        if self._over:
            return self._released.take(self._sent) + self._released.rest(self.completion_tokens)
        return self._released.take(self._sent)

    @property
    def finish_reason(self) -> str:
        ids = self.result.token_ids
        return "stop" if not self.limit and (self.stopped or (ids and ids[-1] in self._eos)) else "length"

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens its run took from the prefix cache instead of computing them."""
        return self.result.stats.get("cached_tokens", 0) if self.result is not None else 0

    @property
    def completion_tokens(self) -> int:
        """The tokens the client was given: up to the one that completed the stop string, not
        those generated before the cancel took effect."""
        ids = self.result.token_ids if self.result is not None else []
        if not self.stopped or self._cut.end is None:
            return len(ids)
        detok, chars = Detokenizer(self._instances.runtime.engine.tokenizer), 0
        for k, t in enumerate(ids, 1):
            chars += len(detok.push([t]))
            if chars >= self._cut.end:
                return k
        return len(ids)
