"""Every use of wasmtime-py's private API, for wasmtime==50.0.1 (pinned in pyproject.toml).

Nothing else in the host imports wasmtime's private modules (`_bindings`, `_ffi`,
`component._types`) or calls a private method (`_context`). Each workaround below says what
it is for and when it can go; check them all when the pin moves.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Callable

import wasmtime
from wasmtime import _bindings, _ffi as ffi
from wasmtime.component import _types

from ..errors import Internal

# ---- per-thread case lowering -----------------------------------------------------------------
# wasmtime-py's component lowering keeps one module-global set, `_types.case_test_cache`, which
# it clears, fills with a case's Python classes and reads to pick the case of a `result` or
# `variant` value. Each inferlet runs on its own thread, so two host functions returning at
# once could read each other's classes (a `channels.take` error record was lowered as its
# `cells` payload and ended the instance with "TypeError: expected Variant type"). Here every
# thread gets its own set. It can go when the lowering keeps that state per call.


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


def install_per_thread_lowering() -> None:
    if not isinstance(getattr(_types, "case_test_cache", None), PerThreadSet):
        _types.case_test_cache = PerThreadSet()


# ---- the epoch deadline of a host function's store --------------------------------------------
# A host function gets a StoreContext, which has no public set_epoch_deadline (Store has).
# It can go when StoreContext gets one.

def set_epoch_deadline(store, ticks: int) -> None:
    """Set the epoch deadline of `store`, a Store or the StoreContext a host function is given."""
    ffi.wasmtime_context_set_epoch_deadline(store._context(), ticks)


# ---- an epoch deadline callback ---------------------------------------------------------------
# wasmtime-py offers no epoch deadline callback: a deadline always traps. This registers the
# C API's (wasmtime_store_epoch_deadline_callback) through wasmtime-py's ctypes bindings, one
# C function for all stores, finding each store's check by key. It can go when wasmtime-py
# wraps the callback.

_DeadlineFn, _FinalizerFn = _bindings._wasmtime_store_epoch_deadline_callback.argtypes[1::2]
_NO_FINALIZER = _FinalizerFn()  # a NULL function pointer
_KEYS = itertools.count(1)
_CHECKS: dict[int, Callable[[], int | str]] = {}


def on_epoch_deadline(store: wasmtime.Store, check: Callable[[], int | str]) -> int:
    """Call check() at each of the store's epoch deadlines: it returns the ticks to the next
    one, or a message that traps the guest. Returns the key for forget_epoch_deadline."""
    key = next(_KEYS)
    _CHECKS[key] = check
    # no finalizer: forget_epoch_deadline drops the check (a C callback at store drop could run at shutdown)
    ffi.wasmtime_store_epoch_deadline_callback(store.ptr(), _on_deadline, key, _NO_FINALIZER)
    return key


def forget_epoch_deadline(key: int | None) -> None:
    """Drop a check: a deadline after this traps."""
    _CHECKS.pop(key, None)


@_DeadlineFn
def _on_deadline(ctx, data, delta, kind):
    try:
        check = _CHECKS.get(data)
        out = check() if check is not None else "the instance has ended"
    except Exception as e:  # never raise through C
        out = f"{Internal.code}: the epoch check failed: {type(e).__name__}: {e}"
    if isinstance(out, str):  # trap with this message
        return ctypes.cast(ffi.wasmtime_error_new(out.encode("utf-8")), ctypes.c_void_p).value
    delta[0] = out
    kind[0] = 0  # WASMTIME_UPDATE_DEADLINE_CONTINUE
    return 0
