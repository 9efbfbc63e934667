"""Type and shape checking of an epilogue program: the host is the authority.

Every error names the op index and op name (or the input index) so a guest
author can find the line that traced it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from host.epilogue.ir import (BINARY, DTYPES, EFFECTS, INPUT_KINDS, OPS, REDUCE, SCAN, SYMBOLS, UNARY, Dim,
                              ProgramError, dim_leq, parse_dim)

MAX_CHANNEL_CAPACITY = 1 << 20
MAX_STATIC_LEN = 1 << 16


@dataclass
class Value:
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
    index: int
    name: str
    args: list[int]
    attrs: dict
    outs: list[int]


@dataclass
class Input:
    kind: str
    channel: str | None


@dataclass
class Checked:
    dims: dict[str, int]  # symbols fixed to ints
    alias: dict[str, str]  # symbols declared equal to another symbol (e.g. R == W); bound per pass
    channels: dict[str, Channel]
    inputs: list[Input]
    values: list[Value]
    ops: list[Op]


def _fail(where: str, msg: str):
    raise ProgramError(f"{where}: {msg}")


def _subst(d: Dim, dims: dict[str, int | str]) -> Dim:
    """Replace a fixed symbol by its int, an aliased symbol by its target (e.g. R -> W)."""
    if d.sym not in dims:
        return d
    v = dims[d.sym]
    return Dim(v, d.off) if isinstance(v, str) else Dim.of(v + d.off)


def _parse_dims(raw: dict) -> tuple[dict[str, int], dict[str, str]]:
    """'dims' maps a symbol to a positive int, or to another symbol it always equals
    ({"R": "W"}: readout on every row, with a window that changes size per round)."""
    fixed: dict[str, int] = {}
    alias: dict[str, str] = {}
    for k, v in raw.items():
        if k not in SYMBOLS:
            _fail("dims", f"'{k}' is not a symbol in {SYMBOLS}")
        if isinstance(v, str):
            if v not in SYMBOLS or v == k:
                _fail("dims", f"'{k}': {v!r} must be another symbol in {SYMBOLS}")
            alias[k] = v
        elif isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_CHANNEL_CAPACITY:
            _fail("dims", f"'{k}': {v!r} must be a positive int or another symbol in {SYMBOLS}")
        else:
            fixed[k] = v
    for k, v in alias.items():
        if v in alias:
            _fail("dims", f"'{k}' aliases '{v}', which is itself an alias; name the final symbol")
        if v in fixed and k in fixed and fixed[k] != fixed[v]:
            _fail("dims", f"'{k}' = '{v}' but they are fixed to different ints")
    return fixed, alias


def _int_attr(where, attrs, key, default=None, lo=None, hi=None):
    v = attrs.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, int):
        _fail(where, f"attr '{key}' must be an int, got {v!r}")
    if lo is not None and v < lo or hi is not None and v > hi:
        _fail(where, f"attr '{key}'={v} out of range [{lo}, {hi}]")
    return v


def _num_attr(where, attrs, key, default=None):
    v = attrs.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        _fail(where, f"attr '{key}' must be a finite number, got {v!r}")
    return float(v)


def _dtype_attr(where, attrs, key="dtype"):
    v = attrs.get(key)
    if v not in DTYPES:
        _fail(where, f"attr '{key}' must be one of {DTYPES}, got {v!r}")
    return v


def _axis(where, v: Value, attrs, default=-1):
    ax = _int_attr(where, attrs, "axis", default)
    r = len(v.shape)
    if not -r <= ax < r:
        _fail(where, f"axis {ax} out of range for {v}")
    return ax % r


def _broadcast(where, a: Value, b: Value) -> tuple[Dim, ...]:
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
            _fail(where, f"shape mismatch: {a} and {b} (declare dims in the program to mix symbolic and fixed sizes)")
    return tuple(out)


def _max_bound(a: list[Dim], b: list[Dim]) -> list[Dim]:
    out = []
    for x in a:
        for y in b:
            if dim_leq(x, y):
                out.append(y)
            elif dim_leq(y, x):
                out.append(x)
    return out


def _const_shape(where, v) -> tuple[list, tuple[int, ...]]:
    """Flatten a (possibly nested, rectangular) list constant; return elements and shape."""
    if not isinstance(v, list):
        return [v], ()
    parts = [_const_shape(where, x) for x in v]
    if any(s != parts[0][1] for _, s in parts):
        _fail(where, "constant is not rectangular")
    inner = parts[0][1] if parts else ()
    return [x for f, _ in parts for x in f], (len(v),) + inner


def _const_value(where, attrs, dtype):
    v = attrs.get("value")
    flat, _ = _const_shape(where, v)
    if len(flat) > MAX_STATIC_LEN:
        _fail(where, f"constant has {len(flat)} elements; at most {MAX_STATIC_LEN}")
    for x in flat:
        ok = {"bool": lambda x: isinstance(x, bool),
              "i64": lambda x: isinstance(x, int) and not isinstance(x, bool) and -(2**63) <= x < 2**63,
              "f32": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)}[dtype](x)
        if not ok:
            _fail(where, f"constant {x!r} is not a {dtype}")
    return v


def _shape_attr(where, attrs, dims):
    s = attrs.get("shape")
    if not isinstance(s, list):
        _fail(where, "attr 'shape' must be a list of dims")
    return tuple(_subst(parse_dim(d, where), dims) for d in s)


def check(obj: dict) -> Checked:
    fixed, alias = _parse_dims(obj["dims"])
    # What shapes are written in: an alias of a fixed symbol is that int, else its target symbol.
    dims: dict[str, int | str] = {**fixed, **{k: fixed.get(v, v) for k, v in alias.items()}}

    channels: dict[str, Channel] = {}
    for i, c in enumerate(obj["channels"]):
        where = f"channel {i}"
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
            _fail(where, "must be an object with a non-empty 'name'")
        if c["name"] in channels:
            _fail(where, f"channel '{c['name']}' declared twice")
        dt = _dtype_attr(where, c)
        cap = _int_attr(where, c, "capacity", None, 1, MAX_CHANNEL_CAPACITY)
        channels[c["name"]] = Channel(c["name"], dt, cap)

    def channel_of(where, name) -> Channel:
        if name not in channels:
            _fail(where, f"unknown channel {name!r}; declare it in 'channels'")
        return channels[name]

    values: list[Value] = []
    inputs: list[Input] = []
    for i, inp in enumerate(obj["inputs"]):
        where = f"input {i}"
        kind = inp.get("kind") if isinstance(inp, dict) else None
        if kind not in INPUT_KINDS:
            _fail(where, f"unknown input kind {kind!r}; expected one of {sorted(INPUT_KINDS)}")
        chan = None
        if kind in ("channel", "channel_len"):
            ch = channel_of(where, inp.get("name"))
            chan = ch.name
            if kind == "channel":
                values.append(Value(ch.dtype, (Dim.of(ch.capacity),)))
            else:
                values.append(Value("i64", (), [Dim.of(ch.capacity)]))
        else:
            dt, shape = INPUT_KINDS[kind]
            values.append(Value(dt, tuple(_subst(Dim(s, 0), dims) for s in shape)))
        inputs.append(Input(kind, chan))

    ops: list[Op] = []
    effects_seen: set = set()
    for i, raw in enumerate(obj["ops"]):
        name = raw.get("op") if isinstance(raw, dict) else None
        where = f"op {i} ({name})"
        if name not in OPS:
            _fail(f"op {i}", f"unknown op {name!r}")
        args = raw.get("args", [])
        attrs = raw.get("attrs", {})
        if not isinstance(args, list) or not all(isinstance(a, int) and not isinstance(a, bool) for a in args):
            _fail(where, "'args' must be a list of value indices")
        if not isinstance(attrs, dict):
            _fail(where, "'attrs' must be an object")
        counts, nres = OPS[name]
        if len(args) not in counts:
            _fail(where, f"takes {' or '.join(map(str, counts))} args, got {len(args)}")
        for a in args:
            if a < 0:
                _fail(where, f"arg {a} is not a value index")
            if a >= len(values):
                _fail(where, f"arg {a} refers to a value not yet defined (forward reference or cycle)")
        av = [values[a] for a in args]
        res = _infer(where, name, av, attrs, dims, channel_of)
        if name in EFFECTS:
            key = ("channel", attrs.get("channel")) if name in ("put", "set") else name
            if key in effects_seen:
                _fail(where, f"{'channel ' + repr(attrs.get('channel')) if name in ('put', 'set') else name} is written twice")
            effects_seen.add(key)
        outs = list(range(len(values), len(values) + nres))
        values.extend(res)
        ops.append(Op(i, name, list(args), dict(attrs), outs))
    return Checked(fixed, alias, channels, inputs, values, ops)


def _infer(where, name, av: list[Value], attrs, dims, channel_of) -> list[Value]:
    def need(v: Value, *dts):
        if v.dtype not in dts:
            _fail(where, f"wrong dtype {v.dtype}; expected {' or '.join(dts)}")

    def rank(v: Value, *rs):
        if len(v.shape) not in rs:
            _fail(where, f"expected rank {' or '.join(map(str, rs))}, got {v}")

    if name in UNARY:
        (x,) = av
        if name == "not":
            need(x, "bool")
            return [Value("bool", x.shape)]
        need(x, "f32") if name in ("exp", "log") else need(x, "i64", "f32")
        return [Value(x.dtype, x.shape, x.ub if name == "abs" else [])]

    if name in BINARY:
        a, b = av
        if a.dtype != b.dtype:
            _fail(where, f"wrong dtype: {a.dtype} and {b.dtype} differ (cast one)")
        shape = _broadcast(where, a, b)
        if name in ("and", "or", "xor"):
            need(a, "bool")
            return [Value("bool", shape)]
        if name in ("eq", "ne"):
            return [Value("bool", shape)]
        if name in ("lt", "le", "gt", "ge"):
            need(a, "i64", "f32")
            return [Value("bool", shape)]
        need(a, "i64", "f32")
        if name in ("floordiv", "mod"):
            need(a, "i64")
        if name == "div":
            need(a, "f32")
        ub: list[Dim] = []
        if name == "add":
            ub = [x + y.off for x in a.ub for y in b.ub if y.known] + [y + x.off for x in a.ub for y in b.ub if x.known and not y.known]
        elif name == "minimum":
            ub = a.ub + b.ub
        elif name == "maximum":
            ub = _max_bound(a.ub, b.ub)
        elif name == "sub" and b.const is not None:
            ub = [x + (-b.const) for x in a.ub]
        return [Value(a.dtype, shape, ub)]

    if name == "where":
        c, a, b = av
        need(c, "bool")
        if a.dtype != b.dtype:
            _fail(where, f"wrong dtype: branches {a.dtype} and {b.dtype} differ")
        s = _broadcast(where, Value(a.dtype, _broadcast(where, c, a)), b)
        return [Value(a.dtype, s, _max_bound(a.ub, b.ub))]

    if name == "cast":
        (x,) = av
        dt = _dtype_attr(where, attrs)
        ub = [Dim.of(1)] if x.dtype == "bool" else (x.ub if dt == "i64" else [])
        return [Value(dt, x.shape, ub)]

    if name == "const":
        dt = _dtype_attr(where, attrs)
        v = _const_value(where, attrs, dt)
        flat, shp = _const_shape(where, v)
        shape = tuple(Dim.of(n) for n in shp)
        ub = [Dim.of(max(flat))] if dt == "i64" and flat else []
        return [Value(dt, shape, ub, v if dt == "i64" and not isinstance(v, list) else None)]

    if name == "full":
        dt = _dtype_attr(where, attrs)
        shape = _shape_attr(where, attrs, dims)
        v = _const_value(where, attrs, dt)
        if isinstance(v, list):
            _fail(where, "attr 'value' must be a scalar")
        return [Value(dt, shape, [Dim.of(v)] if dt == "i64" else [])]

    if name == "arange":
        n = _subst(parse_dim(attrs.get("n"), where), dims)
        start = _int_attr(where, attrs, "start", 0)
        return [Value("i64", (n,), [n + (start - 1)])]

    if name == "size":
        (x,) = av
        ax = _axis(where, x, attrs, 0)
        d = x.shape[ax]
        return [Value("i64", (), [d])]

    if name in REDUCE:
        (x,) = av
        if not x.shape:
            _fail(where, f"cannot reduce a scalar {x}")
        ax = _axis(where, x, attrs)
        shape = x.shape[:ax] + x.shape[ax + 1:]
        if name in ("any", "all"):
            need(x, "bool")
            return [Value("bool", shape)]
        if name in ("argmax", "argmin"):
            need(x, "i64", "f32")
            return [Value("i64", shape, [x.shape[ax] + -1])]
        if name == "sum":
            need(x, "i64", "f32", "bool")
            if x.dtype == "bool":
                return [Value("i64", shape, [x.shape[ax]])]
            return [Value(x.dtype, shape)]
        need(x, "i64", "f32")
        return [Value(x.dtype, shape, x.ub if name in ("min", "max") else [])]

    if name in SCAN:
        (x,) = av
        if not x.shape:
            _fail(where, f"cannot scan a scalar {x}")
        _axis(where, x, attrs)
        need(x, "i64", "f32", "bool")
        dt = "i64" if x.dtype == "bool" else x.dtype
        ub = [Dim.of(1)] if name == "cumprod" and x.dtype == "bool" else ([x.shape[_axis(where, x, attrs)]] if x.dtype == "bool" else [])
        return [Value(dt, x.shape, ub)]

    if name == "softmax":
        (x,) = av
        need(x, "f32")
        if not x.shape:
            _fail(where, "softmax needs rank >= 1")
        _axis(where, x, attrs)
        if _num_attr(where, attrs, "temperature", 1.0) <= 0:
            _fail(where, "temperature must be > 0 (use argmax for greedy)")
        return [Value("f32", x.shape)]

    if name in ("top_k", "top_p"):
        (x,) = av
        need(x, "f32")
        if not x.shape:
            _fail(where, f"{name} needs rank >= 1")
        if name == "top_k":
            _int_attr(where, attrs, "k", None, 1)
        else:
            p = _num_attr(where, attrs, "p")
            if not 0 < p <= 1:
                _fail(where, f"top_p p={p} must be in (0, 1]")
        return [Value("f32", x.shape)]

    if name == "sample":
        (x,) = av
        need(x, "f32")
        if not x.shape:
            _fail(where, "sample needs rank >= 1 (weights over the last axis)")
        _int_attr(where, attrs, "seed", 0)
        return [Value("i64", x.shape[:-1], [x.shape[-1] + -1])]

    if name == "rand":
        _int_attr(where, attrs, "seed", 0)
        return [Value("f32", _shape_attr(where, attrs, dims))]

    if name == "index":
        (x,) = av
        if not x.shape:
            _fail(where, "cannot index a scalar")
        ax = _axis(where, x, attrs, 0)
        i = _int_attr(where, attrs, "i")
        d = x.shape[ax]
        if d.known and not -d.off <= i < d.off:  # symbolic dims are checked when the pass binds them
            _fail(where, f"index {i} out of range for dim {d}")
        return [Value(x.dtype, x.shape[:ax] + x.shape[ax + 1:], x.ub)]

    if name == "slice":
        (x,) = av
        if not x.shape:
            _fail(where, "cannot slice a scalar")
        ax = _axis(where, x, attrs, 0)
        d = x.shape[ax]
        start = attrs.get("start")
        stop = attrs.get("stop")
        for k, v in (("start", start), ("stop", stop)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                _fail(where, f"attr '{k}' must be an int or null")
        n = _slice_len(where, d, start, stop)
        return [Value(x.dtype, x.shape[:ax] + (n,) + x.shape[ax + 1:], x.ub)]

    if name == "take":
        x, idx = av
        need(idx, "i64")
        if not x.shape:
            _fail(where, "cannot take from a scalar")
        _fill(where, attrs, x.dtype)
        return [Value(x.dtype, idx.shape + x.shape[1:], x.ub)]

    if name == "gather":
        x, idx = av
        need(idx, "i64")
        if len(x.shape) != len(idx.shape) or not x.shape or x.shape[:-1] != idx.shape[:-1]:
            _fail(where, f"shape mismatch: gather needs equal leading dims, got {x} and {idx}")
        _fill(where, attrs, x.dtype)
        return [Value(x.dtype, idx.shape, x.ub)]

    if name == "concat":
        a, b = av
        if a.dtype != b.dtype:
            _fail(where, f"wrong dtype: {a.dtype} and {b.dtype} differ")
        if len(a.shape) != len(b.shape) or not a.shape:
            _fail(where, f"shape mismatch: {a} and {b}")
        ax = _axis(where, a, attrs, 0)
        for k, (x, y) in enumerate(zip(a.shape, b.shape)):
            if k != ax and x != y:
                _fail(where, f"shape mismatch: {a} and {b}")
        da, db = a.shape[ax], b.shape[ax]
        if da.known:
            n = db + da.off
        elif db.known:
            n = da + db.off
        else:
            _fail(where, f"shape mismatch: cannot concatenate two symbolic dims {da} and {db}")
        return [Value(a.dtype, a.shape[:ax] + (n,) + a.shape[ax + 1:], _max_bound(a.ub, b.ub))]

    if name == "pack":
        a, alen, b, blen = av
        if a.dtype != b.dtype:
            _fail(where, f"wrong dtype: {a.dtype} and {b.dtype} differ")
        rank(a, 1), rank(b, 1)
        for ln in (alen, blen):
            need(ln, "i64"), rank(ln, 0)
        size = _int_attr(where, attrs, "size", None, 0, MAX_STATIC_LEN)
        _fill(where, attrs, a.dtype)
        return [Value(a.dtype, (Dim.of(size),), _max_bound(a.ub, b.ub))]

    if name == "dyn_slice":
        x, start, length = av
        rank(x, 1)
        for s in (start, length):
            need(s, "i64"), rank(s, 0)
        size = _int_attr(where, attrs, "size", None, 0, MAX_STATIC_LEN)
        _fill(where, attrs, x.dtype)
        return [Value(x.dtype, (Dim.of(size),), x.ub)]

    if name == "ngram_lookup":
        seq = av[0]
        need(seq, "i64"), rank(seq, 1)
        if len(av) == 2:
            need(av[1], "i64"), rank(av[1], 0)
        lo = _int_attr(where, attrs, "ngram_min", 1, 1, 64)
        _int_attr(where, attrs, "ngram_max", max(lo, 3), lo, 64)  # validated; the kernel reads it
        k = _int_attr(where, attrs, "k", None, 1, 1024)
        return [Value("i64", (Dim.of(k),), seq.ub), Value("i64", (), [Dim.of(k)])]

    if name in ("lru_lookup", "lru_update"):
        return _infer_lru(where, name, av, attrs, need, rank)

    if name in ("verify_greedy", "verify_sample"):
        drafts = av[0]
        need(drafts, "i64"), rank(drafts, 1)
        k = drafts.shape[0]
        if name == "verify_greedy":
            target = av[1]
            need(target, "i64"), rank(target, 1)
            if target.shape[0] != k + 1:
                _fail(where, f"shape mismatch: target {target} must have one more row than drafts {drafts}")
            vocab_ub = _max_bound(drafts.ub, target.ub)
        else:
            p = av[1]
            need(p, "f32"), rank(p, 2)
            if p.shape[0] != k + 1:
                _fail(where, f"shape mismatch: p {p} must have one more row than drafts {drafts}")
            if len(av) == 3:
                q = av[2]
                need(q, "f32"), rank(q, 2)
                if q.shape != (k, p.shape[1]):
                    _fail(where, f"shape mismatch: q {q} must be [{k}, {p.shape[1]}]")
            _int_attr(where, attrs, "seed", 0)
            vocab_ub = [p.shape[1] + -1]
        return [Value("i64", (), [k]), Value("i64", (k + 1,), vocab_ub), Value("i64", (), [k + 1])]

    if name in ("put", "set"):
        ch = channel_of(where, attrs.get("channel"))
        vals = av[0]
        rank(vals, 1)
        if vals.dtype != ch.dtype:
            _fail(where, f"wrong dtype: {vals.dtype} written to {ch.dtype} channel {ch.name!r}")
        if len(av) == 2:
            need(av[1], "i64"), rank(av[1], 0)
        if name == "set" and vals.shape[0].known and vals.shape[0].off > ch.capacity:
            _fail(where, f"{vals} does not fit channel {ch.name!r} of capacity {ch.capacity}")
        return []

    if name == "fold":
        (x,) = av
        need(x, "i64"), rank(x, 0)
        w = _subst(Dim("W", 0), dims)
        if not any(dim_leq(b, w) for b in x.ub):
            bounds = ", ".join(map(str, x.ub)) or "unbounded"
            _fail(where, f"fold is not provably <= window {w} (bounds: {bounds}); use minimum(fold, size(window))")
        return []

    if name == "stop":
        (x,) = av
        need(x, "bool"), rank(x, 0)
        return []

    _fail(where, "op has no type rule")  # unreachable: every op in OPS has a rule


def _infer_lru(where, name, av: list[Value], attrs, need, rank) -> list[Value]:
    """The LRU n-gram table: `table` i64 [S*(g+k)] (row s = leader[g] then followers[k],
    padded with -1) and `stamps` i64 [S] (last-used order, -1 = empty slot)."""
    table, stamps = av[0], av[1]
    g = _int_attr(where, attrs, "g", None, 1, 64)
    k = _int_attr(where, attrs, "k", None, 1, 1024)
    for v in av:
        need(v, "i64")
    rank(table, 1), rank(stamps, 1)
    S, T = stamps.shape[0], table.shape[0]
    if not (S.known and T.known) or T.off != S.off * (g + k):
        _fail(where, f"shape mismatch: table {table} must be [S*(g+k)] = [{S}*{g + k}] for stamps {stamps}")
    if name == "lru_lookup":
        key = av[2]
        rank(key, 1)
        if key.shape[0] != Dim.of(g):
            _fail(where, f"shape mismatch: key {key} must be [{g}] (attr g)")
        return [Value("i64", (Dim.of(k),), table.ub), Value("i64", (), [Dim.of(k)])]
    seq, length, leaders = av[2], av[3], av[4]
    rank(seq, 1), rank(length, 0), rank(leaders, 0)
    n = seq.shape[0]
    if not n.known or n.off > 1024:
        _fail(where, f"seq {seq} must have a static length <= 1024 (the update compares every pair of positions)")
    return [Value("i64", table.shape), Value("i64", stamps.shape)]


def _fill(where, attrs, dtype):
    if "fill" in attrs:
        _const_value(where, {"value": attrs["fill"]}, dtype)


def _slice_len(where, d: Dim, start, stop) -> Dim:
    start = 0 if start is None else start
    if d.known:
        return Dim.of(len(range(d.off)[slice(start, stop)]))
    # Symbolic dim: support the common forms x[a:], x[:-b], x[-a:], x[a:-b] (assuming they fit).
    if stop is None and start >= 0:
        return d + (-start)
    if stop is None and start < 0:
        return Dim.of(-start)
    if start >= 0 and stop is not None and stop < 0:
        return d + (stop - start)
    if start >= 0 and stop is not None and stop >= 0:
        return Dim.of(stop - start)
    _fail(where, f"slice [{start}:{stop}] of symbolic dim {d} is not supported")
