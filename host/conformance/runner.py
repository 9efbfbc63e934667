"""Runs cases on a host: one probe instance per case, each step's outcome judged here.

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


def judge(c: fmt.Case, outcomes: list[dict], run_error: str | None, reference) -> str | None:
    by_step = {o.get("step"): o for o in outcomes}
    env: dict = {}
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


def run_case(c: fmt.Case, adapter: HostAdapter, reference) -> Outcome:
    t0 = time.perf_counter()
    missing = [n for n in c.needs if n not in adapter.capabilities()]
    if missing:
        return Outcome(c.name, "SKIP", f"the host lacks {', '.join(missing)}")
    wire = json.dumps([s.wire() for s in c.steps])
    try:
        got = adapter.collect(adapter.launch(["--case", c.name, "--steps", wire]), CASE_TIMEOUT_S)
    except Exception as e:  # the host failed this case: report it, run the rest
        return Outcome(c.name, "FAIL", f"the host adapter failed: {type(e).__name__}: {e}")
    try:
        outcomes = [json.loads(ln[len(MARK):]) for ln in got.text.splitlines() if ln.startswith(MARK)]
    except json.JSONDecodeError as e:
        return Outcome(c.name, "FAIL", f"an outcome line of the probe is not JSON: {e}", seconds=time.perf_counter() - t0)
    why = judge(c, outcomes, None if got.ok else got.error, reference)
    return Outcome(c.name, "PASS" if why is None else "FAIL", why or "", seconds=time.perf_counter() - t0)


def run_suite(cases: list[fmt.Case], open_host: Callable[[str], tuple[HostAdapter, object]], wasm: Path,
              expect_fail: set[str] = frozenset(), out: TextIO | None = None) -> Report:
    """open_host(model name) -> (adapter, reference) for the cases on that model; each is closed after."""
    outcomes = []
    for model in sorted({c.model for c in cases}):
        adapter, reference = open_host(model)
        try:
            adapter.install(wasm)
            for c in (c for c in cases if c.model == model):
                o = run_case(c, adapter, reference)
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
