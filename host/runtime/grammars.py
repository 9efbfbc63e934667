"""The WIT `grammars` interface for one instance: grammars and matchers as handles, on the
model's one grammar engine (host/grammar), and matchers bound to registered epilogues."""

from __future__ import annotations

import weakref

from wasmtime.component import Record

from ..engine import Engine
from ..errors import InvalidArgument
from ..grammar import Grammar, Grammars, Matcher

_ENGINES: "weakref.WeakKeyDictionary[Engine, Grammars]" = weakref.WeakKeyDictionary()


def grammars_for(engine: Engine) -> Grammars:
    """The engine's grammar engine: one per model, so compiled grammars are shared by instances."""
    g = _ENGINES.get(engine)
    if g is None:
        info = engine.info
        g = _ENGINES[engine] = Grammars(engine.tokenizer, info.vocab_size, info.eos_ids)
    return g


class GrammarCalls:
    """The interface's functions over an InstanceHost's handle table (`host`: its _new, _get,
    handles and the epilogue registrations)."""

    def __init__(self, host, registered: type):
        self.host, self._registered = host, registered

    def functions(self) -> dict:
        h = self.host
        return {
            "compile": self.compile,
            "release-grammar": lambda g: self._release(g, Grammar, "grammar"),
            "create-matcher": lambda g: h._new(lambda: self._grammar(g).matcher()),
            "accept": lambda m, toks: self._m(m).accept(self._tokens(toks)),
            "validate": lambda m, toks: self._m(m).validate(self._tokens(toks)),
            "allowed": lambda m: self._m(m).bitmask().tolist(),
            "forced": lambda m: self._m(m).forced(),
            "rollback": lambda m, n: self._m(m).rollback(self._u32(n, "n")),
            "fork": lambda m: h._new(lambda: self._m(m).fork()),
            "state": self.state,
            "bind-matcher": self.bind,
            "release-matcher": lambda m: self._release(m, Matcher, "matcher"),
        }

    def compile(self, kind: str, source: str) -> int:
        if type(kind) is not str or type(source) is not str:
            raise InvalidArgument("compile takes a grammar kind and the source text")
        grammars = grammars_for(self.host.engine)
        return self.host._new(lambda: grammars.compile(kind, source))

    def state(self, m: int) -> Record:
        mm = self._m(m)
        rec = Record()
        rec.accepting, rec.stopped, rec.consumed = mm.accepting, mm.stopped, mm.consumed
        return rec

    def bind(self, e: int, name: str, m: int) -> None:
        reg = self.host._get(e, self._registered, "epilogue")
        self._m(m)
        if type(name) is not str or name not in reg.program.checked.matchers:
            raise InvalidArgument(f"the epilogue declares no matcher {name!r}")
        reg.matchers[name] = m

    def _grammar(self, g: int) -> Grammar:
        return self.host._get(g, Grammar, "grammar")

    def _m(self, m: int) -> Matcher:
        return self.host._get(m, Matcher, "matcher")

    def _release(self, h: int, kind: type, what: str) -> None:
        self.host._get(h, kind, what)
        del self.host.handles[h]

    @staticmethod
    def _u32(v, what: str) -> int:
        if type(v) is not int or not 0 <= v < 1 << 32:
            raise InvalidArgument(f"{what} must be a u32")
        return v

    def _tokens(self, toks) -> list[int]:
        V = self.host.engine.info.vocab_size
        if type(toks) is not list:
            raise InvalidArgument("tokens must be a list")
        bad = next((t for t in toks if type(t) is not int or not 0 <= t < V), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the vocabulary (0..{V - 1})")
        return toks
