"""Batches the passes of every running inferlet into shared model calls.

Inferlet threads call `submit` and block on the returned future; one worker thread takes
everything pending, runs it as one engine step, and resolves the futures. A pass's result
never depends on which other passes shared its batch.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from ..errors import PieError
from .engine import Engine, Pass


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int = 64):
        self.engine = engine
        self.max_batch = max_batch
        self._pending: list[tuple[Pass, Future]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="pie-scheduler", daemon=True)
        self._thread.start()

    def submit(self, ps: Pass) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                fut.set_exception(PieError("the engine is shut down"))
                return fut
            self._pending.append((ps, fut))
            self._cv.notify()
        return fut

    def forward(self, ps: Pass):
        """Submit and wait: returns the PassOutput or raises the pass's PieError."""
        return self.submit(ps).result()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if self._closed and not self._pending:
                    return
                work, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            try:
                results = self.engine.forward([ps for ps, _ in work])
            except Exception as e:  # an engine bug must not hang every inferlet
                results = [e] * len(work)
            for (_, fut), res in zip(work, results):
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)
