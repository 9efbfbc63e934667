"""Binds the WIT imports of the pie:inferlet world to the engine, for one inferlet instance.

One module per WIT interface (runtime, tokenizer, working_sets, channels, forward, grammars)
converts the interface's values, calls the engine or the runtime, and lets its PieErrors reach
the guest as WIT errors; the instance under them all (handles, budgets, output, the call
wrapper) is core.Instance, and wit.py has what the interfaces declare and the value checks.
"""

from __future__ import annotations

from wasmtime.component import Linker

from .. import imports
from .channels import ChannelCalls
from .core import EPOCH_SLICE, Instance
from .forward import ForwardCalls, Registered
from .grammars import GrammarCalls
from .runtime import RuntimeCalls
from .tokenizer import TokenizerCalls
from .wit import CELL_TYPES, NO_ERROR_RESULT, PACKAGE, TAGGED, WIT_ERROR_CODES, error_record
from .working_sets import WorkingSetCalls

INTERFACES = (RuntimeCalls, TokenizerCalls, WorkingSetCalls, ChannelCalls, ForwardCalls, GrammarCalls)


class InstanceHost(Instance):
    """An instance with every interface: `calls[name]` is the WIT interface `name`'s."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calls = {cls.NAME: cls(self) for cls in INTERFACES}

    def functions(self) -> dict[str, dict]:
        """The WIT imports this host implements, by interface and name."""
        return {name: calls.functions() for name, calls in self.calls.items()}

    def link(self, linker: Linker) -> None:
        package = f"{imports.PACKAGE}/{{}}@{imports.VERSION}"
        with linker.root() as root:
            for iface, funcs in self.functions().items():
                with root.add_instance(package.format(iface)) as i:
                    for name, fn in funcs.items():
                        i.add_func(name, self._host(f"{iface}.{name}", fn, tagged=f"{iface}.{name}" in TAGGED))


__all__ = ["CELL_TYPES", "EPOCH_SLICE", "INTERFACES", "ChannelCalls", "ForwardCalls", "GrammarCalls", "Instance",
           "InstanceHost", "NO_ERROR_RESULT", "PACKAGE", "Registered", "RuntimeCalls", "TAGGED", "TokenizerCalls",
           "WIT_ERROR_CODES", "WorkingSetCalls", "error_record"]
