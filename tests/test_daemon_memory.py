"""The server gives freed heap memory back after runs (host/daemon/memory.py): at most once a second."""

from __future__ import annotations

import time

from host.daemon import memory


def test_trim_runs_at_most_once_a_second(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_trim", lambda pad: calls.append(pad) or 1)
    monkeypatch.setattr(memory, "_last", 0.0)
    assert memory.trim() and not memory.trim()
    monkeypatch.setattr(memory, "_last", time.monotonic() - 2 * memory.EVERY_S)
    assert memory.trim() and calls == [0, 0]


def test_trim_is_glibcs_on_this_machine():
    assert memory._trim is not None  # the CI machines run glibc: the soak's figures depend on it
