"""The WIT `channels` interface: channels as handles, within the instance's cell budget."""

from __future__ import annotations

from wasmtime.component import Variant

from ...errors import InvalidArgument
from ..channels import Channel
from .core import Instance
from .wit import CELL_TYPES, case, list_of, show, string, u32


class ChannelCalls:
    NAME = "channels"

    def __init__(self, inst: Instance):
        self.inst = inst

    def functions(self) -> dict:
        ch = self.inst._ch
        return {
            "create": self.create,
            "put": self.put,
            "read": lambda h, s, n: self._cells(ch(h), ch(h).read(u32(s, "start"), u32(n, "count"))),
            "take": lambda h: self._cells(ch(h), ch(h).take()),
            "len": lambda h: len(ch(h)),
            "close": lambda h: ch(h).close(),
            "release": self.release,
        }

    def create(self, element: str, capacity: int) -> int:
        inst = self.inst
        string(element, "element")
        inst.check_cells(u32(capacity, "capacity"))
        h = inst._new(lambda: Channel(element, capacity, inst.engine.device))
        inst.cells += capacity
        return h

    def put(self, h: int, cells: Variant) -> None:
        ch = self.inst._ch(h)
        case(cells, "cells", tuple(CELL_TYPES))
        if cells.tag != ch.element:
            raise InvalidArgument(f"cells of type {cells.tag} put into a {ch.element} channel")
        cell = CELL_TYPES[ch.element]

        def check(v, what):
            if type(v) is not cell:
                raise InvalidArgument(f"{what} must be a {cell.__name__}, not {show(v)}")
        ch.put(list_of(cells.payload, "cells", check))

    @staticmethod
    def _cells(ch: Channel, values: list) -> Variant:
        return Variant(ch.element, values)

    def release(self, h: int) -> None:
        ch = self.inst._ch(h)
        ch.close()
        del self.inst.handles[h]
        self.inst.cells -= ch.capacity
