"""Guest SDK modules that also run in plain CPython, and the channel protocol of the device loop.

The SDK package's __init__ imports the component bindings, so its pure-Python modules (the
epilogue tracer, the speculative-decoding builder) are loaded here by path.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import torch

SDK = Path(__file__).resolve().parents[1] / "inferlets" / "sdk" / "inferlet"


def load_sdk(name: str):
    spec = importlib.util.spec_from_file_location(f"inferlet_{name}_plain", SDK / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


trace = load_sdk("trace")
speculative = load_sdk("speculative")


class Chan:
    """What the device loop needs of a channel (the runtime's channels follow it)."""

    def __init__(self, capacity, values=()):
        self.buf = torch.zeros(capacity, dtype=torch.int64)
        self.count = len(values)
        self.buf[: self.count] = torch.tensor(list(values), dtype=torch.int64)
        self.lock = threading.Condition()

    @property
    def length(self):
        return self.count

    def notify(self):
        with self.lock:
            self.lock.notify_all()

    def cells(self):
        return self.buf[: self.count].tolist()


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
