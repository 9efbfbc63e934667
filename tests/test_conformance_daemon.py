"""`pie conformance --server URL`: the suite over a `pie serve` daemon (its inferlet API), started on
a free loopback port over the suite's tiny model, as any client would reach it."""

from __future__ import annotations

import io
import json
import re

import pytest

from host.cli import build_parser
from host.conformance import case as fmt
from host.cli.conformance import main as conformance_main
from test_conformance import _keep_released_handles, _share_handle_tables, counts
from test_daemon import KEY, Served
from wasm_fixtures import TEST_CACHE, build_inferlet

pytestmark = [pytest.mark.wasm]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from host.conformance.models import suite_model
    from host.engine import Engine
    from host.runtime import Runtime

    m = suite_model("tiny")
    engine = Engine(m.model, m.tokenizer, name=m.name, kv_pages=m.kv_pages, page_size=m.page_size, heads=m.heads)
    with Runtime(engine, cache_dir=TEST_CACHE) as rt:
        # four slots: a case runs up to four instances at once (instances/batched-greedy)
        s = Served(rt, build_inferlet("text-completion"), max_instances=4, max_queue=0, api_keys=[KEY],
                   upload_dir=tmp_path_factory.mktemp("uploads"))
        yield s
        s.stop()


def run(*argv) -> tuple[int, list[str], str]:
    """`pie conformance ARGV`: exit status, output lines and what went to stderr."""
    args = build_parser().parse_args(["conformance", *map(str, argv)])
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.stderr", err)
        rc = conformance_main(args, out=out, cache_dir=TEST_CACHE)
    return rc, out.getvalue().splitlines(), err.getvalue()


def test_the_suite_passes_over_the_daemon(served, tmp_path):
    cases = fmt.load_all()
    rc, lines, err = run("--server", served.url, "--api-key", KEY, "--json", tmp_path / "r.json")
    print(lines[-1])  # the daemon's summary line (pytest -s shows it)
    assert rc == 0, "\n".join(lines) + err
    assert counts(lines) == (len(cases), 0, 0)
    assert sorted(ln.removeprefix("PASS ") for ln in lines[:-1]) == sorted(c.name for c in cases)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["host"] == f"daemon {served.url}" and report["summary"]["passed"] == len(cases)
    # each case ran as its own instance on the daemon, one more read the model's facts
    assert len(served.started) >= len(cases) + 1


def test_a_daemon_serving_another_model_skips_its_cases(served, monkeypatch):
    monkeypatch.setattr(served.service, "model", "smollm2-135m")
    rc, lines, _ = run("--server", served.url, "--api-key", KEY, "--only", "channels/put-*")
    assert rc == 0
    assert lines[0].endswith(": the server serves 'smollm2-135m', not the case's model 'tiny'"), lines
    assert all(ln.startswith("SKIP channels/put-") for ln in lines[:-1])
    assert counts(lines)[:2] == (0, 0)


def test_a_daemon_without_grammars_skips_their_cases(served, monkeypatch):
    """A daemon whose grammar engine cannot read the model's tokenizer: the probe's compile fails,
    so the grammar capability is absent and the cases needing it SKIP."""
    from host.grammar import GrammarError, Grammars

    def refuse(self, kind, source):
        raise GrammarError("this model's tokenizer is not one the grammar engine reads")

    monkeypatch.setattr(Grammars, "compile", refuse)
    rc, lines, _ = run("--server", served.url, "--api-key", KEY, "--only", "grammars/*")
    names = sorted(c.name for c in fmt.load_all() if c.name.startswith("grammars/"))
    assert rc == 0 and len(names) >= 6
    assert lines[:-1] == [f"SKIP {n}: the host lacks grammar" for n in names]
    assert counts(lines) == (0, 0, len(names))


@pytest.mark.parametrize("breakage,name", [(_keep_released_handles, "working-sets/released-handle"),
                                           (_share_handle_tables, "instances/handles-are-per-instance")])
def test_a_broken_daemon_host_fails(served, monkeypatch, breakage, name):
    """The in-process breakages of test_conformance, behind HTTP: the daemon's runtime keeps
    answering a released working set's handle, or lets one instance's handle numbers reach
    another's objects (a held instance and a later one, over the API)."""
    breakage(monkeypatch)
    rc, lines, _ = run("--server", served.url, "--api-key", KEY, "--only", name)
    assert rc == 1 and re.match(rf"FAIL {name}: (instance b: )?step ", lines[0]), lines


def test_an_unreachable_or_refusing_daemon_is_exit_2(served):
    rc, lines, err = run("--server", served.url, "--api-key", "wrong-key")
    assert rc == 2 and lines == [] and "401" in err
    rc, lines, err = run("--server", "http://127.0.0.1:9", "--only", "fork")
    assert rc == 2 and lines == [] and "pie conformance: http://127.0.0.1:9" in err
