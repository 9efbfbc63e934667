"""The WIT `working-sets` interface: working sets as handles on the engine's."""

from __future__ import annotations

from .core import Instance
from .wit import u32


class WorkingSetCalls:
    NAME = "working-sets"

    def __init__(self, inst: Instance):
        self.inst = inst

    def functions(self) -> dict:
        inst, engine = self.inst, self.inst.engine
        return {
            "create": lambda: inst._new(inst.new_working_set),
            "create-uncached": lambda: inst._new(lambda: inst.new_working_set(cached=False)),
            "frozen-length": lambda ws: inst._ws(ws).frozen,
            "tokens": lambda ws: list(inst._ws(ws).tokens),
            "fork": lambda ws: inst._new(lambda: self.fork(ws)),
            "truncate": lambda ws, n: engine.truncate(inst._ws(ws), u32(n, "length")),
            "evict": lambda ws, s, e: engine.evict(inst._ws(ws), u32(s, "start"), u32(e, "end")),
            "commit": self.commit,
            "release": self.release,
        }

    def fork(self, h: int):
        ws = self.inst.engine.fork(self.inst._ws(h))
        self.inst.working_sets.append(ws)
        return ws

    def commit(self, h: int, rows: int) -> None:
        self.inst.engine.commit(self.inst._ws(h), u32(rows, "rows"))
        self.inst.draft_stats.accepted_rows(rows)

    def release(self, h: int) -> None:
        self.inst.engine.release(self.inst._ws(h))
        del self.inst.handles[h]
