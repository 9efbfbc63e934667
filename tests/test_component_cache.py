"""Runtime.load and the compiled-component cache (issue 41 items 5, 6): a refused component is
kept nowhere, compiled components held in memory are bounded (LRU), and a compile holds no lock
that a start of another, loaded component needs."""

from __future__ import annotations

import threading

import pytest

from host.runtime.cache import ComponentCache
from host.runtime.errors import InferletError
from wasm_fixtures import TEST_CACHE, bad_imports_wasm, misbehave_wasm, other_world_wasm, text_completion_wasm  # noqa: F401,E501

pytestmark = [pytest.mark.wasm]


@pytest.fixture
def rt(tiny):
    from host.runtime import Runtime

    with Runtime(tiny[0], cache_dir=TEST_CACHE) as r:
        yield r


def test_loaded_components_are_lru_bounded():
    cache = ComponentCache(engine=None, directory=None, max_loaded=2)
    for k in "abc":
        cache.put(k, object())
    assert list(cache._loaded) == ["b", "c"]  # "a" dropped from memory (the disk cache keeps it)
    assert cache.get("b") is not None
    cache.put("d", object())
    assert list(cache._loaded) == ["b", "d"]  # "c" was the least recently used


def test_refused_components_are_kept_nowhere(tiny, tmp_path, bad_imports_wasm):
    from host.runtime import Runtime

    with Runtime(tiny[0], cache_dir=tmp_path) as rt:  # an empty disk cache: compiled here (~30 s)
        with pytest.raises(InferletError, match="with another type"):  # found only once compiled
            rt.load(bad_imports_wasm)
        assert not rt.cache._loaded and not list(tmp_path.glob("*.cwasm"))
        # only the verdict is kept: a second load is refused at once, with the same message (each
        # launch of a refused component compiled it again: 63 runs of it took minutes)
        first = str(rt._refused[rt.cache.key(bad_imports_wasm.read_bytes())])
        rt.cache.compile = lambda *a: pytest.fail("compiled a refused component again")
        with pytest.raises(InferletError) as again:
            rt.load(bad_imports_wasm)
        assert str(again.value) == first


def test_another_world_is_refused_before_compiling(rt, monkeypatch, other_world_wasm, text_completion_wasm):
    from host.runtime.component_binary import import_names

    wasm = text_completion_wasm.read_bytes()  # the names read from the binary are wasmtime's
    assert import_names(wasm) == list(rt.load(wasm).type.imports(rt.wasm_engine))
    monkeypatch.setattr(rt.cache, "compile", lambda *a: pytest.fail("compiled a component of another world"))
    with pytest.raises(InferletError, match="pie:other/host@0.1.0"):
        rt.load(other_world_wasm)


def test_a_compile_holds_no_start_of_another_component(rt, monkeypatch, text_completion_wasm, misbehave_wasm):
    loaded = rt.load(text_completion_wasm)
    held, release = threading.Event(), threading.Event()
    calls = []
    compile_ = rt.cache.compile

    def slow_compile(wasm, key):
        calls.append(key)
        held.set()
        assert release.wait(60)
        return compile_(wasm, key)
    monkeypatch.setattr(rt.cache, "compile", slow_compile)
    results = []
    loaders = [threading.Thread(target=lambda: results.append(rt.load(misbehave_wasm))) for _ in range(2)]
    for t in loaders:
        t.start()
    assert held.wait(60)
    # another key's start meanwhile: the compile above holds nothing it needs
    assert rt.load(text_completion_wasm) is loaded
    assert loaders[0].is_alive() or loaders[1].is_alive()
    release.set()
    for t in loaders:
        t.join(120)
    assert len(results) == 2 and results[0] is results[1]
    assert len(calls) == 1  # two loads of the same bytes: one compile


def test_two_loads_of_a_refused_component_both_fail(rt, monkeypatch, bad_imports_wasm):
    rt.cache._loaded.clear()
    errors = []

    def load():
        try:
            rt.load(bad_imports_wasm)
        except InferletError as e:
            errors.append(str(e))
    ts = [threading.Thread(target=load) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert len(errors) == 2 and errors[0] == errors[1]
