"""The epilogue program IR: JSON text, dtypes, symbolic dims, and the op table.

The full spec is wit/epilogue-ir.md; this module is its machine-readable half.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from host.errors import InvalidArgument

VERSION = 1
DTYPES = ("i64", "f32", "bool")
# Dims the host binds from the pass: readout rows, window, vocab, history, hidden, draft depth.
SYMBOLS = ("R", "W", "V", "N", "H", "K")
MAX_OPS = 4096


class ProgramError(InvalidArgument):
    """A malformed or ill-typed epilogue program."""


@dataclass(frozen=True)
class Dim:
    """A static dim: a known int (sym None) or a host-bound symbol plus an offset, e.g. W-1."""

    sym: str | None
    off: int

    @staticmethod
    def of(n: int) -> "Dim":
        return Dim(None, n)

    @property
    def known(self) -> bool:
        return self.sym is None

    def __add__(self, k: int) -> "Dim":
        return Dim(self.sym, self.off + k)

    def __str__(self) -> str:
        if self.sym is None:
            return str(self.off)
        return self.sym if self.off == 0 else f"{self.sym}{self.off:+d}"

    def resolve(self, bind: dict[str, int]) -> int:
        return self.off if self.sym is None else bind[self.sym] + self.off


_DIM_RE = re.compile(r"^([A-Z])([+-]\d+)?$")


def parse_dim(d, where: str) -> Dim:
    if isinstance(d, bool):
        raise ProgramError(f"{where}: dim {d!r} must be an int or a symbol like 'W' or 'W-1'")
    if isinstance(d, int):
        if d < 0:
            raise ProgramError(f"{where}: dim {d} is negative")
        return Dim.of(d)
    if isinstance(d, str):
        m = _DIM_RE.match(d)
        if m and m.group(1) in SYMBOLS:
            return Dim(m.group(1), int(m.group(2) or 0))
    raise ProgramError(f"{where}: dim {d!r} must be an int or one of {', '.join(SYMBOLS)} (optionally +/-int)")


def dim_leq(a: Dim, b: Dim) -> bool:
    """True when a <= b holds for every binding (symbols are >= 1)."""
    if a.known and b.known:
        return a.off <= b.off
    if a.sym == b.sym:
        return a.off <= b.off
    if a.known:
        return a.off <= 1 + b.off
    return False


# Input kinds -> (dtype, shape); channel inputs take dtype/shape from the channel's declaration.
INPUT_KINDS = {
    "logits": ("f32", ("R", "V")),
    "hidden": ("f32", ("R", "H")),
    "draft_logits": ("f32", ("R", "K", "V")),
    "window": ("i64", ("W",)),
    "history": ("i64", ("N",)),
    "round": ("i64", ()),
    "channel": None,
    "channel_len": ("i64", ()),
}

# op name -> (allowed argument counts, number of results)
UNARY = {"neg", "abs", "exp", "log", "not"}
BINARY = {"add", "sub", "mul", "div", "floordiv", "mod", "minimum", "maximum",
          "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor"}
REDUCE = {"sum", "prod", "min", "max", "argmax", "argmin", "any", "all"}
SCAN = {"cumsum", "cumprod"}
EFFECTS = {"put", "set", "fold", "stop"}

OPS: dict[str, tuple[tuple[int, ...], int]] = {
    **{n: ((1,), 1) for n in UNARY},
    **{n: ((2,), 1) for n in BINARY},
    **{n: ((1,), 1) for n in REDUCE},
    **{n: ((1,), 1) for n in SCAN},
    "where": ((3,), 1),
    "cast": ((1,), 1),
    "const": ((0,), 1),
    "full": ((0,), 1),
    "arange": ((0,), 1),
    "size": ((1,), 1),
    "softmax": ((1,), 1),
    "top_k": ((1,), 1),
    "top_p": ((1,), 1),
    "sample": ((1,), 1),
    "rand": ((0,), 1),
    "index": ((1,), 1),
    "slice": ((1,), 1),
    "take": ((2,), 1),
    "gather": ((2,), 1),
    "concat": ((2,), 1),
    "pack": ((4,), 1),
    "dyn_slice": ((3,), 1),
    "ngram_lookup": ((1, 2), 2),
    "verify_greedy": ((2,), 3),
    "verify_sample": ((2, 3), 3),
    "lru_lookup": ((3,), 2),
    "lru_update": ((5,), 2),
    "put": ((1, 2), 0),
    "set": ((1, 2), 0),
    "fold": ((1,), 0),
    "stop": ((1,), 0),
}


def parse(text: str) -> dict:
    """JSON text -> program object, with the top-level structure checked."""
    if not isinstance(text, str):
        raise ProgramError("epilogue program must be JSON text")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProgramError(f"epilogue program is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProgramError("epilogue program must be a JSON object")
    if obj.get("version") != VERSION:
        raise ProgramError(f"epilogue program version {obj.get('version')!r} is not supported; use {VERSION}")
    unknown = set(obj) - {"version", "dims", "channels", "inputs", "ops"}
    if unknown:
        raise ProgramError(f"epilogue program has unknown keys {sorted(unknown)}")
    for key, typ in (("dims", dict), ("channels", list), ("inputs", list), ("ops", list)):
        obj.setdefault(key, typ())
        if not isinstance(obj[key], typ):
            raise ProgramError(f"epilogue program '{key}' must be a JSON {typ.__name__.replace('dict', 'object').replace('list', 'array')}")
    if len(obj["ops"]) > MAX_OPS:
        raise ProgramError(f"epilogue program has {len(obj['ops'])} ops; at most {MAX_OPS} are allowed")
    return obj


def canonical(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def content_hash(obj: dict) -> str:
    return hashlib.sha256(canonical(obj).encode()).hexdigest()
