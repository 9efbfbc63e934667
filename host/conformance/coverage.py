"""What the suite must cover, and what its cases do cover.

Required: every function of wit/inferlet.wit (`iface.func`), every error code a function's
doc comment names after "Errors:" (`iface.func:code`), every error code (`error:code`) and
every epilogue op (`op:name`). A case covers the functions its steps call, the (function,
code) pairs and codes its steps expect, and the ops it names in `covers` (which must appear
in a program it registers). conformance/known-gaps.txt lists what is not covered yet.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..epilogue.ops import OPS
from ..runtime.imports import WIT, declared, error_codes
from .case import ROOT, Case

GAPS = ROOT / "known-gaps.txt"


def documented_errors(text: str | None = None) -> dict[str, list[str]]:
    """`iface.func` -> the error codes its doc comment names after "Errors:"."""
    text = WIT.read_text() if text is None else text
    codes = error_codes()
    out: dict[str, list[str]] = {}
    iface, doc = "", []
    for line in text.splitlines():
        s = line.strip()
        if m := re.match(r"interface\s+([\w-]+)", s):
            iface, doc = m.group(1), []
        elif s.startswith("///"):
            doc.append(s[3:].strip())
        elif m := re.match(r"([\w-]+):\s*func\b", s):
            errors = " ".join(doc).partition("Errors:")[2]
            out[f"{iface}.{m.group(1)}"] = [c for c in codes if re.search(rf"(?<![\w-]){c}(?![\w-])", errors)]
            doc = []
        else:
            doc = []
    return out


def required() -> set[str]:
    funcs = {f"{i}.{f}" for i, fs in declared().items() for f in fs}
    docs = documented_errors()
    if set(docs) != funcs:  # the comment parser and the WIT parser must see the same functions
        raise ValueError(f"doc comments found for {sorted(set(docs) ^ funcs)} differ from the declared functions")
    return (funcs | {f"{f}:{c}" for f, cs in docs.items() for c in cs} | {f"error:{c}" for c in error_codes()}
            | {f"op:{name}" for name in OPS})


def registered_ops(c: Case) -> set[str]:
    ops = set()
    for s in c.steps:
        if s.call == "forward.register-epilogue" and s.args and isinstance(s.args[0], str):
            try:
                ops |= {op.get("op") for op in json.loads(s.args[0]).get("ops", [])}
            except (ValueError, AttributeError):
                pass  # a malformed program: the case is about its refusal
    return ops


def covered(cases: list[Case]) -> set[str]:
    """What the cases cover; raises ValueError for a case claiming an op it never registers."""
    out = set()
    for c in cases:
        claimed = {x.removeprefix("op:") for x in c.covers if x.startswith("op:")}
        missing = claimed - registered_ops(c)
        if missing:
            raise ValueError(f"{c.name} covers op {sorted(missing)[0]} but registers no program using it")
        out |= c.coverage()
    return out


def read_gaps(path: Path = GAPS) -> set[str]:
    return {ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()} - {""}


def check(cases: list[Case], gaps: set[str]) -> list[str]:
    """Problems: required items neither covered nor listed, listed items now covered, and
    listed or claimed items that are not required (a typo or a removed function)."""
    req, cov = required(), covered(cases)
    problems = [f"not covered and not in known-gaps.txt: {x}" for x in sorted(req - cov - gaps)]
    problems += [f"covered now, remove it from known-gaps.txt: {x}" for x in sorted(gaps & cov)]
    problems += [f"in known-gaps.txt but not required: {x}" for x in sorted(gaps - req)]
    problems += [f"covered by a case but not required: {x}" for x in sorted(cov - req)]
    return problems


def summary(cases: list[Case]) -> dict[str, tuple[int, int]]:
    """Per kind (functions, documented errors, error codes, ops): (covered, required)."""
    req, cov = required(), covered(cases)
    kinds = {"functions": lambda x: ":" not in x, "documented errors": lambda x: ":" in x and "." in x.split(":")[0],
             "error codes": lambda x: x.startswith("error:"), "ops": lambda x: x.startswith("op:")}
    return {k: (len({x for x in req & cov if f(x)}), len({x for x in req if f(x)})) for k, f in kinds.items()}
