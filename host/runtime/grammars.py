"""The model's grammar engine (host/grammar), one per Engine, shared by its instances (the WIT
`grammars` interface: bindings/grammars.py) and the daemon's checks of a response schema."""

from __future__ import annotations

import weakref

from ..engine import Engine
from ..grammar import Grammars

_ENGINES: "weakref.WeakKeyDictionary[Engine, Grammars]" = weakref.WeakKeyDictionary()


def grammars_for(engine: Engine) -> Grammars:
    """The engine's grammar engine: one per model, so compiled grammars are shared by instances."""
    g = _ENGINES.get(engine)
    if g is None:
        info = engine.info
        g = _ENGINES[engine] = Grammars(engine.tokenizer, info.vocab_size, info.eos_ids)
    return g
