"""Guest SDK modules that also run in plain CPython, and channels for device-loop tests.

The SDK package's __init__ imports the component bindings, so its pure-Python modules (the
epilogue tracer, the Cacheback program builder, the references, the rejection rule) are loaded here
as the package `inferlet` without its __init__.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

SDK = Path(__file__).resolve().parents[1] / "inferlets" / "sdk" / "inferlet"


def _sdk():
    """The SDK's folder as the package `inferlet`, without running its __init__ (which imports
    the component's bindings): its modules import each other as they do in the component."""
    import sys
    import types

    if "inferlet" not in sys.modules:
        pkg = types.ModuleType("inferlet")
        pkg.__path__ = [str(SDK)]
        sys.modules["inferlet"] = pkg
    return sys.modules["inferlet"]


_sdk()
trace = importlib.import_module("inferlet.trace")
cacheback = importlib.import_module("inferlet.cacheback")
reference = importlib.import_module("inferlet.reference")
speculative = importlib.import_module("inferlet.speculative")
constrained = importlib.import_module("inferlet.constrained")
args = importlib.import_module("inferlet.args")


def chan(capacity, values=()):
    """A runtime channel of int64 cells (u32 storage, as an inferlet's), holding `values`
    (written past the u32 check: programs' state channels start at -1)."""
    from host.runtime.channels import Channel

    ch = Channel("uint32", capacity, torch.device("cpu"))
    ch.buf[:len(values)] = torch.tensor(list(values), dtype=torch.int64)
    ch.length = len(values)
    return ch


def cells(ch) -> list:
    return ch.read(0, ch.length)


def plain_greedy(eng, prompt, n):
    """Reference: n tokens of greedy autoregressive decoding, one engine pass per token."""
    from host.engine import Pass

    ws = eng.new_working_set()
    (out,) = eng.forward([Pass(ws, prompt, [len(prompt) - 1])])
    toks = []
    for _ in range(n):
        t = int(out.logits[-1].argmax())
        toks.append(t)
        (out,) = eng.forward([Pass(ws, [t], [0])])
    eng.release(ws)
    return toks
