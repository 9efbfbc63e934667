"""Checks a component's pie:inferlet imports against wit/inferlet.wit before it runs.

wasmtime-py links a Python host function to an import of any type and lowers arguments by
the type the component declared, so a component built against another version of the
interface would reach the host with values of other types. This reads the WIT (the subset
inferlet.wit uses) and compares it with the component's import types, function by function,
after checking the package version each import names against wit/VERSIONING.md's rule.

Why a parser rather than wasmtime-py's type reflection (Component.type, used below on the
guest's component): a component built from wit/ reflects the same declarations (functions,
param and result types, the error enum's cases), but the host needs them when it is imported
(bindings' NO_ERROR_RESULT and TAGGED, the conformance coverage) and before the first check,
and such a component costs a componentize-py build (~29 s, 18 MB) and a compile (~26 s) before
its type can be read, or a binary kept beside wit/ that could drift from it; parsing this
file takes ~2 ms (2-core CPU; a cached compiled component: 4 ms to load, 10 ms to reflect).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from wasmtime.component import (ComponentInstanceType, EnumType, FuncType, ListType, OptionType, RecordType,
                                ResultType, TupleType, VariantType)

from .errors import InferletError

WIT = Path(__file__).resolve().parents[2] / "wit" / "inferlet.wit"
PACKAGE, VERSION = re.search(r"^package\s+([\w:-]+)@([\w.-]+);", WIT.read_text(), re.M).groups()


def parse_version(v: str) -> tuple[int, int, int] | None:
    """MAJOR.MINOR.PATCH as ints, or None for anything else (a pre-release or build suffix included)."""
    m = re.fullmatch(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)", v)
    return None if m is None else tuple(map(int, m.groups()))


if parse_version(VERSION) is None:  # the rule below compares numbers; a host must have them
    raise ValueError(f"{WIT.name}: package version {VERSION!r} is not MAJOR.MINOR.PATCH (wit/VERSIONING.md)")

# A type is a string (a primitive) or a tuple: ("list", t), ("option", t), ("result", ok, err),
# ("tuple", ts), ("record", ((name, t), ...)), ("variant", ((name, t or None), ...)), ("enum", names).
_TOKEN = re.compile(r"\s*(->|[A-Za-z_%][\w-]*|[{}()<>,;:.=@/*]|\d+(?:\.\d+)*)")
_PRIMS = {"bool", "s8", "s16", "s32", "s64", "u8", "u16", "u32", "u64", "f32", "f64", "char", "string"}


@functools.lru_cache(maxsize=1)
def _wit() -> tuple[dict, dict]:
    return _parse(WIT.read_text())


def declared() -> dict[str, dict[str, tuple]]:
    """interface -> function -> (param types, result type or None), from wit/inferlet.wit."""
    return _wit()[1]


def error_codes() -> tuple[str, ...]:
    """The cases of the WIT's `error-code` enum: the codes a host function may return."""
    kind, names = _wit()[0]["types"]["error-code"]
    return names


def incompatibility(built: str, host: str) -> str | None:
    """Why a component built against pie:inferlet@`built` cannot run on a host implementing
    @`host`, or None when it can (wit/VERSIONING.md): the same track (the major version; the
    minor one while the major is 0; the exact version while both are 0) and not newer."""
    b, h = parse_version(built), parse_version(host)
    if b is None:
        return f"{built!r} is not a MAJOR.MINOR.PATCH version"
    if b == h:
        return None
    track = 1 if h[0] else 2 if h[1] else 3  # how many leading numbers must be equal
    if b[:track] != h[:track]:
        kind = ("major", "minor", "patch")[min(i for i in range(track) if b[i] != h[i])]
        return f"another {kind} version may change what existing functions take and return"
    if b > h:
        return "it is newer, and may import what this host lacks"
    return None


def _parse(text: str) -> dict:
    text = re.sub(r"//[^\n]*", "", text)
    toks = [m.group(1) for m in _TOKEN.finditer(text)]
    pos = 0

    def take(want: str | None = None) -> str:
        nonlocal pos
        t = toks[pos]
        if want is not None and t != want:
            raise ValueError(f"{WIT.name}: expected {want!r}, found {t!r}")
        pos += 1
        return t

    named: dict[str, dict] = {}  # interface -> type name -> type
    funcs: dict[str, dict] = {}
    iface = ""

    def ty():
        t = take()
        if t in _PRIMS:
            return t
        if t in ("list", "option"):
            take("<")
            inner = ty()
            take(">")
            return (t, inner)
        if t == "tuple":
            take("<")
            items = [ty()]
            while take() == ",":
                items.append(ty())
            return ("tuple", tuple(items))
        if t == "result":
            if toks[pos] != "<":
                return ("result", None, None)
            take("<")
            ok = err = None
            if toks[pos] == "_":
                take()
            else:
                ok = ty()
            if take() == ",":  # else it was the closing ">"
                err = ty()
                take(">")
            return ("result", ok, err)
        return named[iface][t.lstrip("%")]

    def body(item) -> tuple:
        take("{")
        out = []
        while toks[pos] != "}":
            out.append(item())
            if toks[pos] == ",":
                take(",")
        take("}")
        return tuple(out)

    while pos < len(toks):
        t = take()
        if t == "package":
            while take() != ";":
                pass
        elif t == "interface":
            iface = take()
            named[iface], funcs[iface] = {}, {}
            take("{")
        elif t == "world":  # the last item: imports are checked per interface
            break
        elif t == "}":
            iface = ""
        elif t == "use":
            src = take()
            take(".")
            for name in body(take):
                named[iface][name] = named[src][name]
            take(";")
        elif t == "type":
            name = take()
            take("=")
            named[iface][name] = ty()
            take(";")
        elif t == "record":
            name = take()

            def field():
                f = take()
                take(":")
                return (f, ty())
            named[iface][name] = ("record", body(field))
        elif t == "enum":
            name = take()
            named[iface][name] = ("enum", body(take))
        elif t == "variant":
            name = take()

            def case():
                c = take()
                if toks[pos] != "(":
                    return (c, None)
                take("(")
                payload = ty()
                take(")")
                return (c, payload)
            named[iface][name] = ("variant", body(case))
        else:  # name: func(params) [-> result];
            take(":")
            take("func")
            take("(")
            params = []
            while toks[pos] != ")":
                take()
                take(":")
                params.append(ty())
                if toks[pos] == ",":
                    take(",")
            take(")")
            result = None
            if toks[pos] == "->":
                take("->")
                result = ty()
            take(";")
            funcs[iface][t] = (tuple(params), result)
    return named, funcs


def _of(v) -> object:
    """A wasmtime-py component value type in the form above."""
    if isinstance(v, ListType):
        return ("list", _of(v.element))
    if isinstance(v, OptionType):
        return ("option", _of(v.payload))
    if isinstance(v, ResultType):
        return ("result", None if v.ok is None else _of(v.ok), None if v.err is None else _of(v.err))
    if isinstance(v, TupleType):
        return ("tuple", tuple(_of(e) for e in v.elements))
    if isinstance(v, RecordType):
        return ("record", tuple((n, _of(t)) for n, t in v.fields))
    if isinstance(v, VariantType):
        return ("variant", tuple((n, None if t is None else _of(t)) for n, t in v.cases))
    if isinstance(v, EnumType):
        return ("enum", tuple(v.names))
    return type(v).__name__.lower()  # Bool, U32, String, ... (another kind shows as its class)


def check(component, engine) -> None:
    """Raise InferletError naming the first import that is neither WASI nor pie:inferlet, or the first
    pie:inferlet import whose type differs from the WIT's, or a missing `run` export."""
    want = declared()
    prefix = PACKAGE + "/"
    ctype = component.type
    found = ctype.imports(engine)
    check_names(found)
    for name, ext in found.items():
        if not name.startswith(prefix):
            continue  # WASI
        iface = name[len(prefix):].partition("@")[0]
        inst = ext.ty
        if not isinstance(inst, ComponentInstanceType):
            raise InferletError(f"the component imports {name} as something other than an interface")
        for fname, f in inst.exports(engine).items():
            ft = f.ty
            decl = want[iface].get(fname)
            if decl is None and not isinstance(ft, FuncType):
                continue  # a type (types.error, ...): checked where a function uses it
            if decl is None:
                raise InferletError(f"the component imports {iface}.{fname}, which {PACKAGE}@{VERSION} does not declare")
            got = (tuple(_of(t) for _, t in ft.params), None if ft.result is None else _of(ft.result)) \
                if isinstance(ft, FuncType) else None
            if got != decl:
                raise InferletError(f"the component imports {iface}.{fname} with another type than "
                                    f"{PACKAGE}@{VERSION} declares: {_show_func(got)} instead of {_show_func(decl)}")
    if "run" not in ctype.exports(engine):
        raise InferletError(f"the component exports no `run` function: it was not built against the "
                            f"{PACKAGE}@{VERSION} world")


def _show_func(f) -> str:
    if f is None:
        return "not a function"
    params, result = f
    return f"func({', '.join(map(_show, params))})" + ("" if result is None else f" -> {_show(result)}")


def _show(t) -> str:
    if isinstance(t, str):
        return t
    kind = t[0]
    if kind in ("list", "option"):
        return f"{kind}<{_show(t[1])}>"
    if kind == "result":
        return f"result<{'_' if t[1] is None else _show(t[1])}, {'_' if t[2] is None else _show(t[2])}>"
    if kind == "tuple":
        return f"tuple<{', '.join(map(_show, t[1]))}>"
    return kind  # a record, variant or enum: its name is not part of the type


def check_names(names) -> None:
    """The part of `check` that needs only the import names: another world, another version."""
    prefix = PACKAGE + "/"
    want = declared()
    for name in names:
        if name.startswith("wasi:"):
            continue  # the linker adds WASI 0.2 and refuses what it lacks
        if not name.startswith(prefix):  # another world: refused here, not at every launch
            raise InferletError(f"the component was not built against the {PACKAGE}@{VERSION} world: it imports "
                                f"{name}, which this host does not provide")
        iface, _, version = name[len(prefix):].partition("@")
        if not version:
            raise InferletError(f"the component imports {name} without a version; this host implements "
                                f"{PACKAGE}@{VERSION}")
        why = incompatibility(version, VERSION)
        if why is not None:
            raise InferletError(f"the component was built against {PACKAGE}@{version}, which this host's "
                                f"{PACKAGE}@{VERSION} cannot run: {why} (wit/VERSIONING.md)")
        if iface not in want:
            raise InferletError(f"the component imports {name}, which {PACKAGE}@{VERSION} does not declare")
