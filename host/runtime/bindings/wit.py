"""WIT values as the host sees them: what the interfaces declare (wit/inferlet.wit), checks of
the values wasmtime-py hands a host function, and the records a host function returns.

wasmtime-py lowers arguments by the types the component declared, which it does not compare
with ours (imports.check does, before a component runs): a host function sees whatever
Python values they give, so each argument is checked before it reaches the engine.
"""

from __future__ import annotations

from typing import Callable

from wasmtime.component import Record, Variant

from ...errors import InvalidArgument, PieError
from ..imports import PACKAGE as WIT_PACKAGE, VERSION, declared, error_codes

PACKAGE = f"{WIT_PACKAGE}/{{}}@{VERSION}"
_RESULTS = {f"{i}.{n}": r for i, funcs in declared().items() for n, (_, r) in funcs.items()}
# host functions whose WIT type has no result<_, error>: a PieError there ends the instance
NO_ERROR_RESULT = {n for n, r in _RESULTS.items() if r is None or r[0] != "result"}
# results whose ok and err payloads are both records: wasmtime-py lowers them to one Python
# class, so it needs an explicit Variant('ok'|'err', ...)
TAGGED = {n for n, r in _RESULTS.items() if r and r[0] == "result" and all(isinstance(x, tuple) and x[0] == "record"
                                                                             for x in r[1:])}
WIT_ERROR_CODES = set(error_codes())  # what a guest may be told; any other code reads "internal"

# a channel's element type -> the Python type of its cells, as wasmtime-py lifts them
CELL_TYPES = {"uint32": int, "int32": int, "float32": float, "boolean": bool}


def record(**fields) -> Record:
    rec = Record()
    for name, value in fields.items():
        setattr(rec, name.replace("_", "-"), value)
    return rec


def error_record(e: PieError) -> Record:
    code = e.code if e.code in WIT_ERROR_CODES else "internal"
    return record(code=code, message=str(e))


def _int(v, what: str, bits: int) -> int:
    if type(v) is not int or not 0 <= v < 1 << bits:
        raise InvalidArgument(f"{what} must be a u{bits}, not {show(v)}")
    return v


def u32(v, what: str) -> int:
    return _int(v, what, 32)


def u64(v, what: str) -> int:
    return _int(v, what, 64)


def f32(v, what: str) -> float:
    if type(v) is not float:
        raise InvalidArgument(f"{what} must be an f32, not {show(v)}")
    return v


def string(v, what: str) -> str:
    if type(v) is not str:
        raise InvalidArgument(f"{what} must be a string, not {show(v)}")
    return v


def list_of(v, what: str, check: Callable) -> list:
    if type(v) is not list:
        raise InvalidArgument(f"{what} must be a list, not {show(v)}")
    for x in v:
        check(x, f"an element of {what}")
    return v


def any_value(v, what: str):
    return v


def field(rec, name: str, what: str):
    if not isinstance(rec, Record) or not hasattr(rec, name):
        raise InvalidArgument(f"{what} must be a record with field {name!r}, not {show(rec)}")
    return getattr(rec, name)


def case(v, what: str, cases: tuple) -> Variant:
    if not isinstance(v, Variant) or v.tag not in cases:
        raise InvalidArgument(f"{what} must be one of the cases {', '.join(cases)}, not {show(v)}")
    return v


def show(v) -> str:
    return f"{type(v).__name__} {v!r}"[:80]
