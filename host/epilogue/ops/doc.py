"""The ops section of wit/epilogue-ir.md, written from the registry."""

from __future__ import annotations

from pathlib import Path

from host.epilogue.ops.spec import FAMILIES, MAX_INT_ATTR, OPS, REQUIRED, Attr, OpSpec

BEGIN = "<!-- ops: written by `python -m host.epilogue.ops` from host/epilogue/ops/; do not edit by hand -->"
END = "<!-- ops: end -->"
DOC = Path(__file__).resolve().parents[3] / "wit" / "epilogue-ir.md"


_KIND = {"int": "int", "int?": "int or null", "num": "number", "dtype": "dtype", "dims": "list of dims",
         "dim": "dim", "value": "scalar or nested list", "channel": "channel name",
         "matcher": "matcher name", "drafter": "drafter name"}


def _attr(name: str, a: Attr) -> str:
    s = f"`{name}` {_KIND[a.kind]}"
    if a.kind in ("int", "int?") and (a.lo is not None or a.hi is not None):
        lo = -MAX_INT_ATTR if a.lo is None else a.lo
        hi = MAX_INT_ATTR if a.hi is None else a.hi
        s += f" in [{lo}, {hi}]"
    if a.default is REQUIRED:
        return s + ", required"
    if callable(a.default):
        return s + ", default computed (see above)"
    return s + ("" if a.default is None else f", default {a.default!r}")


def entry(spec: OpSpec) -> str:
    """An op's entry: its doc, then its attributes as the registry declares them."""
    text = spec.doc
    if spec.attrs:
        text += " Attrs: " + "; ".join(_attr(k, a) for k, a in spec.attrs.items()) + "."
    return text


def render() -> str:
    parts = []
    for fam, heading in FAMILIES.items():
        parts.append(heading)
        for spec in OPS.values():
            if spec.family == fam:
                body = entry(spec).replace("\n", "\n  ")
                parts.append(f"- {body}")
        parts.append("")
    return "\n".join(parts)


def rewrite(text: str) -> str:
    """text with the part between the markers replaced by render()."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"the markers {BEGIN!r} and {END!r} are missing")
    return f"{head}{BEGIN}\n\n{render()}{END}{tail}"


def main() -> None:
    DOC.write_text(rewrite(DOC.read_text()))
    print(f"wrote {len(OPS)} ops to {DOC}")
