"""What an op is: its declaration (OpSpec), its attributes (Attr), and the typing context its
type rule runs in (Typing). An op is declared once, with `define`, in its family's module."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from host.epilogue.ir import DTYPES, SYMBOLS, Dim, ProgramError, Value, dim_leq, parse_dim, short

REQUIRED = object()  # an attribute without a default
MAX_INT_ATTR = 1 << 32  # any int attribute: far past every real use, far from int64's end
MAX_STATIC_LEN = 1 << 16  # elements of a constant, cells of a pack or dyn_slice
MAX_CONST_RANK = 8
F32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Attr:
    """An attribute's JSON type, bounds and default. kind: 'int', 'int?' (int or null), 'num'
    (a finite number), 'dtype', 'dims' (a list of dims), 'dim', 'value' (a scalar or a nested
    list, checked against the op's dtype by its type rule), 'channel' (a channel's name), 'matcher'
    (a grammar matcher's name), 'drafter' (the name of a draft head attached to the model).
    default: a value, REQUIRED, or a function of the other attributes (already defaulted)."""

    kind: str
    default: object = REQUIRED
    lo: float | None = None
    hi: float | None = None


HOST, ARRAY, TENSOR = "h", "a", "t"  # the forms a value takes in a plan (see Variant)


@dataclass(frozen=True)
class Variant:
    """Another implementation of an op, for operands in other forms than tensors; the planner
    (plan.py) picks it, when a program is planned for a device and a batch size, where every
    operand can be had in the form it takes. Forms: HOST (one Python scalar per pass, as a list
    of B), ARRAY (a numpy array [B, ...] in host memory) and TENSOR (a torch tensor [B, ...]).

    fn(ctx, op, *args) -> the results in the forms of `gives` (a tuple when several); ctx is the
    implementations' Ctx where `ctx` is true, else None (making one costs more than a small op).
    host_memory: only where the host reads the device's memory (the CPU).
    when(values, op): a static condition on the op's types, if any.
    inline(op) -> the same as a Python expression over the operands {0}, {1}, ... for one pass
    (B = 1), or None: a plan writes it in place of the call (after a model call, every call
    frame costs several times what it costs warm)."""

    takes: tuple[str, ...]
    gives: tuple[str, ...]
    fn: Callable
    host_memory: bool = False
    when: Callable | None = None
    ctx: bool = True
    inline: Callable | None = None


@dataclass(frozen=True)
class OpSpec:
    """One op: arity, results, attributes, type rule, implementation(s) and its IR doc entry.

    infer(t, args, attrs) -> result Values: the type and shape rule (attrs are checked and
    defaulted; a rule may normalise them, e.g. an axis to non-negative).
    impl(ctx, op, tensors) -> result tensors: the torch implementation over batched values
    [B, ...] (None for effects, which the executor applies itself).
    host: the same op on Python ints and bools, for scalar integer results the host computes.
    inline: the Python expression a generated plan writes for it, over its operands {0}, {1}, ...
    (where it means the same as host on the op's operand types; a call costs more than the op).
    variants: faster implementations for operands the host holds (Variant)."""

    name: str
    family: str
    arity: tuple[int, ...]
    results: int
    attrs: dict[str, Attr]
    infer: Callable
    impl: Callable | None
    doc: str
    host: Callable | None = None
    inline: str | None = None
    variants: tuple[Variant, ...] = ()

    @property
    def effect(self) -> bool:
        return self.results == 0


OPS: dict[str, OpSpec] = {}
FAMILIES: dict[str, str] = {}  # family name -> its heading in the IR document, in document order


def family(name: str, heading: str) -> str:
    FAMILIES.setdefault(name, heading)
    return name


def define(name: str, family: str, *, args, results: int = 1, attrs: dict | None = None, infer: Callable,
           impl: Callable | None, doc: str, host: Callable | None = None, inline: str | None = None,
           variants: tuple[Variant, ...] = ()) -> OpSpec:
    if name in OPS:
        raise ValueError(f"op {name!r} is defined twice")
    spec = OpSpec(name, family, tuple(args) if isinstance(args, (tuple, list)) else (args,), results,
                  dict(attrs or {}), infer, impl, doc.strip(), host, inline, tuple(variants))
    OPS[name] = spec
    return spec


# --- attributes ---------------------------------------------------------------------------

def _is_int(v) -> bool:
    return type(v) is int  # not bool, not float


def _check_attr(where: str, key: str, a: Attr, v):
    def bad(what: str):
        raise ProgramError(f"{where}: attr '{key}' must be {what}, got {short(v)}")

    if a.kind in ("int", "int?"):
        if v is None and a.kind == "int?":
            return None
        if not _is_int(v):
            bad("an int" + (" or null" if a.kind == "int?" else ""))
        lo = -MAX_INT_ATTR if a.lo is None else a.lo
        hi = MAX_INT_ATTR if a.hi is None else a.hi
        if not lo <= v <= hi:
            raise ProgramError(f"{where}: attr '{key}'={v} out of range [{lo}, {hi}]")
        return v
    if a.kind == "num":
        if isinstance(v, bool) or not _f32(v):
            bad("a finite number")
        v = float(v)
        if a.lo is not None and v < a.lo or a.hi is not None and v > a.hi:
            raise ProgramError(f"{where}: attr '{key}'={v} out of range [{a.lo}, {a.hi}]")
        return v
    if a.kind == "dtype":
        if not isinstance(v, str) or v not in DTYPES:
            bad(f"one of {DTYPES}")
        return v
    if a.kind == "dim":
        return parse_dim(v, where)
    if a.kind == "dims":
        if not isinstance(v, list) or len(v) > MAX_CONST_RANK:
            bad(f"a list of at most {MAX_CONST_RANK} dims")
        return tuple(parse_dim(d, where) for d in v)
    if a.kind == "value":
        const_shape(where, v)  # rectangular, bounded; element types are the type rule's
        return v
    if a.kind in ("channel", "matcher", "drafter"):
        if not isinstance(v, str) or not v:
            bad(f"a {a.kind} name")
        return v
    raise AssertionError(a.kind)


def check_attrs(where: str, spec: OpSpec, raw: dict) -> dict:
    """The op's attributes: known keys only, each of its declared type and in bounds, defaults filled."""
    unknown = [k for k in raw if k not in spec.attrs]
    if unknown:
        known = ", ".join(spec.attrs) or "none"
        raise ProgramError(f"{where}: unknown attr {short(unknown[0])} (this op takes: {known})")
    out: dict = {}
    late = []
    for key, a in spec.attrs.items():
        if key in raw:
            out[key] = _check_attr(where, key, a, raw[key])
        elif a.default is REQUIRED:
            raise ProgramError(f"{where}: attr '{key}' is required")
        elif callable(a.default):
            late.append((key, a))
        else:
            out[key] = a.default
    for key, a in late:  # defaults computed from the other attributes
        out[key] = a.default(out)
    return out


def const_shape(where: str, v, depth: int = 0) -> tuple[list, tuple[int, ...]]:
    """Flatten a (possibly nested, rectangular) list constant; return elements and shape."""
    if not isinstance(v, list):
        return [v], ()
    if depth >= MAX_CONST_RANK:
        raise ProgramError(f"{where}: constant is nested deeper than {MAX_CONST_RANK}")
    if len(v) > MAX_STATIC_LEN:
        raise ProgramError(f"{where}: constant has more than {MAX_STATIC_LEN} elements")
    parts = [const_shape(where, x, depth + 1) for x in v]
    if any(s != parts[0][1] for _, s in parts):
        raise ProgramError(f"{where}: constant is not rectangular")
    inner = parts[0][1] if parts else ()
    flat = [x for f, _ in parts for x in f]
    if len(flat) > MAX_STATIC_LEN:
        raise ProgramError(f"{where}: constant has {len(flat)} elements; at most {MAX_STATIC_LEN}")
    return flat, (len(v),) + inner


_ELEMENT = {
    "bool": lambda x: isinstance(x, bool),
    "i64": lambda x: _is_int(x) and -(2**63) <= x < 2**63,
    "f32": lambda x: _f32(x),
}


def _f32(x) -> bool:
    """A number float32 holds: an int is compared exactly (math.isfinite(10**400) raises OverflowError)."""
    if _is_int(x):
        return abs(x) <= F32_MAX
    return isinstance(x, float) and math.isfinite(x) and abs(x) <= F32_MAX



# --- typing ---------------------------------------------------------------------------------

@dataclass
class Typing:
    """What a type rule sees besides its arguments: where it is (for messages), the program's
    fixed and aliased dims, and its channels."""

    where: str
    dims: dict  # symbol -> int (fixed) or symbol (alias)
    channels: dict = field(default_factory=dict)  # name -> ir.Channel
    matchers: tuple = ()  # the names of the grammar matchers the program declares
    drafters: set = field(default_factory=set)  # the draft heads the program's ops name (collected)

    def fail(self, msg: str):
        raise ProgramError(f"{self.where}: {msg}")

    def need(self, v: Value, *dts: str) -> None:
        if v.dtype not in dts:
            self.fail(f"wrong dtype {v.dtype}; expected {' or '.join(dts)}")

    def rank(self, v: Value, *rs: int) -> None:
        if len(v.shape) not in rs:
            self.fail(f"expected rank {' or '.join(map(str, rs))}, got {v}")

    def nonscalar(self, v: Value, what: str) -> None:
        if not v.shape:
            self.fail(f"{what} needs rank >= 1, got {v}")

    def axis(self, v: Value, attrs: dict) -> int:
        """attrs['axis'] for v, made non-negative (in attrs too: the implementations read it so)."""
        ax, r = attrs["axis"], len(v.shape)
        if not -r <= ax < r:
            self.fail(f"axis {ax} out of range for {v}")
        attrs["axis"] = ax % r
        return ax % r

    def subst(self, d: Dim) -> Dim:
        """Replace a fixed symbol by its int, an aliased symbol by its target (e.g. R -> W)."""
        if d.sym not in self.dims:
            return d
        v = self.dims[d.sym]
        return Dim(v, d.off) if isinstance(v, str) else Dim.of(v + d.off)

    def shape(self, dims: tuple[Dim, ...]) -> tuple[Dim, ...]:
        return tuple(self.subst(d) for d in dims)

    def channel(self, name) -> "object":
        if not isinstance(name, str) or name not in self.channels:
            self.fail(f"unknown channel {short(name)}; declare it in 'channels'")
        return self.channels[name]

    def matcher(self, name) -> str:
        if name not in self.matchers:
            self.fail(f"unknown matcher {short(name)}; declare it in 'matchers'")
        return name

    def drafter(self, name) -> str:
        """A draft head's name: whether the model has it is checked where the program meets a model."""
        self.drafters.add(name)
        return name

    def const(self, v, dtype: str) -> tuple[list, tuple[int, ...]]:
        flat, shape = const_shape(self.where, v)
        ok = _ELEMENT[dtype]
        for x in flat:
            if not ok(x):
                self.fail(f"constant {short(x)} is not a {dtype}" + (" (finite, within float32's range)" if dtype == "f32" else ""))
        return flat, shape

    def broadcast(self, a: Value, b: Value) -> tuple[Dim, ...]:
        n = max(len(a.shape), len(b.shape))
        sa = (Dim.of(1),) * (n - len(a.shape)) + a.shape
        sb = (Dim.of(1),) * (n - len(b.shape)) + b.shape
        out = []
        for x, y in zip(sa, sb):
            if x == y or y == Dim.of(1):
                out.append(x)
            elif x == Dim.of(1):
                out.append(y)
            else:
                self.fail(f"shape mismatch: {a} and {b} (declare dims in the program to mix symbolic and fixed sizes)")
        return tuple(out)


def max_bound(a: list[Dim], b: list[Dim]) -> list[Dim]:
    """Upper bounds of max(x, y) from bounds of x and of y."""
    out = []
    for x in a:
        for y in b:
            if dim_leq(x, y):
                out.append(y)
            elif dim_leq(y, x):
                out.append(x)
    return out


__all__ = ["Attr", "OpSpec", "Variant", "HOST", "ARRAY", "TENSOR", "OPS", "FAMILIES", "REQUIRED", "MAX_STATIC_LEN", "SYMBOLS", "Typing", "define", "family",
           "check_attrs", "const_shape", "max_bound"]
