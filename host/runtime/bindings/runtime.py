"""The WIT `runtime` interface: arguments, the model's facts, output to the client."""

from __future__ import annotations

from wasmtime.component import Record

from ...errors import InvalidArgument
from .core import Instance
from .wit import list_of, record, string, u32


class RuntimeCalls:
    NAME = "runtime"

    def __init__(self, inst: Instance):
        self.inst = inst

    def functions(self) -> dict:
        return {
            "get-arguments": lambda: list(self.inst.args),
            "get-model-info": self.model_info,
            "send": lambda text: self.inst.send(string(text, "text")),
            "emit": lambda tokens: self.inst.emit(list_of(tokens, "tokens", u32)),
            "emit-channel": self.emit_channel,
        }

    def model_info(self) -> Record:
        info = self.inst.engine.info
        return record(name=info.name, vocab_size=info.vocab_size, eos_ids=list(info.eos_ids),
                      context_length=info.context_len, drafters=list(info.drafters))

    def emit_channel(self, h: int) -> None:
        ch = self.inst._ch(h)
        if ch.element not in ("uint32", "int32"):
            raise InvalidArgument(f"only a u32 or i32 channel holds token ids, not {ch.element}")
        # called by the compute thread after each round; a bad id (the epilogue wrote it) ends the loop, unrecorded
        ch.sink = self.inst.emit
