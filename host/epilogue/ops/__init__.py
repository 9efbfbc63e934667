"""The op registry: every epilogue op declared once, in its family's module, with its arity,
attributes and defaults, type rule, torch implementation, host function, variants for host-held operands
and IR doc entry (spec.py says what each is). Validation, planning (plan.py) and the ops
section of wit/epilogue-ir.md all read OPS.

A new op is one `define(...)` in the module of its family, its reference test in
tests/test_epilogue_ops.py, `python -m host.epilogue.ops` to rewrite the document, and a
tracer method in inferlets/sdk/inferlet/trace.py if guests call it."""

# the families in the document's order (each module registers its ops on import)
from host.epilogue.ops import elementwise, construct, reduce, sampling, layout, speculative, lru, suffix, grammar, drafter, effects  # noqa: F401, I001
from host.epilogue.ops.spec import FAMILIES, OPS, Attr, OpSpec, Typing, check_attrs

__all__ = ["OPS", "FAMILIES", "Attr", "OpSpec", "Typing", "check_attrs"]
