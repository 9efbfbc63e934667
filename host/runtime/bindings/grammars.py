"""The WIT `grammars` interface: grammars and matchers as handles, on the model's one grammar
engine (host/runtime/grammars.py), and matchers bound to registered epilogues."""

from __future__ import annotations

from wasmtime.component import Record

from ...errors import InvalidArgument
from ...grammar import Grammar, Matcher
from ..grammars import grammars_for
from .core import Instance
from .forward import Registered
from .wit import record


class GrammarCalls:
    NAME = "grammars"

    def __init__(self, inst: Instance):
        self.inst = inst

    def functions(self) -> dict:
        inst = self.inst
        return {
            "compile": self.compile,
            "release-grammar": lambda g: inst._release(g, Grammar, "grammar"),
            "create-matcher": lambda g: inst._new(lambda: self._grammar(g).matcher()),
            "accept": lambda m, toks: self._m(m).accept(self._tokens(toks)),
            "validate": lambda m, toks: self._m(m).validate(self._tokens(toks)),
            "allowed": lambda m: self._m(m).bitmask().tolist(),
            "forced": lambda m: self._m(m).forced(),
            "rollback": lambda m, n: self._m(m).rollback(self._u32(n, "n")),
            "fork": lambda m: inst._new(lambda: self._m(m).fork()),
            "state": self.state,
            "bind-matcher": self.bind,
            "release-matcher": lambda m: inst._release(m, Matcher, "matcher"),
        }

    def compile(self, kind: str, source: str) -> int:
        if type(kind) is not str or type(source) is not str:
            raise InvalidArgument("compile takes a grammar kind and the source text")
        grammars = grammars_for(self.inst.engine)
        return self.inst._new(lambda: grammars.compile(kind, source))

    def state(self, m: int) -> Record:
        mm = self._m(m)
        return record(accepting=mm.accepting, stopped=mm.stopped, consumed=mm.consumed)

    def bind(self, e: int, name: str, m: int) -> None:
        reg = self.inst._get(e, Registered, "epilogue")
        self._m(m)
        if type(name) is not str or name not in reg.program.checked.matchers:
            raise InvalidArgument(f"the epilogue declares no matcher {name!r}")
        reg.matchers[name] = m

    def _grammar(self, g: int) -> Grammar:
        return self.inst._get(g, Grammar, "grammar")

    def _m(self, m: int) -> Matcher:
        return self.inst._get(m, Matcher, "matcher")

    @staticmethod
    def _u32(v, what: str) -> int:
        if type(v) is not int or not 0 <= v < 1 << 32:
            raise InvalidArgument(f"{what} must be a u32")
        return v

    def _tokens(self, toks) -> list[int]:
        V = self.inst.engine.info.vocab_size
        if type(toks) is not list:
            raise InvalidArgument("tokens must be a list")
        bad = next((t for t in toks if type(t) is not int or not 0 <= t < V), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the vocabulary (0..{V - 1})")
        return toks
