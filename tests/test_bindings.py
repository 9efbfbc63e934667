"""The host side of WIT functions, called directly (no component): what a pass asks of the engine."""

import pytest
from wasmtime.component import Record, Variant

from guest import trace
from host.engine import Pass
from host.engine.compute import ComputeThread
from host.engine.scheduler import Scheduler
from host.runtime.bindings import InstanceHost
from host.runtime.sampling import argmax


def rec(**fields):
    r = Record()
    for k, v in fields.items():
        setattr(r, k, v)
    return r


def test_a_loop_whose_epilogue_reads_hidden_states_gets_them(tiny):
    """The `hidden` input is reachable through the WIT: the loop asks the engine for hidden states."""
    eng, _ = tiny
    host = InstanceHost(eng, None, [], 60.0, 0.01)
    try:
        p = trace.Program(readout=1)
        p.channel("out", "i64", 4)
        p.put("out", (p.hidden()[0] > 0).cast("i64")[:1])
        p.fold(p.const(1))
        out = host.calls["channels"].create("uint32", 4)
        ep = host.calls["forward"].register_epilogue(p.to_json(), [rec(name="out", channel=out)])
        ws = host._add(eng.new_working_set())
        pas = rec(ws=ws, embed=[5], geometry=rec(window=1, fold=Variant("from-epilogue", None)),
                  readout=rec(rows=[0], kind=Variant("none", None)), epilogue=rec(program=ep, seed=0))
        loop, _ = host.calls["forward"]._pass(pas, 1)
        assert loop.hidden
    finally:
        host.release_all()


@pytest.mark.parametrize("kind", ["argmax", "sample"])
def test_a_guest_decode_step_is_one_hop_to_the_compute_thread(tiny, monkeypatch, kind):
    """execute with an argmax or sample readout: the engine's step chooses the tokens where the
    logits are, so the inferlet thread hands work to the compute thread once (the step)."""
    eng, _ = tiny
    sched = Scheduler(eng)
    host = InstanceHost(eng, sched, [], 60.0, 0.01)
    hops = []
    real_submit, real_call = ComputeThread.submit, ComputeThread.call
    monkeypatch.setattr(ComputeThread, "submit", lambda self, *a, **k: hops.append("submit") or real_submit(self, *a, **k))
    monkeypatch.setattr(ComputeThread, "call", lambda self, *a, **k: hops.append("call") or real_call(self, *a, **k))
    try:
        ws = host._add(eng.new_working_set())
        readout_kind = Variant("argmax", None) if kind == "argmax" else Variant("sample", host.calls["forward"].create_sampler(0.8, 1.0, 3))
        p = rec(ws=ws, embed=[5, 9, 13], geometry=rec(window=3, fold=Variant("all", None)),
                readout=rec(rows=[1, 2], kind=readout_kind), epilogue=None)
        hops.clear()
        out = host.functions()["forward"]["execute"](p)
        assert hops == ["submit"], hops
        assert len(out.tokens) == 2 and all(0 <= t < eng.info.vocab_size for t in out.tokens)
        if kind == "argmax":
            ws2 = eng.new_working_set()
            (ref,) = eng.forward([Pass(ws2, [5, 9, 13], [1, 2])])
            assert out.tokens == argmax(ref.logits)
            eng.release(ws2)
    finally:
        host.release_all()
        sched.close()
