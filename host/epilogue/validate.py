"""Type and shape checking of an epilogue program: the host is the authority.

Every error names the op index and op name (or the input or channel index) so a guest
author can find the line that traced it. The ops' own rules are in host/epilogue/ops/.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from host.epilogue.ir import INPUT_KINDS, MAX_CHANNEL_CAPACITY, SYMBOLS, Channel, Dim, Input, Op, ProgramError, Value, fields, short
from host.epilogue.ops import OPS, Typing, check_attrs
from host.epilogue.ops.spec import MAX_INT_ATTR

# Host or device memory one pass of a program may hold in op results (its intermediates, not the
# pass's own readout): checked at registration for the dims known then (symbols at their least),
# and again for each new binding of the symbols before a pass runs.
MAX_PROGRAM_BYTES = 256 << 20
ITEMSIZE = {"i64": 8, "f32": 4, "bool": 1}


@dataclass
class Checked:
    dims: dict[str, int]  # symbols fixed to ints
    alias: dict[str, str]  # symbols declared equal to another symbol (e.g. R == W); bound per pass
    channels: dict[str, Channel]
    matchers: tuple[str, ...]  # grammar matchers, bound by name per pass (Env.matchers)
    drafters: tuple[str, ...]  # draft heads the ops name, bound per pass by the host (Env.drafters)
    inputs: list[Input]
    values: list[Value]
    ops: list[Op]


def _fail(where: str, msg: str):
    raise ProgramError(f"{where}: {msg}")


def _parse_dims(raw: dict) -> tuple[dict[str, int], dict[str, str]]:
    """'dims' maps a symbol to a positive int, or to another symbol it always equals
    ({"R": "W"}: readout on every row, with a window that changes size per round)."""
    fixed: dict[str, int] = {}
    alias: dict[str, str] = {}
    for k, v in raw.items():
        if k not in SYMBOLS:
            _fail("dims", f"{short(k)} is not a symbol in {SYMBOLS}")
        if isinstance(v, str):
            if v not in SYMBOLS or v == k:
                _fail("dims", f"'{k}': {short(v)} must be another symbol in {SYMBOLS}")
            alias[k] = v
        elif type(v) is not int or not 1 <= v <= MAX_CHANNEL_CAPACITY:
            _fail("dims", f"'{k}': {short(v)} must be an int in [1, {MAX_CHANNEL_CAPACITY}] or another symbol in {SYMBOLS}")
        else:
            fixed[k] = v
    for k, v in alias.items():
        if v in alias:
            _fail("dims", f"'{k}' aliases '{v}', which is itself an alias; name the final symbol")
        if v in fixed and k in fixed and fixed[k] != fixed[v]:
            _fail("dims", f"'{k}' = '{v}' but they are fixed to different ints")
    return fixed, alias


def _channels(raw: list) -> dict[str, Channel]:
    channels: dict[str, Channel] = {}
    for i, c in enumerate(raw):
        where = f"channel {i}"
        fields(where, c, {"name": str, "dtype": str, "capacity": int})
        name, dt, cap = c["name"], c["dtype"], c["capacity"]
        if not name:
            _fail(where, "'name' must not be empty")
        if name in channels:
            _fail(where, f"channel {short(name)} declared twice")
        if dt not in ("i64", "f32", "bool"):
            _fail(where, f"'dtype' must be one of i64, f32, bool, got {short(dt)}")
        if not 1 <= cap <= MAX_CHANNEL_CAPACITY:
            _fail(where, f"'capacity' {cap} out of range [1, {MAX_CHANNEL_CAPACITY}]")
        channels[name] = Channel(name, dt, cap)
    return channels


def _matchers(raw: list) -> tuple[str, ...]:
    """'matchers': the names of the grammar matchers the program's grammar ops use."""
    names: list[str] = []
    for i, m in enumerate(raw):
        if not isinstance(m, str) or not m:
            _fail(f"matcher {i}", f"must be a non-empty name, got {short(m)}")
        if m in names:
            _fail(f"matcher {i}", f"matcher {short(m)} declared twice")
        names.append(m)
    return tuple(names)


def check(obj: dict) -> Checked:
    fixed, alias = _parse_dims(obj["dims"])
    # What shapes are written in: an alias of a fixed symbol is that int, else its target symbol.
    dims: dict[str, int | str] = {**fixed, **{k: fixed.get(v, v) for k, v in alias.items()}}
    channels = _channels(obj["channels"])
    matchers = _matchers(obj["matchers"])
    typing = Typing("", dims, channels, matchers)

    values: list[Value] = []
    inputs: list[Input] = []
    for i, inp in enumerate(obj["inputs"]):
        typing.where = where = f"input {i}"
        fields(where, inp, {"kind": str}, {"name": str})
        kind = inp["kind"]
        if kind not in INPUT_KINDS:
            _fail(where, f"unknown input kind {short(kind)}; expected one of {sorted(INPUT_KINDS)}")
        chan = None
        if kind in ("channel", "channel_len"):
            ch = typing.channel(inp.get("name"))
            chan = ch.name
            values.append(Value(ch.dtype, (Dim.of(ch.capacity),)) if kind == "channel"
                          else Value("i64", (), [Dim.of(ch.capacity)]))
        else:
            if "name" in inp:
                _fail(where, f"a '{kind}' input takes no 'name'")
            dt, shape = INPUT_KINDS[kind]
            values.append(Value(dt, typing.shape(tuple(Dim(s, 0) for s in shape))))
        inputs.append(Input(kind, chan))

    ops: list[Op] = []
    effects_seen: set = set()
    for i, raw in enumerate(obj["ops"]):
        where = f"op {i}"
        fields(where, raw, {"op": str}, {"args": list, "attrs": dict})
        name = raw["op"]
        spec = OPS.get(name)
        if spec is None:
            _fail(where, f"unknown op {short(name)}")
        typing.where = where = f"op {i} ({name})"
        args = raw.get("args", [])
        if not all(type(a) is int for a in args):
            _fail(where, "'args' must be a list of value indices")
        if len(args) not in spec.arity:
            _fail(where, f"takes {' or '.join(map(str, spec.arity))} args, got {len(args)}")
        for a in args:
            if a < 0 or a > MAX_INT_ATTR:
                _fail(where, f"arg {a} is not a value index")
            if a >= len(values):
                _fail(where, f"arg {a} refers to a value not yet defined (forward reference or cycle)")
        attrs = check_attrs(where, spec, raw.get("attrs", {}))
        res = spec.infer(typing, [values[a] for a in args], attrs)
        if spec.effect:
            key = ("channel", attrs["channel"]) if "channel" in attrs else name
            if key in effects_seen:
                what = f"channel {attrs['channel']!r}" if "channel" in attrs else name
                _fail(where, f"{what} is written twice")
            effects_seen.add(key)
        outs = list(range(len(values), len(values) + spec.results))
        values.extend(res)
        ops.append(Op(i, name, list(args), attrs, outs))
    checked = Checked(fixed, alias, channels, matchers, tuple(sorted(typing.drafters)), inputs, values, ops)
    Budget(checked).check(None)
    return checked


class Budget:
    """The bytes of one pass's op results: a fixed part and terms that grow with the symbols."""

    def __init__(self, checked: Checked):
        self.fixed = 0
        self.terms: list[tuple[int, tuple[Dim, ...], int]] = []  # (itemsize, shape, op index)
        for op in checked.ops:
            for o in op.outs:
                v = checked.values[o]
                if any(d.sym is not None for d in v.shape):
                    self.terms.append((ITEMSIZE[v.dtype], v.shape, op.index))
                else:
                    self.fixed += ITEMSIZE[v.dtype] * math.prod(d.off for d in v.shape)
        self.ops = checked.ops

    def check(self, bind: dict[str, int] | None) -> None:
        """Raise if the results would take more than MAX_PROGRAM_BYTES. bind None: at registration,
        each symbol at its least (1), so what is rejected then is rejected for every pass."""
        total, at = self.fixed, None
        for size, shape, index in self.terms:
            if total > MAX_PROGRAM_BYTES:
                break
            at = index
            for d in shape:
                size *= max((d.off if d.sym is None else (bind or {}).get(d.sym, 1) + d.off), 0)
            total += size
        if total > MAX_PROGRAM_BYTES:
            when = "" if bind is None else f" for this pass ({', '.join(f'{k}={v}' for k, v in sorted(bind.items()))})"
            where = "" if at is None else f"by op {at} ({self.ops[at].name}), "
            raise ProgramError(f"the program's values take more than {MAX_PROGRAM_BYTES >> 20} MiB {where}"
                               f"at {total} bytes{when}")
