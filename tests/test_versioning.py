"""The pie:inferlet package version is checked at load (wit/VERSIONING.md): real components built
from copies of wit/inferlet.wit whose package line names other versions load or are refused."""

from __future__ import annotations

import re

import pytest

from host.runtime import imports
from host.runtime.errors import InferletError
from wasm_fixtures import ROOT, TEST_CACHE, _build_module

pytestmark = [pytest.mark.wasm]

HOST = imports.VERSION
MAJOR, MINOR, PATCH = imports.parse_version(HOST)
VERSIONS = ROOT / "build" / "test-versions"  # WIT copies and components, rebuilt only when they change
APP = '''import wit_world
from wit_world.imports import runtime


class WitWorld(wit_world.WitWorld):
    def run(self) -> None:
        runtime.send("versioned")
'''


def _write(path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:  # unchanged files keep the build's stamp current
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def component(version: str, drop: tuple[str, ...] = ()):
    """A component that sends "versioned", built against wit/inferlet.wit with its package version
    set to `version` ("" for none) and the functions named in `drop` removed."""
    wit = imports.WIT.read_text()
    wit, n = re.subn(r"^package pie:inferlet@[\w.-]+;", f"package pie:inferlet{'@' + version if version else ''};",
                     wit, count=1, flags=re.M)
    assert n == 1
    for fn in drop:
        wit, n = re.subn(rf"^\s*{fn}: func\([^;]*;\n", "", wit, flags=re.M)
        assert n == 1, fn
    tag = (version or "none") + "".join(f"-{fn}" for fn in drop)
    _write(VERSIONS / tag / "wit" / "inferlet.wit", wit)
    src = VERSIONS / "app"
    _write(src / "app.py", APP)
    return _build_module().build_one(src, VERSIONS / tag, wit=VERSIONS / tag / "wit")


@pytest.fixture(scope="module")
def engine():
    from host.conformance.models import suite_model
    from host.engine import Engine

    m = suite_model("tiny")
    return Engine(m.model, m.tokenizer, name="tiny", kv_pages=m.kv_pages, page_size=m.page_size)


@pytest.fixture
def runtime(engine):
    from host.runtime import Runtime

    with Runtime(engine, cache_dir=TEST_CACHE) as rt:  # one per test: a passed check is remembered
        yield rt


@pytest.mark.parametrize("built,host,ok", [
    ("0.1.0", "0.1.0", True), ("0.1.0", "0.1.3", True), ("0.1.3", "0.1.3", True),
    ("0.1.4", "0.1.3", False), ("0.2.0", "0.1.3", False), ("0.0.9", "0.1.3", False), ("1.0.0", "0.1.3", False),
    ("0.0.2", "0.0.2", True), ("0.0.1", "0.0.2", False),
    ("1.0.0", "1.3.1", True), ("1.3.0", "1.3.1", True), ("1.4.0", "1.3.1", False), ("2.0.0", "1.3.1", False),
    ("0.1.0-rc.1", "0.1.0", False), ("01.0.0", "1.0.0", False), ("0.1", "0.1.0", False),
])
def test_the_rule(built, host, ok):
    assert (imports.incompatibility(built, host) is None) == ok


def test_a_component_of_this_version_runs(runtime):
    r = runtime.run(component(HOST))
    assert r.ok, r.error
    assert r.text == "versioned"


def test_an_older_compatible_component_runs(runtime, monkeypatch):
    """This host as the next patch release, which added runtime.emit-channel: a component built
    against this version without it links (wasmtime matches the older import name) and runs."""
    if MAJOR == 0 and MINOR == 0:
        pytest.skip("0.0.x: every version is its own track, nothing older is compatible")
    from host.runtime import bindings

    newer = f"{MAJOR}.{MINOR}.{PATCH + 1}"
    older = component(HOST, drop=("emit-channel",))
    monkeypatch.setattr(imports, "VERSION", newer)
    monkeypatch.setattr(bindings, "PACKAGE", f"{imports.PACKAGE}/{{}}@{newer}")
    r = runtime.run(older)
    assert r.ok, r.error
    assert r.text == "versioned"


# a newer patch, and the next track (the rule's other cases are above; each build costs seconds)
REFUSED = [(f"{MAJOR}.{MINOR}.{PATCH + 1}", "it is newer, and may import what this host lacks"),
           (f"{MAJOR + 1}.0.0" if MAJOR else f"0.{MINOR + 1}.0",
            f"another {'major' if MAJOR else 'minor'} version may change what existing functions take and return")]


@pytest.mark.parametrize("version,why", REFUSED)
def test_an_incompatible_component_is_refused_naming_both_versions(runtime, version, why):
    wasm = component(version)
    want = (f"the component was built against pie:inferlet@{version}, which this host's "
            f"pie:inferlet@{HOST} cannot run: {why}")
    with pytest.raises(InferletError) as e:
        runtime.load(wasm)
    assert str(e.value).startswith(want), str(e.value)
    r = runtime.run(wasm)  # a run fails with the same message, before the guest runs
    assert not r.ok and r.error.startswith(want) and r.text == "" and r.stats["guest_calls"] == 0


def test_an_import_without_a_version_is_refused(runtime):
    r = runtime.run(component(""))
    assert not r.ok
    assert re.fullmatch(rf"the component imports pie:inferlet/\w[\w-]* without a version; this host implements "
                        rf"pie:inferlet@{re.escape(HOST)}", r.error), r.error
