"""The WIT conformance suite (conformance/, host/conformance/): it passes on this host, catches
a broken one, and covers wit/inferlet.wit and the epilogue IR except what known-gaps.txt lists."""

from __future__ import annotations

import io
import json
import re

import pytest

from host.cli import build_parser
from host.conformance import case as fmt
from host.conformance import coverage as cv
from host.cli.conformance import main as conformance_main
from host.conformance.probe import probe_wasm
from host.conformance.runner import SUMMARY, judge
from wasm_fixtures import TEST_CACHE

pytestmark = [pytest.mark.wasm]

CLOSING = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped$")  # the brief's format, literally


@pytest.fixture(scope="module")
def probe():
    return probe_wasm()  # built once into build/conformance (a no-op while unchanged)


def run(probe, *argv) -> tuple[int, list[str]]:
    """`pie conformance ARGV` in this process: exit status and output lines."""
    args = build_parser().parse_args(["conformance", *map(str, argv)])
    out = io.StringIO()
    rc = conformance_main(args, out=out, cache_dir=TEST_CACHE)
    return rc, out.getvalue().splitlines()


def counts(lines: list[str]) -> tuple[int, int, int]:
    m = CLOSING.match(lines[-1])
    assert m, f"the closing line {lines[-1]!r} is not `N passed, N failed, N skipped`"
    return tuple(map(int, m.groups()))


def test_closing_line_format():
    assert CLOSING.match(SUMMARY.format(passed=3, failed=0, skipped=12))


def test_the_suite_passes_in_process(probe, tmp_path):
    cases = fmt.load_all()
    rc, lines = run(probe, "--json", tmp_path / "r.json")
    assert rc == 0, "\n".join(lines)
    assert counts(lines) == (len(cases), 0, 0)
    assert sorted(ln.removeprefix("PASS ") for ln in lines[:-1]) == sorted(c.name for c in cases)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["summary"] == {"passed": len(cases), "failed": 0, "skipped": 0}
    assert {c["status"] for c in report["cases"]} == {"PASS"}


def _keep_released_handles(monkeypatch):
    """A broken host: release frees the working set but its handle still answers."""
    from host.runtime.bindings import WorkingSetCalls

    monkeypatch.setattr(WorkingSetCalls, "release", lambda self, h: self.inst.engine.release(self.inst._ws(h)))


def _reverse_take(monkeypatch):
    """A broken host: take returns a channel's cells in reverse order."""
    from host.runtime.channels import Channel

    take = Channel.take
    monkeypatch.setattr(Channel, "take", lambda self, *a, **k: take(self, *a, **k)[::-1])


def _fold_one_more(monkeypatch):
    """A broken host: a pass freezes one row more than its fold count (up to the whole window)."""
    from host.engine.working_set import WorkingSet

    apply_fold = WorkingSet.apply_fold
    monkeypatch.setattr(WorkingSet, "apply_fold",
                        lambda self, window, fold, first: apply_fold(self, window, min(fold + 1, len(window)), first))


def _mask_allows_all(monkeypatch):
    """A broken host: grammar_mask allows every token (the grammar constrains nothing)."""
    import numpy as np

    from host.grammar import Matcher

    monkeypatch.setattr(Matcher, "window_masks", lambda self, window: np.ones((len(window), self.vocab_size), bool))


def _share_handle_tables(monkeypatch):
    """A broken host: every instance's handles index one table, so one's numbers reach another's objects."""
    from host.runtime.bindings import InstanceHost

    shared, init = {}, InstanceHost.__init__

    def sharing(self, *a, **k):
        init(self, *a, **k)
        self.handles = shared

    monkeypatch.setattr(InstanceHost, "__init__", sharing)


def _mix_batch_rows(monkeypatch):
    """A broken host: in a model call of several passes, each pass's last readout row is its neighbour's."""
    from host.engine.engine import Engine

    run_batch = Engine.run

    def mixing(self, batch):
        outs = run_batch(self, batch)
        rows = [o for o in outs if len(o.logits)]
        last = [o.logits[-1].clone() for o in rows]
        for o, row in zip(rows, last[-1:] + last[:-1]):
            o.logits = o.logits.clone()
            o.logits[-1] = row
        return outs

    monkeypatch.setattr(Engine, "run", mixing)


@pytest.mark.parametrize("breakage,name", [(_keep_released_handles, "working-sets/released-handle"),
                                           (_reverse_take, "channels/put-read-take-order"),
                                           (_fold_one_more, "forward/fold-some"),
                                           (_mask_allows_all, "epilogue/grammar-greedy-loop"),
                                           (_share_handle_tables, "instances/handles-are-per-instance"),
                                           (_mix_batch_rows, "instances/batched-greedy")])
def test_a_broken_host_fails_and_expect_fail_accepts_it(probe, tmp_path, monkeypatch, breakage, name):
    breakage(monkeypatch)
    rc, lines = run(probe, "--only", name)
    assert rc == 1
    assert re.match(rf"FAIL {name}: (instance [a-z]+: )?step ", lines[0]), lines
    assert counts(lines) == (0, 1, 0)
    known = tmp_path / "known-failures.txt"
    known.write_text(f"# this host's known failures\n{name}\n")
    rc, lines = run(probe, "--only", name, "--expect-fail", known)
    assert rc == 0
    assert lines[0].startswith(f"FAIL (expected) {name}: "), lines
    assert counts(lines) == (0, 1, 0)


def test_expect_fail_refuses_unknown_names(probe, tmp_path):
    known = tmp_path / "known-failures.txt"
    known.write_text("channels/no-such-case\n")
    rc, lines = run(probe, "--expect-fail", known)
    assert rc == 2 and lines == []


def test_only_filters_by_glob_or_substring(probe):
    names = [c.name for c in fmt.load_all()]
    rc, lines = run(probe, "--only", "channels/put-*")
    want = sorted(n for n in names if n.startswith("channels/put-"))
    assert rc == 0 and len(want) >= 3
    assert [ln.removeprefix("PASS ") for ln in lines[:-1]] == want
    rc, lines = run(probe, "--only", "fork")
    assert [ln.removeprefix("PASS ") for ln in lines[:-1]] == sorted(n for n in names if "fork" in n)
    assert run(probe, "--only", "no-such-case")[0] == 2


def test_a_case_needing_a_missing_capability_skips(probe, tmp_path, monkeypatch):
    from host.conformance.models import TinyTokenizer

    monkeypatch.delattr(TinyTokenizer, "grammar_tokens")  # a tokenizer the grammar engine cannot read
    (tmp_path / "needs-grammar.toml").write_text(
        'description = "d"\nneeds = ["grammar"]\n[[steps]]\ncall = "working-sets.create"\n')
    (tmp_path / "runs.toml").write_text('description = "d"\n[[steps]]\ncall = "working-sets.create"\n')
    rc, lines = run(probe, "--cases", tmp_path)
    assert rc == 0
    assert lines[:-1] == ["SKIP needs-grammar: the host lacks grammar", "PASS runs"]
    assert counts(lines) == (1, 0, 1)


@pytest.mark.parametrize("body,why", [
    ('[[steps]]\ncall = "channels.frobnicate"\n', "not a function"),
    ('[[steps]]\ncall = "channels.len"\nexpect = {error = "nope"}\n', "unknown error code"),
    ('[[steps]]\ncall = "channels.len"\nexpect = {predicate = "nope"}\n', "unknown predicate"),
    ('needs = ["warp-drive"]\n[[steps]]\ncall = "channels.len"\n', "unknown capability"),
    ('[[steps]]\ncall = "channels.len"\nagrs = []\n', "unknown key"),
    ('[[instances]]\n[[instances.steps]]\ncall = "channels.len"\n', "two or more"),
    ('[[instances]]\nname = "a"\n[[instances.steps]]\ncall = "channels.len"\nargs = ["$b/ch"]\n'
     '[[instances]]\nname = "b"\n[[instances.steps]]\ncall = "channels.create"\nas = "ch"\n', "no earlier instance"),
    ('[[instances]]\n[[instances.steps]]\ncall = "channels.len"\n[[instances]]\nhold = true\n'
     '[[instances.steps]]\ncall = "channels.len"\n', "no later one to hold for"),
    ('[[instances]]\nstart = "later"\n[[instances.steps]]\ncall = "channels.len"\n', "start must be"),
])
def test_the_case_format_refuses_mistakes(body, why):
    with pytest.raises(fmt.CaseError, match=why):
        fmt.parse("x", __import__("tomllib").loads('description = "d"\n' + body))


def test_judge_fails_a_missing_or_odd_outcome_without_raising():
    c = fmt.parse("x", {"description": "d", "steps": [
        {"call": "channels.create", "args": ["uint32", 2], "as": "ch"},
        {"call": "channels.len", "args": ["$ch"], "expect": {"predicate": "logits-shape", "rows": 1, "vocab": 97}}]})
    assert judge(c, [{"step": 0, "ok": 1}, {"step": 1, "ok": 0}], None, None).startswith(
        "step 1 (channels.len): the check could not read the result: TypeError")
    assert judge(c, [{"step": 0, "ok": 1}], "the inferlet trapped", None) == (
        "step 1 (channels.len): no outcome (the run ended before this step) (the run failed: the inferlet trapped)")
    assert judge(c, [{"step": 0, "error": "internal", "message": "m"}], None, None) == (
        "step 0 (channels.create): expected success, got internal: m")


# ---- coverage ------------------------------------------------------------------------------
def test_coverage_matches_known_gaps():
    """Everything required is covered or listed in conformance/known-gaps.txt, nothing listed is covered."""
    assert cv.check(fmt.load_all(), cv.read_gaps()) == []


def test_the_coverage_check_can_fail():
    cases, gaps = fmt.load_all(), cv.read_gaps()
    without = [c for c in cases if c.name != "channels/put-full"]  # the only case expecting channel-full
    assert "not covered and not in known-gaps.txt: channels.put:channel-full" in cv.check(without, gaps)
    assert "covered now, remove it from known-gaps.txt: channels.create" in cv.check(cases, gaps | {"channels.create"})
    claim = fmt.parse("x", {"description": "d", "covers": ["op:rand"], "steps": [{"call": "channels.len"}]})
    with pytest.raises(ValueError, match="covers op rand"):
        cv.covered([claim])


def test_documented_errors_are_read_from_the_wit():
    docs = cv.documented_errors()
    assert docs["channels.put"] == ["invalid-argument", "bad-handle", "channel-full", "channel-closed"]
    assert docs["runtime.send"] == []
    assert set(docs["forward.execute"]) == {"invalid-argument", "bad-handle", "out-of-pages", "context-overflow"}
