"""Containment (issue 22), on the tiny model: a device loop's failure ends that loop alone, an
ended instance leaks nothing, host functions answer arguments of any type with typed errors, a
component with other import types is refused at load, and each instance has a KV page quota."""

from __future__ import annotations

from pathlib import Path

import pytest

from host.engine import Pass
from host.engine.compute import compute
from host.engine.loop import DeviceLoop
from host.engine.scheduler import Scheduler
from host.epilogue import compile_program
from host.errors import PieError
from host.runtime.imports import VERSION as WIT_VERSION

from guest import cells, chan, plain_greedy, trace

PROMPT, ROUNDS = [5, 9, 13, 4], 8


def greedy_program(vocab=None, read_hidden=False) -> str:
    p = trace.Program(window=1, readout=1, vocab=vocab)
    p.channel("out", "i64", 256)
    p.channel("window", "i64", 1)
    tok = p.logits().argmax()
    p.put("out", tok)
    p.set("window", tok)
    p.fold(p.const(1))
    stop = p.length("out") + 1 >= ROUNDS
    if read_hidden:
        stop = stop | (p.hidden()[0, 0] > 1e30)
    p.stop_if(stop)
    return p.to_json()


def greedy_loop(eng, program, prompt=PROMPT, hidden=False, sink=None) -> tuple[DeviceLoop, object]:
    ws = eng.new_working_set()
    eng.forward([Pass(ws, prompt[:-1], [0])])
    out, win = chan(256), chan(1, [prompt[-1]])
    out.sink = sink
    return DeviceLoop(ws, program, {"out": out, "window": win}, win, max_window=1, rounds=ROUNDS, hidden=hidden), out


class FailsFor:
    """A program that raises at run time, as a kernel would, for the loops whose `out` channel is
    in `bad`, and runs the real program for the rest: they share it, so they share a run."""

    def __init__(self, program, bad: set):
        self.program, self.bad, self.uses, self.has_fold = program, bad, program.uses, program.has_fold
        self.spare, self.reads_logits = program.spare, program.reads_logits

    def run(self, envs):
        if any(id(e.channels["out"]) in self.bad for e in envs):
            raise RuntimeError("a kernel failed")
        return self.program.run(envs)


def sink_failing_at(n: int):
    calls = []

    def sink(cells):  # as the detokenizer raised on a -1 cell
        calls.append(cells)
        if len(calls) == n:
            raise ValueError("cannot decode -1")
    return sink


def bad_loop(eng, case: str, healthy_program):
    """(the failing loop, the healthy loop's program, its hidden flag, what the error says)."""
    if case == "hidden-not-given":  # one program: the healthy loop's pass gives hidden, this one's not
        prog = compile_program(greedy_program(read_hidden=True))
        return greedy_loop(eng, prog, [7, 8])[0], prog, True, "hidden"
    if case == "dims-mismatch":
        return greedy_loop(eng, compile_program(greedy_program(vocab=50)), [7, 8])[0], healthy_program, False, "V=50"
    if case == "kernel-raises":
        shared = FailsFor(healthy_program, set())
        loop, out = greedy_loop(eng, shared, [7, 8])
        shared.bad.add(id(out))
        return loop, shared, False, "RuntimeError: a kernel failed"
    if case == "sink-raises":  # fails in its third round's bookkeeping
        return greedy_loop(eng, healthy_program, [7, 8], sink=sink_failing_at(3))[0], healthy_program, False, \
            "ValueError: cannot decode -1"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["hidden-not-given", "dims-mismatch", "kernel-raises", "sink-raises"])
def test_a_failing_loop_ends_alone_and_the_healthy_one_keeps_its_tokens(tiny, case):
    eng, _ = tiny
    want = plain_greedy(eng, PROMPT, ROUNDS)
    sched = Scheduler(eng)
    try:
        def start():  # on the compute thread: both loops are in the scheduler's first step
            bad, prog, hidden, says = bad_loop(eng, case, compile_program(greedy_program()))
            good, out = greedy_loop(eng, prog, hidden=hidden)
            return sched.start_loop(bad), sched.start_loop(good), out, says, bad

        bad_done, good_done, out, says, bad = compute().call(start)
        with pytest.raises(PieError, match=says) as err:
            bad_done.result(timeout=60)
        assert err.value.code in ("invalid-argument", "internal")
        assert good_done.result(timeout=60).rounds == ROUNDS
        assert cells(out) == want
        assert case != "sink-raises" or bad.round == 2  # it ran beside the healthy loop until it failed
    finally:
        sched.close()


# ---- whole instances, on the tiny model ------------------------------------------------------

# (misbehave mode, limits, how the run ends): one of each way an instance can end
ENDINGS = [
    ("channels", None, None),  # success
    ("dropped", None, "bad-handle"),  # a guest error (a typed error it returns)
    ("trap", None, "deliberate guest exception"),  # a trap
    ("alloc", {"memory_bytes": 64 << 20}, "memory limit"),
    ("loop", {"cpu_time_s": 0.05}, "CPU-time limit"),
    ("loop-dims", None, "epilogue declares V=7"),  # a device loop's failure, at once
    ("loop-emit-negative", None, "token id -1 is outside the vocabulary"),  # ... after 3 rounds
    ("bad-imports", None, f"imports runtime.send with another type than pie:inferlet@{WIT_VERSION} declares: "
                          "func(u32) instead of func(string)"),  # refused at load
]


@pytest.fixture
def tiny_runtime(tiny):
    from host.runtime import Runtime
    from wasm_fixtures import TEST_CACHE

    rt = Runtime(tiny[0], cache_dir=TEST_CACHE)
    yield rt
    rt.close()


def run_ending(rt, mode, limits):
    from host.runtime.runtime import Limits
    from wasm_fixtures import build_test_inferlet

    if mode == "bad-imports":
        return rt.run(build_test_inferlet("bad-imports", world="bad-imports"), [])
    return rt.run(build_test_inferlet("misbehave"), ["--mode", mode], limits=Limits(**limits) if limits else None)


@pytest.mark.wasm
@pytest.mark.parametrize("mode,limits,says", ENDINGS, ids=[e[0] for e in ENDINGS])
def test_each_ending_is_a_typed_result(tiny_runtime, mode, limits, says):
    r = run_ending(tiny_runtime, mode, limits)
    assert r.ok == (says is None), r.error
    assert says is None or says in r.error


SOCKET_ERRORS = ["unknown", "access-denied"]  # the first cases of wasi:sockets' error-code


@pytest.mark.wasm
def test_a_component_importing_wasi_sockets_is_denied_the_network(tiny_runtime):
    """Issue 41: the guests' socket attempts stopped at their own `ModuleNotFoundError: socket`; a
    raw component calls wasi:sockets itself. The host links it (WASI's imports are there) and
    denies it: no socket, and nothing reaches a listener on loopback."""
    import socket

    import wasmtime

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        wat = (Path(__file__).parent / "inferlets" / "raw" / "sockets.wat").read_text()
        wasm = bytes(wasmtime.wat2wasm(wat.replace("PORT", str(listener.getsockname()[1]))))
        r = tiny_runtime.run(wasm, [])
        assert not r.ok and r.error.startswith("connect: "), r.error
        code = int(r.error.split()[-1])
        assert code != 99, "the host let it start a connection"
        assert SOCKET_ERRORS[code % 50] == "access-denied", r.error
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


RUNS = 504  # 63 of each ending


@pytest.mark.wasm
def test_hundreds_of_runs_ending_every_way_leak_nothing(tiny_runtime, tiny):
    import gc
    import os

    from host.runtime.bindings import InstanceHost

    def measure():
        compute().call(lambda: None)  # the scheduler's step that ended a loop has dropped it
        gc.collect()
        rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        hosts = sum(type(o) is InstanceHost for o in gc.get_objects())
        return rss, len(os.listdir("/proc/self/fd")), hosts

    eng = tiny[0]
    free = eng.pool.free_pages
    for _ in range(2):  # warm up: compiled components, allocator pools
        for mode, limits, _ in ENDINGS:
            run_ending(tiny_runtime, mode, limits)
    rss0, fds0, hosts0 = measure()
    for i in range(RUNS):
        mode, limits, says = ENDINGS[i % len(ENDINGS)]
        r = run_ending(tiny_runtime, mode, limits)
        assert r.ok == (says is None), r.error
    rss, fds, hosts = measure()
    print(f"\n{RUNS} runs: RSS {rss0 >> 20} -> {rss >> 20} MiB, fds {fds0} -> {fds}, live hosts {hosts0} -> {hosts}")
    assert hosts == hosts0 == 0
    assert fds <= fds0 + 2
    assert rss - rss0 < 64 << 20  # a leaked store keeps its guest's linear memory: MiBs a run
    assert eng.pool.free_pages == free


# ---- host functions: arguments of any Python type, and host bugs ----------------------------

ODD = [None, "x", -1, 1 << 40, 1.5, True, b"x", [1, "a"], [[1]]]


def odd_values():
    from wasmtime.component import Record, Variant

    return ODD + [Record(), Variant("zzz", None), Variant("uint32", ["a"]), Variant("float32", [1])]


def call_checked(host, store, name, fn, args):
    """Call host function `name` as wasmtime would; returns its error code, or None on success."""
    import wasmtime
    from wasmtime.component import Record, Variant

    from host.runtime.bindings import NO_ERROR_RESULT, TAGGED, WIT_ERROR_CODES

    host.fatal = None
    try:
        out = host._host(name, fn, tagged=name in TAGGED)(store, *args)
    except wasmtime.WasmtimeError as e:  # the instance ends: only where the WIT has no error result
        assert name in NO_ERROR_RESULT, (name, args, str(e))
        return host.fatal.split(":")[0]
    if isinstance(out, Variant) and out.tag in ("ok", "err"):
        out = out.payload if out.tag == "err" else None
    if isinstance(out, Record) and hasattr(out, "code") and out.code in WIT_ERROR_CODES:
        return out.code
    return None


def test_every_host_function_answers_arguments_of_any_type_with_a_typed_error(tiny):
    import inspect

    import wasmtime

    from host.runtime.bindings import InstanceHost

    eng, _ = tiny
    sched = Scheduler(eng)
    store = wasmtime.Store(wasmtime.Engine())
    host = InstanceHost(eng, sched, [], 60.0, 0.01)
    try:
        ws = host._add(eng.new_working_set())
        ch = host.calls["channels"].create("uint32", 4)
        typed: dict[str, int] = {}
        for iface, funcs in host.functions().items():
            for fname, fn in funcs.items():
                n = len(inspect.signature(fn).parameters)
                if n == 0:
                    continue
                name = f"{iface}.{fname}"
                # all arguments odd, then (for a function on a handle) a good handle and the rest odd
                good = {"working-sets": ws, "channels": ch}.get(iface)
                for v in odd_values():
                    for args in [[v] * n] + ([[good] + [v] * (n - 1)] if good and fname != "create" else []):
                        code = call_checked(host, store, name, fn, args)  # some odd values are fine
                        assert code != "internal", (name, args, host.fatal)
                        typed[name] = typed.get(name, 0) + (code is not None)
        assert len(typed) == sum(1 for funcs in host.functions().values() for fn in funcs.values()
                                 if inspect.signature(fn).parameters) and all(typed.values()), typed
    finally:
        host.release_all()
        sched.close()


def test_a_host_bug_ends_its_instance_with_an_internal_error_naming_the_function(tiny_runtime, monkeypatch):
    from host.runtime.bindings import TokenizerCalls

    def broken(self, text):
        raise ZeroDivisionError("a host bug")
    monkeypatch.setattr(TokenizerCalls, "encode", broken)
    r = run_ending(tiny_runtime, "working-sets", None)  # its first call encodes a prompt
    assert not r.ok
    assert r.error == "internal: host function 'tokenizer.encode' failed: ZeroDivisionError: a host bug"
    assert "[host traceback]" in r.log and "in broken" in r.log  # where the bug is, for whoever reads the log
    assert run_ending(tiny_runtime, "channels", None).ok  # the runtime serves the next instance


def test_the_host_implements_exactly_the_wit_imports(tiny):
    from host.runtime.bindings import NO_ERROR_RESULT, TAGGED, InstanceHost
    from host.runtime.imports import declared

    host = InstanceHost(tiny[0], None, [], 60.0, 0.01)
    assert {i: sorted(f) for i, f in host.functions().items()} == \
        {i: sorted(f) for i, f in declared().items() if f}
    assert TAGGED == {"forward.execute", "grammars.state"}
    assert NO_ERROR_RESULT == {"runtime.get-arguments", "runtime.get-model-info", "runtime.send", "tokenizer.encode"}


# ---- KV pages: a quota per instance -------------------------------------------------------------

def test_a_working_set_past_its_quota_gets_out_of_pages_and_others_still_allocate(tiny):
    from host.errors import PoolExhausted

    eng, _ = tiny  # 16 pages of 4 rows
    quota = eng.pool.quota(0.25)
    assert quota.limit == 4
    ws = eng.new_working_set(quota)
    eng.forward([Pass(ws, list(range(3, 19)), [0])])  # 16 rows: the quota's 4 pages
    child = eng.fork(ws)  # shares them: no page more
    assert quota.used == 4
    for s in (ws, child):
        (err,) = eng.forward([Pass(s, [5], [0])])
        assert isinstance(err, PoolExhausted) and "quota of 4 pages" in str(err)
    assert ws.frozen == child.frozen == 16
    other = eng.new_working_set()  # another instance's: the pool has room
    (out,) = eng.forward([Pass(other, list(range(3, 35)), [0])])
    assert not isinstance(out, PoolExhausted)
    for s in (ws, child, other):
        eng.release(s)
    assert quota.used == 0 and eng.pool.free_pages == eng.pool.num_pages


def test_instance_quotas_count_against_their_keys_quota(tiny):
    """Issue 41 item 9: two instances of one key, each within its share, starved another key."""
    from host.errors import PoolExhausted

    eng, _ = tiny  # 16 pages of 4 rows
    key_a = eng.pool.quota(0.5, whose="this API key's", flag="--kv-share-per-key")
    key_b = eng.pool.quota(0.5, whose="this API key's", flag="--kv-share-per-key")
    a1, a2 = (eng.new_working_set(eng.pool.quota(0.5, key_a)) for _ in range(2))
    assert not isinstance(eng.forward([Pass(a1, list(range(3, 19)), [0])])[0], PoolExhausted)  # 4 pages
    (err,) = eng.forward([Pass(a2, list(range(3, 23)), [0])])  # 5 more: within its own 8, past the key's 8
    assert isinstance(err, PoolExhausted) and "this API key's quota of 8 pages" in str(err)
    assert "--kv-share-per-key" in str(err) and key_a.used == 4
    b = eng.new_working_set(eng.pool.quota(0.5, key_b))
    (out,) = eng.forward([Pass(b, list(range(3, 35)), [0])])  # the other key's whole share is there
    assert not isinstance(out, PoolExhausted)
    for s in (a1, a2, b):
        eng.release(s)
    assert key_a.used == key_b.used == 0 and eng.pool.free_pages == eng.pool.num_pages


@pytest.mark.wasm
def test_an_instance_past_its_kv_share_fails_with_out_of_pages(tiny_runtime, tiny):
    eng = tiny[0]
    r = run_ending(tiny_runtime, "working-sets", {"kv_share": 0.25})  # a 43-token prompt: 11 pages
    assert not r.ok and r.error.startswith("out-of-pages: KV page quota exhausted"), r.error
    assert "need 11 more pages" in r.error and "quota of 4 pages (of 16 in the pool)" in r.error
    assert eng.pool.free_pages == eng.pool.num_pages


def test_a_fold_from_a_float_channel_is_refused(tiny):
    import wasmtime
    from wasmtime.component import Record, Variant

    from host.runtime.bindings import InstanceHost

    def rec(**fields):
        r = Record()
        for k, v in fields.items():
            setattr(r, k, v)
        return r

    eng, _ = tiny
    host = InstanceHost(eng, None, [], 60.0, 0.01)
    try:
        ws = host._add(eng.new_working_set())
        f = host.calls["channels"].create("float32", 1)
        p = rec(ws=ws, embed=[5], geometry=rec(window=1, fold=Variant("from-channel", f)),
                readout=rec(rows=[0], kind=Variant("none", None)), epilogue=None)
        fn = host.functions()["forward"]["run-loop"]
        assert call_checked(host, wasmtime.Store(), "forward.run-loop", fn, [p, 3]) == "invalid-argument"
        with pytest.raises(PieError, match="a fold is read from a u32 or i32 channel, not float32"):
            fn(p, 3)
    finally:
        host.release_all()

