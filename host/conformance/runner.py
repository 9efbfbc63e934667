"""Runs cases on a host: one probe instance per case (or per [[instances]] table), each step's
outcome judged here.

Prints one line per case (PASS, FAIL, SKIP) and the closing summary (SUMMARY). A failure of a
case named in the expect-fail list is reported as expected and does not fail the run.
"""

from __future__ import annotations

import fnmatch
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, TextIO

from . import case as fmt
from .adapter import HostAdapter

SUMMARY = "{passed} passed, {failed} failed, {skipped} skipped"  # the closing line's one definition
CASE_TIMEOUT_S = 60.0
START_LEAD_S = 0.3  # per instance launched together: time to launch it before they all start
MARK = "@probe "  # the probe's outcome lines start with it (conformance/components/probe/app.py)


@dataclass
class Outcome:
    name: str
    status: str  # PASS | FAIL | SKIP
    reason: str = ""
    expected_failure: bool = False
    seconds: float = 0.0


@dataclass
class Report:
    outcomes: list[Outcome]

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def unexpected_failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "FAIL" and not o.expected_failure]

    def summary(self) -> str:
        return SUMMARY.format(passed=self.count("PASS"), failed=self.count("FAIL"), skipped=self.count("SKIP"))

    def to_json(self, host: str) -> dict:
        return {"host": host, "cases": [asdict(o) for o in self.outcomes],
                "summary": {"passed": self.count("PASS"), "failed": self.count("FAIL"),
                            "skipped": self.count("SKIP")}}


def select(cases: list[fmt.Case], pattern: str | None) -> list[fmt.Case]:
    """Cases whose name matches the glob `pattern`, or contains it when it has no wildcard."""
    if not pattern:
        return cases
    glob = any(c in pattern for c in "*?[")
    return [c for c in cases if (fnmatch.fnmatchcase(c.name, pattern) if glob else pattern in c.name)]


def read_expect_fail(path: Path, known: set[str]) -> set[str]:
    """Case names, one a line (`#` starts a comment); an unknown name is an error, not a silent pass."""
    names = {ln.split("#", 1)[0].strip() for ln in Path(path).read_text().splitlines()} - {""}
    unknown = sorted(names - known)
    if unknown:
        raise fmt.CaseError(f"{path}: no such case: {', '.join(unknown)}")
    return names


def judge(c: fmt.Case | fmt.Instance, outcomes: list[dict], run_error: str | None, reference,
          env: dict | None = None) -> str | None:
    """Why the outcomes of one instance (a single-instance case's, or one of a case's instances)
    fail its steps, or None. env: earlier instances' results, as "instance/var"."""
    by_step = {o.get("step"): o for o in outcomes}
    env = dict(env or {})
    for i, step in enumerate(c.steps):
        try:
            why = fmt.check(step, by_step.get(i), reference, env)
        except Exception as e:  # a result of an unexpected shape: this case fails, the run goes on
            why = f"the check could not read the result: {type(e).__name__}: {e}"
        if why is not None:
            tail = f" (the run failed: {run_error})" if run_error and i not in by_step else ""
            return f"step {i} ({step.call}): {why}{tail}"
        if step.bind and "ok" in by_step[i]:
            env[step.bind] = by_step[i]["ok"]
    if run_error:
        return f"the run failed after its steps: {run_error}"
    return None


def _outcomes(text: str) -> list[dict]:
    """The probe's outcome lines (JSONDecodeError if one is not JSON)."""
    return [json.loads(ln[len(MARK):]) for ln in text.splitlines() if ln.startswith(MARK)]


def _held(text: str) -> bool:
    return any(o.get("held") for o in _outcomes(text))


def _bound(inst: fmt.Instance, outcomes: list[dict]) -> dict:
    """The results an instance kept, named "instance/var" for the instances after it."""
    by_step = {o.get("step"): o for o in outcomes}
    return {f"{inst.name}/{s.bind}": by_step[i]["ok"] for i, s in enumerate(inst.steps)
            if s.bind and "ok" in by_step.get(i, {})}


def _run_instances(c: fmt.Case, adapter: HostAdapter) -> list[tuple[fmt.Instance, str, str | None]]:
    """Launch the case's instances as their `start` and `hold` say; each one's (instance, text,
    run error). A held instance that reported its steps is cancelled at the end, without error."""
    launched: list = []  # [instance, what launch returned, text once settled, run error]
    env: dict = {}

    def settle(entry) -> None:
        inst, run = entry[0], entry[1]
        if inst.hold:
            entry[2] = adapter.sent(run, _held, CASE_TIMEOUT_S)
        else:
            got = adapter.collect(run, CASE_TIMEOUT_S)
            entry[2], entry[3] = got.text, None if got.ok else got.error
        env.update(_bound(inst, _outcomes(entry[2])))

    try:
        for k, inst in enumerate(c.instances):
            if k and inst.start == "after-previous":
                for entry in launched:
                    if entry[2] is None:
                        settle(entry)
            try:
                wire = json.dumps([{**s.wire(), "args": fmt.resolve_cross(s.args, env)} for s in inst.steps])
            except (KeyError, IndexError, TypeError) as e:
                launched.append([inst, None, "", f"not launched: {e} is not an earlier instance's result"])
                continue
            args = ["--case", c.name, "--steps", wire] + (["--hold"] if inst.hold else [])
            if k == 0 or inst.start == "after-previous":  # a new group: those launched with it start together
                group = next((j for j in range(k + 1, len(c.instances)) if c.instances[j].start != "with-previous"),
                             len(c.instances)) - k
                start_at = time.time() + START_LEAD_S * group if group > 1 else None
            if start_at is not None:
                args += ["--start-at", f"{start_at:.3f}"]
            launched.append([inst, adapter.launch(args), None, None])
        for entry in launched:
            if entry[2] is None:
                settle(entry)
    finally:  # every held instance ends with the case, whatever happened
        for entry in launched:
            if entry[0].hold and entry[1] is not None:
                adapter.cancel(entry[1])
                got = adapter.collect(entry[1], CASE_TIMEOUT_S)
                if entry[2] is None or not _held(entry[2]):  # it failed before it held: judge its end
                    entry[2], entry[3] = got.text, None if got.ok else got.error
    return [(inst, text, error) for inst, _, text, error in launched]


def run_case(c: fmt.Case, adapter: HostAdapter, reference) -> Outcome:
    t0 = time.perf_counter()
    missing = [n for n in c.needs if n not in adapter.capabilities()]
    if missing:
        return Outcome(c.name, "SKIP", f"the host lacks {', '.join(missing)}")
    try:
        ran = _run_instances(c, adapter)
    except Exception as e:  # the host failed this case: report it, run the rest
        return Outcome(c.name, "FAIL", f"the host adapter failed: {type(e).__name__}: {e}")
    env: dict = {}
    why = None
    for inst, text, error in ran:
        try:
            outcomes = [o for o in _outcomes(text) if "step" in o]
        except json.JSONDecodeError as e:
            why = f"an outcome line of the probe is not JSON: {e}"
        else:
            why = judge(inst, outcomes, error, reference, env)
            env.update(_bound(inst, outcomes))
        if why is not None:
            why = why if len(ran) == 1 else f"instance {inst.name}: {why}"
            break
    return Outcome(c.name, "PASS" if why is None else "FAIL", why or "", seconds=time.perf_counter() - t0)


def run_suite(cases: list[fmt.Case], open_host: Callable[[str], tuple[HostAdapter, object]], wasm: Path,
              expect_fail: set[str] = frozenset(), out: TextIO | None = None) -> Report:
    """open_host(model name) -> (adapter, reference) for the cases on that model; each is closed after."""
    outcomes = []
    for model in sorted({c.model for c in cases}):
        adapter, reference = open_host(model)
        try:
            missing = adapter.unavailable(model)
            if missing is None:
                adapter.install(wasm)
            for c in (c for c in cases if c.model == model):
                o = Outcome(c.name, "SKIP", missing) if missing else run_case(c, adapter, reference)
                o.expected_failure = o.status == "FAIL" and c.name in expect_fail
                outcomes.append(o)
                if out is not None:
                    tag = "FAIL (expected)" if o.expected_failure else o.status
                    print(f"{tag} {o.name}" + (f": {o.reason}" if o.reason else ""), file=out, flush=True)
        finally:
            adapter.close()
    report = Report(outcomes)
    if out is not None:
        print(report.summary(), file=out, flush=True)
    return report
