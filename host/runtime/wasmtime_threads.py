"""A thread-safety repair for wasmtime-py (50.0.1), applied on import by bindings.py.

Its component lowering keeps one module-global set, `case_test_cache`, which it clears, fills
with a case's Python classes and reads to pick the case of a `result` or `variant` value. Each
inferlet runs on its own thread, so two host functions returning at once could read each
other's classes: a `channels.take` error record was lowered as its `cells` payload and ended
the instance with "TypeError: expected Variant type". Here every thread gets its own set."""

from __future__ import annotations

import threading

from wasmtime.component import _types


class PerThreadSet:
    """The part of a set's interface the lowering uses (clear, add, iteration), one set per thread."""

    def __init__(self):
        self._local = threading.local()

    def _set(self) -> set:
        s = getattr(self._local, "s", None)
        if s is None:
            s = self._local.s = set()
        return s

    def clear(self) -> None:
        self._set().clear()

    def add(self, cls: type) -> None:
        self._set().add(cls)

    def __iter__(self):
        return iter(self._set())

    def __len__(self) -> int:
        return len(self._set())


def install() -> None:
    if not isinstance(getattr(_types, "case_test_cache", None), PerThreadSet):
        _types.case_test_cache = PerThreadSet()
