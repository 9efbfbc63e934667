"""The epilogue program IR: JSON text, dtypes, symbolic dims, and the typed program (values,
channels, inputs, ops). The ops themselves are declared in host/epilogue/ops/.

The full spec is wit/epilogue-ir.md; this module and the op registry are its machine-readable half.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from host.errors import InvalidArgument

VERSION = 1
DTYPES = ("i64", "f32", "bool")
# Dims the host binds from the pass: readout rows, window, vocab, history, hidden, draft depth.
SYMBOLS = ("R", "W", "V", "N", "H", "K")
MAX_OPS = 4096
MAX_CHANNEL_CAPACITY = 1 << 20  # cells of one channel (the runtime's channels and a program's declarations)
MAX_TEXT = 4 << 20  # characters of program JSON
MAX_DIM = 1 << 24  # any one static dim or symbol offset; the program's byte budget bounds products


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


_DIM_RE = re.compile(r"^([A-Z])([+-]\d{1,9})?$")


def parse_dim(d, where: str) -> Dim:
    if isinstance(d, bool):
        raise ProgramError(f"{where}: dim {d!r} must be an int or a symbol like 'W' or 'W-1'")
    if isinstance(d, int):
        if not 0 <= d <= MAX_DIM:
            raise ProgramError(f"{where}: dim {d} is out of range [0, {MAX_DIM}]")
        return Dim.of(d)
    if isinstance(d, str):
        m = _DIM_RE.fullmatch(d)
        if m and m.group(1) in SYMBOLS:
            off = int(m.group(2) or 0)
            if abs(off) > MAX_DIM:
                raise ProgramError(f"{where}: dim offset {off} is out of range [-{MAX_DIM}, {MAX_DIM}]")
            return Dim(m.group(1), off)
    raise ProgramError(f"{where}: dim {short(d)} must be an int or one of {', '.join(SYMBOLS)} (optionally +/-int)")


def dim_leq(a: Dim, b: Dim) -> bool:
    """True when a <= b holds for every binding (symbols are >= 1)."""
    if a.known and b.known:
        return a.off <= b.off
    if a.sym == b.sym:
        return a.off <= b.off
    if a.known:
        return a.off <= 1 + b.off
    return False


@dataclass
class Value:
    """The static type of an SSA value."""

    dtype: str
    shape: tuple[Dim, ...]
    # Candidate upper bounds on an integer value (any one suffices); used to prove fold <= W.
    ub: list[Dim] = field(default_factory=list)
    const: int | None = None  # the value of an i64 scalar constant

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass
class Channel:
    name: str
    dtype: str
    capacity: int


@dataclass
class Op:
    """A checked op: its attrs are the registry's, complete (defaults filled, axes non-negative)."""

    index: int
    name: str
    args: list[int]
    attrs: dict
    outs: list[int]


@dataclass
class Input:
    kind: str
    channel: str | None


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

def short(v) -> str:
    """repr(v), cut short: messages quote what a guest sent, which may be huge."""
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def parse(text: str) -> dict:
    """JSON text -> program object, with the top-level structure checked."""
    if not isinstance(text, str):
        raise ProgramError("epilogue program must be JSON text")
    if len(text) > MAX_TEXT:
        raise ProgramError(f"epilogue program is {len(text)} characters; at most {MAX_TEXT} are allowed")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProgramError(f"epilogue program is not valid JSON: {e}") from None
    except (ValueError, RecursionError) as e:  # integers past Python's digit limit; deep nesting
        raise ProgramError(f"epilogue program is not valid JSON: {short(str(e))}") from None
    if not isinstance(obj, dict):
        raise ProgramError("epilogue program must be a JSON object")
    version = obj.get("version")
    if type(version) is not int or version != VERSION:  # not true, not 1.0
        raise ProgramError(f"epilogue program version {short(version)} is not supported; use {VERSION}")
    unknown = set(obj) - {"version", "dims", "channels", "matchers", "inputs", "ops"}
    if unknown:
        raise ProgramError(f"epilogue program has unknown keys {short(sorted(unknown))}")
    for key, typ in (("dims", dict), ("channels", list), ("matchers", list), ("inputs", list), ("ops", list)):
        obj.setdefault(key, typ())
        if not isinstance(obj[key], typ):
            raise ProgramError(f"epilogue program '{key}' must be a JSON {typ.__name__.replace('dict', 'object').replace('list', 'array')}")
    if len(obj["ops"]) > MAX_OPS:
        raise ProgramError(f"epilogue program has {len(obj['ops'])} ops; at most {MAX_OPS} are allowed")
    return obj


def fields(where: str, entry, required: dict[str, type], optional: dict[str, type] | None = None) -> dict:
    """An object entry of the program (an op, input or channel) with exactly these keys and types."""
    optional = optional or {}
    if not isinstance(entry, dict):
        raise ProgramError(f"{where}: must be a JSON object")
    for k in entry:
        if k not in required and k not in optional:
            raise ProgramError(f"{where}: unknown key {short(k)}")
    for k, typ in {**required, **optional}.items():
        if k not in entry:
            if k in required:
                raise ProgramError(f"{where}: missing '{k}'")
            continue
        v = entry[k]
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise ProgramError(f"{where}: '{k}' must be a JSON {_JSON_NAME.get(typ, typ.__name__)}, got {short(v)}")
    return entry


_JSON_NAME = {str: "string", int: "integer", list: "array", dict: "object"}


def canonical(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def content_hash(obj: dict) -> str:
    return hashlib.sha256(canonical(obj).encode()).hexdigest()
