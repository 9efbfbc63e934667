"""Per-instance budgets (issue 22): channel cells, handles, readout rows, output, guest logs,
the store's memories and tables, time (device loops charged to the CPU-time budget, wall time)
and cancellation; on the tiny model."""

from __future__ import annotations

import threading

import pytest

from host.errors import PieError
from host.runtime.limits import Limits

from test_containment import call_checked, tiny_runtime  # noqa: F401 (a fixture)


def rec(**fields):
    from wasmtime.component import Record

    r = Record()
    for k, v in fields.items():
        setattr(r, k, v)
    return r


@pytest.fixture
def host(tiny):
    from host.runtime.bindings import InstanceHost

    made = []

    def make(**limits):
        h = InstanceHost(tiny[0], None, [], 60.0, 0.01, limits=Limits(**limits))
        made.append(h)
        return h
    yield make
    for h in made:
        h.release_all()


def call(h, name, *args):
    """Host function `name` as the guest calls it: its error code, or None."""
    import wasmtime

    iface, fname = name.split(".")
    return call_checked(h, wasmtime.Store(), name, h.functions()[iface][fname], list(args))


def test_the_channels_of_an_instance_share_one_cell_budget(host):
    h = host(channel_cells=100)
    a = h.calls["channels"].create("uint32", 60)
    assert call(h, "channels.create", "uint32", 41) == "invalid-argument"
    with pytest.raises(PieError, match=r"hold 60 of its 100 cells \(--channel-cells\)"):
        h.calls["channels"].create("float32", 41)
    h.calls["channels"].create("float32", 40)  # what is left
    h.calls["channels"].release(a)
    h.calls["channels"].create("boolean", 60)  # released cells count no more
    assert h.cells == 100


def test_live_handles_are_bounded_and_a_refused_fork_holds_no_pages(host, tiny):
    eng = tiny[0]
    h = host(handles=3)
    ws = call_ok(h, "working-sets.create")
    call_ok(h, "working-sets.fork", ws)
    h.calls["channels"].create("uint32", 4)
    for name, args in [("working-sets.create", ()), ("working-sets.fork", (ws,)), ("channels.create", ("uint32", 4)),
                       ("forward.create-sampler", (0.0, 1.0, 0))]:
        assert call(h, name, *args) == "invalid-argument", name
    with pytest.raises(PieError, match="the inferlet holds 3 handles, its limit \\(--handles\\)"):
        h._new(lambda: None)
    h.release_all()
    assert eng.pool.free_pages == eng.pool.num_pages


def call_ok(h, name, *args):
    iface, fname = name.split(".")
    return h.functions()[iface][fname](*args)


def test_readout_rows_per_pass_are_bounded(host):
    from wasmtime.component import Variant

    h = host(readout_rows=4)
    ws = call_ok(h, "working-sets.create")

    def ps(rows):
        return rec(ws=ws, embed=[5, 6, 7, 8], geometry=rec(window=4, fold=Variant("all", None)),
                   readout=rec(rows=rows, kind=Variant("argmax", None)), epilogue=None)
    assert call(h, "forward.execute", ps([0, 0, 0, 0, 0])) == "invalid-argument"  # repeated rows count
    with pytest.raises(PieError, match=r"5 readout rows in one pass, more than its limit of 4 \(--readout-rows\)"):
        h.calls["forward"]._pass(ps([3] * 5), None)
    h.calls["forward"]._pass(ps([0, 1, 2, 3]), None)


def test_output_is_bounded_send_ends_the_instance_emit_is_refused(host):
    h = host(output_bytes=40)
    h.send("x" * 30)
    assert call(h, "runtime.emit", [5, 6, 7]) == "invalid-argument"  # 12 bytes more: refused, nothing kept
    assert h.token_ids == []
    call_ok(h, "runtime.emit", [5, 6])
    assert call(h, "runtime.send", "y" * 20) == "invalid-argument"  # send has no error: the instance ends
    assert "past its limit of 40 bytes (--output-mb)" in h.fatal


def test_the_store_limits_bound_all_memories_and_tables():
    import wasmtime

    limits = Limits(memory_bytes=2 << 20)
    engine = wasmtime.Engine()

    def instance(wat):
        store = wasmtime.Store(engine)
        store.set_limits(**limits.store_limits())
        return store, wasmtime.Instance(store, wasmtime.Module(engine, wat), [])

    with pytest.raises(wasmtime.WasmtimeError, match="memory count too high"):  # a second memory
        instance("(module (memory 1) (memory 1))")
    store, inst = instance('(module (memory (export "m") 1) (func (export "grow") (param i32) (result i32)'
                           ' (memory.grow (local.get 0))))')
    assert inst.exports(store)["grow"](store, 64) == -1  # past 2 MiB (pages of 64 KiB)
    assert inst.exports(store)["grow"](store, 31) == 1
    store, inst = instance('(module (table 1 funcref) (func (export "grow") (param i32) (result i32)'
                           ' (table.grow (ref.null func) (local.get 0))))')
    assert inst.exports(store)["grow"](store, 100_000_000) == -1
    with pytest.raises(wasmtime.WasmtimeError, match="table count too high"):
        instance("(module " + "(table 1 funcref) " * (limits.tables + 1) + ")")


def test_pie_run_flags_derive_from_the_limits():
    import argparse

    from host.runtime.limits import add_flags, from_args

    p = argparse.ArgumentParser()
    add_flags(p)
    assert from_args(p.parse_args([])) == Limits()
    got = from_args(p.parse_args(["--memory-mb", "64", "--log-kb", "2", "--readout-rows", "3", "--cpu-time", "1.5"]))
    assert (got.memory_bytes, got.log_bytes, got.readout_rows, got.cpu_time_s) == (64 << 20, 2048, 3, 1.5)
    with pytest.raises(PieError, match="kv-share"):
        from_args(p.parse_args(["--kv-share", "0"]))


def test_security_md_lists_every_limit_with_its_default_and_flag():
    from pathlib import Path

    from host.runtime.limits import table

    text = (Path(__file__).resolve().parents[1] / "SECURITY.md").read_text()
    assert table() in text, "SECURITY.md's table differs from `python -m host.runtime.limits`"


# ---- whole instances ---------------------------------------------------------------------------

def misbehave(rt, mode, on_text=None, **limits):
    from wasm_fixtures import build_test_inferlet

    return rt.start(build_test_inferlet("misbehave"), ["--mode", mode], on_text=on_text,
                    limits=Limits(**limits) if limits else None)


def finished(handle):
    """The run's result; one still running is cancelled (so a failing test does not hang) and fails."""
    try:
        return handle.result(timeout=120)
    except TimeoutError:
        handle.cancel("the test gave up")
        raise


@pytest.mark.wasm
def test_a_device_loop_is_charged_to_the_compute_time_budget(tiny_runtime, tiny):
    r = finished(misbehave(tiny_runtime, "endless-loop", compute_time_s=2.0))  # ran forever before
    assert not r.ok and "compute-time limit of 2 s (--compute-time)" in r.error, r.error
    assert r.stats["passes"] > 1, r.stats
    assert tiny[0].pool.free_pages == tiny[0].pool.num_pages


def test_loop_rounds_are_not_charged_to_the_cpu_time_budget(tiny):
    """Issue 40: a long generation is model time; charged to the guest's 60 s of CPU time, every
    request past a minute of decoding was killed as a runaway guest."""
    from host.runtime.bindings.core import Instance
    from host.runtime.errors import Cancelled

    host = Instance(tiny[0], None, [], cpu_time_s=1.0, epoch_tick_s=0.01, limits=Limits(compute_time_s=5.0))
    host.count_round(None, 1, 1, cost_s=3.0)  # past the CPU-time budget, within the compute-time one
    assert host.fatal is None and host.passes == 1
    with pytest.raises(Cancelled, match=r"compute-time limit of 5 s \(--compute-time\)"):
        host.count_round(None, 1, 1, cost_s=3.0)


@pytest.mark.wasm
def test_the_cpu_time_budget_charges_the_guest_thread_cpu_not_its_sleep(tiny_runtime):
    """A guest asleep for 1.5 s (WASI clocks) under a 0.5 s CPU-time budget finishes; one that
    spins is stopped. Time a guest sleeps, or waits for a core on a loaded machine, is not CPU."""
    r = finished(misbehave(tiny_runtime, "sleep", cpu_time_s=0.5))
    assert r.ok and r.text == "slept" and r.stats["wall_s"] >= 1.5, (r.error, r.stats)
    r = finished(misbehave(tiny_runtime, "loop", cpu_time_s=0.5))
    assert not r.ok and "CPU-time limit of 0.5 s" in r.error, r.error


@pytest.mark.wasm
@pytest.mark.parametrize("mode", ["endless-loop", "loop"])  # blocked on its loop; spinning in the guest
def test_a_running_instance_can_be_cancelled(tiny_runtime, tiny, mode):
    started = threading.Event()
    handle = misbehave(tiny_runtime, mode, on_text=lambda s: started.set())
    if mode == "endless-loop":
        assert started.wait(120)  # its loop is running
    tiny_runtime.cancel(handle, "the client went away")
    r = finished(handle)
    assert not r.ok and r.error == "cancelled: the client went away", r.error
    assert tiny[0].pool.free_pages == tiny[0].pool.num_pages
    assert finished(misbehave(tiny_runtime, "channels")).ok  # the runtime serves the next one


@pytest.mark.wasm
def test_the_wall_time_limit_cancels_the_run(tiny_runtime):
    r = finished(misbehave(tiny_runtime, "loop", wall_time_s=0.3))
    assert not r.ok and "wall-time limit of 0.3 s (--wall-time)" in r.error, r.error


@pytest.mark.wasm
def test_guest_output_past_the_log_limit_ends_the_run_and_only_its_tail_is_kept(tiny_runtime):
    r = finished(misbehave(tiny_runtime, "print", log_bytes=64 << 10, cpu_time_s=30.0))
    assert not r.ok and "more than 65536 bytes to stdout/stderr (--log-kb)" in r.error, r.error
    assert r.log.startswith("[") and "bytes of guest output left out]" in r.log.splitlines()[0]
    assert len(r.log) < (64 << 10) + 100
