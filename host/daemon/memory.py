"""Freed heap memory back to the system between runs.

A run's Python objects, tensors and guest buffers are freed when it ends, but glibc keeps freed
memory in its heaps (the main one and one per thread that allocated) for reuse, and a
long-running server's RSS creeps up with what those heaps hold though nothing leaks.
`malloc_trim(0)` returns their free pages; it runs after an instance ends, at most once a second.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

EVERY_S = 1.0

_lock = threading.Lock()
_last = 0.0
_trim = None
try:  # glibc only; elsewhere nothing to do
    _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
except (OSError, AttributeError):
    pass


def trim() -> bool:
    """Give free heap pages back unless that was done less than EVERY_S ago; whether it ran."""
    global _last
    if _trim is None:
        return False
    with _lock:
        now = time.monotonic()
        if now - _last < EVERY_S:
            return False
        _last = now
    _trim(0)
    return True
