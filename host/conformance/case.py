"""The case format: one TOML file per case under conformance/cases/ (its name is its path there,
without .toml). This module is the format's one definition.

    description = "one line"
    model = "tiny"             # the model the case runs on (host/conformance/models.py)
    needs = ["cuda"]           # capabilities; a host without one SKIPs the case
    covers = ["op:argmax"]     # coverage beyond what the steps show (ops the case checks)

    [[steps]]
    call = "channels.create"   # interface.function of wit/inferlet.wit
    args = ["uint32", 4]       # JSON-like; "$var" / "$var.field.0" is an earlier result
    as = "ch"                  # keep the result as $ch
    expect = {error = "invalid-argument", message = "capacity"}

`expect` is one of: absent or "ok" (the call succeeds), {ok = VALUE} (succeeds with exactly
VALUE), {same = "$var.path"} (succeeds with exactly an earlier step's result, or a part of it),
{error = CODE, message = TEXT} (fails with CODE; TEXT, optional, appears in the message),
{predicate = NAME, ...params} (host/conformance/predicates.py).
Arguments are WIT values as JSON: a record is a table of its fields (WIT names), a variant
{case = payload} or "case", an enum its case name, a handle an integer (or "$var"); a pass is
{ws, embed, window = len(tokens), fold = "all", readout = {rows = [], kind = "none"},
epilogue = {program, seed}} (conformance/components/probe/app.py turns them into bindings).
Arguments may use two static forms, expanded before the probe sees them:
{fill = X, count = N} is N copies of X, {json = TABLE} is TABLE as JSON text.

A case that runs several instances has [[instances]] tables instead of [[steps]]:

    [[instances]]
    name = "a"                 # its results are "$a/var.path" in later instances' arguments
    hold = true                # after its steps it stays alive until every later instance ends
    [[instances.steps]]        # as [[steps]] above
    ...
    [[instances]]
    name = "b"
    start = "with-previous"    # launched beside the one before (default "after-previous": once
                               # every earlier one has ended or, if it holds, reported its steps)

Each instance's steps are judged on its own outcomes. A held instance is cancelled by the runner
once the later ones have ended, so handles it reported are alive while they run. Instances
launched together wait for one wall-clock time the runner picks, so their passes share batches.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.imports import declared, error_codes
from .predicates import PREDICATES

ROOT = Path(__file__).resolve().parents[2] / "conformance"
CASES = ROOT / "cases"
CAPABILITIES = ("cuda", "mtp", "grammar")  # what a case may need; hosts report theirs
FUNCTIONS = {f"{i}.{f}" for i, fs in declared().items() for f in fs}
CODES = set(error_codes())
_CASE_KEYS = {"description", "model", "needs", "covers", "steps", "instances"}
_STEP_KEYS = {"call", "args", "as", "expect"}
_INSTANCE_KEYS = {"name", "hold", "start", "steps"}
STARTS = ("after-previous", "with-previous")


class CaseError(ValueError):
    """A case file that does not follow the format."""


@dataclass
class Step:
    call: str
    args: list
    expect: dict  # {"ok": ...} | {"ok-any": True} | {"same": "$var"} | {"error": code, "message": ...} | {"predicate": ...}
    bind: str | None = None

    def wire(self) -> dict:
        """What the probe gets for this step."""
        return {"call": self.call, "args": self.args, "as": self.bind}


@dataclass
class Instance:
    name: str
    steps: list[Step]
    hold: bool = False
    start: str = "after-previous"


@dataclass
class Case:
    name: str
    description: str
    instances: list[Instance]
    model: str = "tiny"
    needs: list[str] = field(default_factory=list)
    covers: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[Step]:
        """Every instance's steps, in order."""
        return [s for i in self.instances for s in i.steps]

    def coverage(self) -> set[str]:
        """Functions called, (function, error code) pairs and codes expected, plus `covers`."""
        out = set(self.covers)
        for s in self.steps:
            out.add(s.call)
            if "error" in s.expect:
                out |= {f"{s.call}:{s.expect['error']}", f"error:{s.expect['error']}"}
        return out


def _expand(v):
    if isinstance(v, dict) and set(v) == {"fill", "count"}:
        return [_expand(v["fill"])] * v["count"]
    if isinstance(v, dict) and set(v) == {"json"}:
        return json.dumps(v["json"])
    if isinstance(v, dict):
        return {k: _expand(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_expand(x) for x in v]
    return v


def _expect(raw, where: str) -> dict:
    if raw is None or raw == "ok":
        return {"ok-any": True}
    if not isinstance(raw, dict):
        raise CaseError(f"{where}: expect must be \"ok\" or a table")
    if "error" in raw:
        if raw["error"] not in CODES:
            raise CaseError(f"{where}: unknown error code {raw['error']!r}")
        if set(raw) - {"error", "message"}:
            raise CaseError(f"{where}: an error expectation takes only error and message")
    elif "predicate" in raw:
        if raw["predicate"] not in PREDICATES:
            raise CaseError(f"{where}: unknown predicate {raw['predicate']!r}; known: {', '.join(PREDICATES)}")
    elif set(raw) == {"same"}:
        if not str(raw["same"]).startswith("$"):
            raise CaseError(f"{where}: same takes \"$var\" or \"$var.path\"")
    elif set(raw) != {"ok"}:
        raise CaseError(f"{where}: expect takes ok, same, error or predicate")
    return _expand(raw)


def _steps(name: str, raws: list) -> list[Step]:
    steps = []
    for i, raw in enumerate(raws):
        where = f"{name}: step {i}"
        if set(raw) - _STEP_KEYS:
            raise CaseError(f"{where}: unknown key {sorted(set(raw) - _STEP_KEYS)[0]!r}")
        if raw.get("call") not in FUNCTIONS:
            raise CaseError(f"{where}: {raw.get('call')!r} is not a function of wit/inferlet.wit")
        steps.append(Step(raw["call"], _expand(list(raw.get("args", []))), _expect(raw.get("expect"), where),
                          raw.get("as")))
    if not steps:
        raise CaseError(f"{name}: no steps")
    return steps


def _instances(name: str, raws: list) -> list[Instance]:
    out = []
    for i, raw in enumerate(raws):
        where = f"{name}: instance {raw.get('name', i)}"
        if set(raw) - _INSTANCE_KEYS:
            raise CaseError(f"{where}: unknown key {sorted(set(raw) - _INSTANCE_KEYS)[0]!r}")
        inst = Instance(str(raw.get("name", f"i{i}")), _steps(where, raw.get("steps", [])), bool(raw.get("hold", False)),
                        raw.get("start", "after-previous"))
        if inst.start not in STARTS:
            raise CaseError(f"{where}: start must be one of {', '.join(STARTS)}")
        if inst.name in {o.name for o in out} or not inst.name.replace("-", "").isalnum():
            raise CaseError(f"{where}: an instance needs a unique name of letters, digits and dashes")
        for ref in _cross_refs([s.args for s in inst.steps] + [s.expect for s in inst.steps]):
            if ref.split("/", 1)[0][1:] not in {o.name for o in out}:
                raise CaseError(f"{where}: {ref} names no earlier instance")
        out.append(inst)
    if len(out) < 2:
        raise CaseError(f"{name}: [[instances]] needs two or more; one instance is [[steps]]")
    if out[-1].hold:
        raise CaseError(f"{name}: the last instance has no later one to hold for")
    return out


def _cross_refs(v) -> list[str]:
    """The "$instance/var.path" strings in v."""
    if isinstance(v, str):
        return [v] if v.startswith("$") and "/" in v else []
    if isinstance(v, dict):
        v = list(v.values())
    return [r for x in v for r in _cross_refs(x)] if isinstance(v, list) else []


def resolve_cross(v, env: dict):
    """v with each "$instance/var.path" replaced by that earlier instance's result (the runner
    does it before launch: the probe sees only values)."""
    if isinstance(v, str) and v.startswith("$") and "/" in v:
        return lookup(v, env)
    if isinstance(v, list):
        return [resolve_cross(x, env) for x in v]
    if isinstance(v, dict):
        return {k: resolve_cross(x, env) for k, x in v.items()}
    return v


def parse(name: str, data: dict) -> Case:
    unknown = set(data) - _CASE_KEYS
    if unknown:
        raise CaseError(f"{name}: unknown key {sorted(unknown)[0]!r}")
    needs = list(data.get("needs", []))
    bad = [n for n in needs if n not in CAPABILITIES]
    if bad:
        raise CaseError(f"{name}: unknown capability {bad[0]!r}; known: {', '.join(CAPABILITIES)}")
    if "steps" in data and "instances" in data:
        raise CaseError(f"{name}: a case has steps or instances, not both")
    if "instances" in data:
        instances = _instances(name, data["instances"])
    else:
        instances = [Instance("main", _steps(name, data.get("steps", [])))]
    if "description" not in data:
        raise CaseError(f"{name}: no description")
    return Case(name, data["description"], instances, data.get("model", "tiny"), needs, list(data.get("covers", [])))


def load(path: Path, root: Path = CASES) -> Case:
    name = path.relative_to(root).with_suffix("").as_posix()
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise CaseError(f"{name}: {e}") from None
    return parse(name, data)


def load_all(root: Path = CASES) -> list[Case]:
    return [load(p, root) for p in sorted(root.rglob("*.toml"))]


def lookup(ref: str, env: dict):
    """The value of "$var.path" among the results kept so far (as the probe resolves arguments);
    an earlier instance's results are in env as "instance/var"."""
    name, *path = ref[1:].split(".")
    if name not in env:
        raise KeyError(ref)
    x = env[name]
    for p in path:
        x = x[int(p)] if isinstance(x, list) else x[p]
    return x


def check(step: Step, outcome: dict | None, reference, env: dict) -> str | None:
    """None when the probe's outcome for `step` meets its expectation, else why not.
    env: the results of earlier steps, by their `as` name."""
    if outcome is None:
        return "no outcome (the run ended before this step)"
    if "unbound" in outcome:
        return f"{outcome['unbound']} is unbound (an earlier step failed)"
    want = step.expect
    if "error" in want:
        if "error" not in outcome:
            return f"expected error {want['error']}, got ok {json.dumps(outcome['ok'])[:200]}"
        if outcome["error"] != want["error"]:
            return f"expected error {want['error']}, got {outcome['error']}: {outcome['message']}"
        if want.get("message", "").lower() not in outcome["message"].lower():
            return f"expected the message to name {want['message']!r}, got {outcome['message']!r}"
        return None
    if "error" in outcome:
        return f"expected success, got {outcome['error']}: {outcome['message']}"
    if "ok" in want and outcome["ok"] != want["ok"]:
        return f"expected {json.dumps(want['ok'])[:200]}, got {json.dumps(outcome['ok'])[:200]}"
    if "same" in want:
        try:
            earlier = lookup(want["same"], env)
        except (KeyError, IndexError, TypeError):
            return f"{want['same']} is not an earlier result"
        if outcome["ok"] != earlier:
            return f"expected {want['same']} = {json.dumps(earlier)[:200]}, got {json.dumps(outcome['ok'])[:200]}"
    if "predicate" in want:
        params = {k: v for k, v in want.items() if k != "predicate"}
        return PREDICATES[want["predicate"]](outcome["ok"], params, reference)
    return None
