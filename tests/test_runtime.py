"""The runtime: sandbox limits, bad calls and bad components fail alone; the compiled cache is fast."""

from __future__ import annotations


import pytest

from host.runtime.imports import VERSION as WIT_VERSION
from wasm_fixtures import *  # noqa: F401,F403 (fixtures)

pytestmark = [pytest.mark.wasm, pytest.mark.model]

HEALTHY_ARGS = ["--prompt", "Write one sentence about the sea.", "--chat", "--max-tokens", "16"]


@pytest.fixture(scope="module")
def healthy_alone(runtime, text_completion_wasm):
    r = runtime.run(text_completion_wasm, HEALTHY_ARGS)
    assert r.ok, r.error
    return r.token_ids


# (case, what to run: a misbehave mode or a bad .wasm, substring of the expected error)
FAILURES = [
    ("loop", "mode:loop", "exceeded its CPU-time limit of 2 s"),
    ("alloc", "mode:alloc", "exceeded its memory limit of 256 MiB"),
    ("guest-exception", "mode:trap", "RuntimeError: deliberate guest exception"),
    ("dropped-handle", "mode:dropped", "bad-handle: working-set handle 1 is unknown or was released"),
    ("never-issued-handle", "mode:raw-handle", "working-set handle 987654 is unknown"),
    ("out-of-vocabulary", "mode:oov", "invalid-argument: token id 49157 is outside the vocabulary"),
    ("oversized-window", "mode:window", "context-overflow: window of 8193 rows"),
    ("fold-past-window", "mode:fold", "invalid-argument: fold 3 is outside 0..2"),
    ("malformed-epilogue", "mode:epilogue", "invalid-argument: op 0: unknown op 'frobnicate'"),
    ("epilogue-bad-handle", "mode:epilogue-handle", "bad-handle: epilogue handle 7 is unknown"),
    ("truncated-wasm", "truncated", "not a valid component (truncated or corrupt?)"),
    ("core-module", "core", "core WebAssembly module, not a component"),
    ("other-world", "other-world", f"not built against the pie:inferlet@{WIT_VERSION} world"),
    # issue 22: a device loop's failure beside the healthy one's, and imports of other types
    ("loop-epilogue-of-other-dims", "mode:loop-dims", "invalid-argument: epilogue declares V=7"),
    ("loop-emits-negative-id", "mode:loop-emit-negative", "invalid-argument: token id -1 is outside the vocabulary"),
    ("send-of-another-type", "bad-imports", "imports runtime.send with another type"),
]


@pytest.mark.parametrize("case,what,expected", FAILURES, ids=[f[0] for f in FAILURES])
def test_failure_is_clear_and_isolated(case, what, expected, runtime, engine, text_completion_wasm, misbehave_wasm,
                                       other_world_wasm, bad_imports_wasm, healthy_alone):
    from host.runtime import Limits

    free_before = engine.pool.free_pages
    args: list[str] = []
    if what.startswith("mode:"):
        wasm, args = misbehave_wasm, ["--mode", what[5:]]
    elif what == "truncated":
        data = text_completion_wasm.read_bytes()
        wasm = data[: len(data) // 3]
    elif what == "core":
        wasm = b"\0asm\x01\0\0\0"  # an empty core module
    else:
        wasm = other_world_wasm if what == "other-world" else bad_imports_wasm
    healthy = runtime.start(text_completion_wasm, HEALTHY_ARGS)
    bad = runtime.start(wasm, args, limits=Limits(memory_bytes=256 << 20, cpu_time_s=2.0))
    bad_result, ok_result = bad.result(timeout=120), healthy.result(timeout=120)
    assert not bad_result.ok
    assert expected in bad_result.error, bad_result.error
    assert ok_result.ok, ok_result.error
    assert ok_result.token_ids == healthy_alone
    assert engine.pool.free_pages == free_before  # the failed instance's pages went back
    if case == "guest-exception":
        assert "Traceback" in bad_result.log  # the guest's stderr is captured into the run's log


def test_sandbox_shows_no_files_env_or_network(runtime, misbehave_wasm):
    r = runtime.run(misbehave_wasm, ["--mode", "sandbox"])
    assert r.ok, r.error
    assert r.text == "denied denied denied 0 no-network"
    assert "hello from the guest" in r.log  # guest stdout is captured into the run's log, not ours


def test_channels_through_the_interface(runtime, misbehave_wasm):
    r = runtime.run(misbehave_wasm, ["--mode", "channels"])
    assert r.ok, r.error
    # read, len, take (consumes all), full, f32 and bool cells, put after close
    assert r.text == "[5, 6] 3 [5, 6, 7] 0 channel-full [0.5] [True, False] channel-closed"


def test_working_sets_through_the_interface(runtime, misbehave_wasm):
    r = runtime.run(misbehave_wasm, ["--mode", "working-sets"])
    assert r.ok, r.error
    # prompt of 9 rows; the fork adds one row; truncate to 3; evict rows 1..3 of the parent
    assert r.text == "(9, 10, 13) (3, 7, True) invalid-argument"


def test_second_launch_uses_the_compiled_cache(engine, runtime, text_completion_wasm, misbehave_wasm, monkeypatch):
    from wasmtime.component import Component

    from host.runtime import Runtime
    from host.runtime import cache as cache_mod

    runtime.load(text_completion_wasm)  # compiled and stored by now
    runtime.load(misbehave_wasm)

    class NoCompile:  # a fresh process must deserialize the stored artifacts, never recompile
        deserialize_file = staticmethod(Component.deserialize_file)

        def __init__(self, *a, **k):
            raise AssertionError("the component was compiled again instead of loaded from the cache")

    monkeypatch.setattr(cache_mod, "Component", NoCompile)
    with Runtime(engine, cache_dir=runtime.cache.dir) as fresh:  # a new process would look like this
        fresh.load(text_completion_wasm)
        r = fresh.run(misbehave_wasm, ["--mode", "channels"])
    assert r.ok, r.error


@pytest.mark.parametrize("loop", ["guest", "device"])
def test_host_stats_count_calls(runtime, text_completion_wasm, loop):
    r = runtime.run(text_completion_wasm, ["--prompt", "Count: one, two,", "--max-tokens", "8", "--loop", loop])
    assert r.ok, r.error
    s = r.stats
    # one pass per token: the prompt's pass makes the first (the device loop's prompt pass folds
    # its whole window, so its rows count as neither drafted nor accepted)
    assert s["passes"] == len(r.token_ids) == s["generated_tokens"]
    assert s["drafted_tokens"] == 0 and s["accepted_tokens"] == 0
    assert s["mean_accepted_per_pass"] == 1.0
    if loop == "guest":
        # setup calls plus two crossings (execute, emit) per token
        assert s["guest_calls"] <= 2 * len(r.token_ids) + 10
    else:  # setup calls only: the host streams the output channel
        assert s["guest_calls"] <= 12
    assert s["wall_s"] > 0 and s["tokens_per_s"] > 0
