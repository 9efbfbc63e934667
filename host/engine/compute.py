"""One thread runs the process's model work: loading, model calls, epilogues, KV copies.

Why one: PyTorch's CPU kernels parallelise with OpenMP (libgomp), which keeps a pool of
worker threads per thread that has started a parallel region. Once the process has more
pool threads than CPUs, libgomp stops spinning between regions and every region pays a
futex wake-up: measured here, a 1 MB `add` took 24 us on the thread that loaded the model
and 110 us on a second thread, and a one-row pass of the default model through the
inferlet scheduler's thread took ~70 ms instead of ~47 ms. So every thread that would
run torch work hands it to this one instead (`call`), and the scheduler's steps are tasks
on it too. On CUDA the same thread serialises kernel launches, which the engine needs anyway.
"""

from __future__ import annotations

import functools
import queue
import threading
from concurrent.futures import Future

_lock = threading.Lock()
_thread: ComputeThread | None = None


class ComputeThread:
    def __init__(self):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="pie-compute", daemon=True)
        self._thread.start()

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def busy(self) -> bool:
        """Whether tasks are queued (the running one aside)."""
        return not self._tasks.empty()

    def submit(self, fn, *args, **kwargs) -> Future:
        """Queue fn(*args, **kwargs) behind every task already queued."""
        fut: Future = Future()
        self._tasks.put((fut, fn, args, kwargs))
        return fut

    def call(self, fn, *args, **kwargs):
        """Run fn on the compute thread and return its result (inline when already there).
        The caller must not hold a lock that a queued task waits for."""
        if self.on_thread():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def _work(self) -> None:
        while True:
            fut, fn, args, kwargs = self._tasks.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # delivered to the caller, the thread lives on
                fut.set_exception(e)
            # an idle thread must not keep its last task (an ended instance's objects) alive
            del fut, fn, args, kwargs


def compute() -> ComputeThread:
    """The process's compute thread, started on first use."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = ComputeThread()
        return _thread


def on_compute_thread(fn):
    """Decorate a function (or method) so that every call of it runs on the compute thread."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return compute().call(fn, *args, **kwargs)

    return wrapper
