"""The device loop on the tiny model: epilogues sample, fold and refill the window on the device."""

from __future__ import annotations

import pytest
import torch

from host.engine import Pass
from host.engine.loop import DeviceLoop
from host.engine.scheduler import Scheduler
from host.epilogue import compile_program

from guest import cells, chan, plain_greedy, trace

# every test here runs with both scalar paths of the executor (see conftest.scalar_path)
pytestmark = pytest.mark.usefixtures("scalar_path")


def greedy_program(limit: int, eos: int) -> str:
    p = trace.Program(window=1, readout=1)
    p.channel("out", "i64", 256)
    p.channel("window", "i64", 1)
    tok = p.logits().argmax()
    p.put("out", tok)
    p.set("window", tok)
    p.fold(p.const(1))
    p.stop_if((tok[0] == eos) | (p.length("out") + 1 >= limit))
    return p.to_json()


def start_greedy_loop(sched, eng, prompt, limit, rounds=1000):
    ws = eng.new_working_set()
    eng.forward([Pass(ws, prompt[:-1], [0])])
    out, win = chan(256), chan(1, [prompt[-1]])
    loop = DeviceLoop(ws, compile_program(greedy_program(limit, eos=-5)), {"out": out, "window": win}, win,
                      max_window=1, rounds=rounds)
    return ws, out, sched.start_loop(loop)


def test_loop_equals_plain_greedy_and_batches(tiny):
    eng, _ = tiny
    sched = Scheduler(eng)
    try:
        prompts = [[5, 9, 13, 4], [7, 8], [30, 31, 32, 33, 34, 35]]
        want = [plain_greedy(eng, p, 12) for p in prompts]
        runs = [start_greedy_loop(sched, eng, p, 12) for p in prompts]
        for (ws, out, fut), w in zip(runs, want):
            stats = fut.result(timeout=60)
            assert cells(out) == w
            assert stats.rounds == 12 and stats.drafted == 0
            assert ws.frozen == len(prompts[runs.index((ws, out, fut))]) + 11
    finally:
        sched.close()


def test_round_limit_and_no_page_leak(tiny):
    eng, _ = tiny
    sched = Scheduler(eng)
    free = eng.pool.free_pages
    try:
        for _ in range(3):
            ws, out, fut = start_greedy_loop(sched, eng, [3, 4, 5], limit=10_000, rounds=20)
            assert fut.result(timeout=60).rounds == 20 and len(cells(out)) == 20
            eng.release(ws)
        assert eng.pool.free_pages == free
    finally:
        sched.close()


@pytest.mark.parametrize("keep", [0, 2, 4])
def test_fold_from_the_epilogue_keeps_0_some_all(tiny, keep):
    eng, ref = tiny
    sched = Scheduler(eng)
    try:
        ws = eng.new_working_set()
        eng.forward([Pass(ws, [3, 4, 5], [0])])
        p = trace.Program(window=4, readout=4)
        p.channel("window", "i64", 4)
        p.fold(p.minimum(p.const(keep), p.window().size()))
        win = chan(4, [10, 11, 12, 13])
        loop = DeviceLoop(ws, compile_program(p.to_json()), {"window": win}, win, max_window=4, rounds=1)
        stats = sched.start_loop(loop).result(timeout=60)
        assert ws.frozen == 3 + keep and ws.tokens == [3, 4, 5] + [10, 11, 12, 13][:keep]
        assert stats.accepted == max(keep - 1, 0) and stats.drafted == 3
        (o,) = eng.forward([Pass(ws, [20], [0])])
        with torch.inference_mode():  # the scratch rows past the fold are never attended
            expect = ref(torch.tensor([ws.tokens])).logits[0, -1]
        assert torch.allclose(o.logits[0], expect, atol=1e-4)
    finally:
        sched.close()


def test_thousands_of_rounds_leak_nothing(tiny):
    import gc

    eng, _ = tiny
    sched = Scheduler(eng)
    try:
        ws = eng.new_working_set()
        eng.forward([Pass(ws, [3, 4, 5], [0])])
        free = eng.pool.free_pages
        p = trace.Program(window=1, readout=1)
        p.channel("window", "i64", 1)
        p.channel("out", "i64", 1)
        tok = p.logits().argmax()
        p.set("out", tok)  # overwrite: the channel never grows
        p.set("window", tok)
        p.fold(p.const(0))  # nothing freezes: the same rows are rewritten every round
        prog = compile_program(p.to_json())

        def run(rounds):
            win, out = chan(1, [7]), chan(1)
            loop = DeviceLoop(ws, prog, {"window": win, "out": out}, win, max_window=1, rounds=rounds)
            return sched.start_loop(loop).result(timeout=300)

        run(50)
        gc.collect()
        before = len(gc.get_objects())
        stats = run(3000)
        gc.collect()
        assert stats.rounds == 3000 and ws.frozen == 3
        assert eng.pool.free_pages == free
        assert len(gc.get_objects()) - before < 200
        assert not sched._loops
    finally:
        sched.close()


@pytest.mark.parametrize("memory", ["host", "device"])
def test_window_with_a_token_outside_the_vocabulary_fails_that_loop_only(tiny, memory):
    # host: the runtime's channels (host memory here): the window reaches the engine as host
    # ints, validated like any pass's tokens. device: a channel without a host view, as on CUDA:
    # the ids stay on the device, clamped for the pass and checked on the host after it.
    # Either way the loop fails alone, commits nothing, and the loop sharing its batch runs on.
    from host.errors import InvalidArgument
    from host.runtime.channels import Channel
    eng, _ = tiny
    sched = Scheduler(eng)
    try:
        bad_ws = eng.new_working_set()
        if memory == "host":
            out, win = Channel("uint32", 256, eng.device), Channel("uint32", 1, eng.device)
            win.put([eng.info.vocab_size + 3])
        else:
            out, win = chan(256), chan(1, [eng.info.vocab_size + 3])
        bad = sched.start_loop(DeviceLoop(bad_ws, compile_program(greedy_program(8, eos=-5)),
                                          {"out": out, "window": win}, win, max_window=1, rounds=8))
        ws, good_out, good = start_greedy_loop(sched, eng, [5, 9, 13, 4], 8)
        with pytest.raises(InvalidArgument, match=f"token id {eng.info.vocab_size + 3} is outside the vocabulary"):
            bad.result(timeout=60)
        assert bad_ws.frozen == 0 and out.length == 0
        good.result(timeout=60)
        assert cells(good_out) == plain_greedy(eng, [5, 9, 13, 4], 8)
    finally:
        sched.close()


def test_batched_loops_share_the_step_time_they_are_charged(tiny):
    """Each round is charged its rows' share of the batched step (the compute-time budget's clock):
    loops running together are charged, in all, no more than the time they ran, not each the whole step."""
    import time

    eng, _ = tiny
    sched = Scheduler(eng)
    charged, sets, loops = [], [], []
    try:
        for p in ([5, 9, 13, 4], [7, 8], [30, 31, 32]):
            ws = eng.new_working_set()
            sets.append(ws)
            eng.forward([Pass(ws, p[:-1], [0])])
            out, win = chan(256), chan(1, [p[-1]])
            loops.append(DeviceLoop(ws, compile_program(greedy_program(10_000, eos=-5)), {"out": out, "window": win},
                                    win, max_window=1, rounds=8,
                                    on_round=lambda lp, w, f, cost: charged.append(cost)))
        t0 = time.perf_counter()
        futs = [sched.start_loop(lp) for lp in loops]
        for fut in futs:
            assert fut.result(timeout=60).rounds == 8
        wall = time.perf_counter() - t0
    finally:
        sched.close()
        for ws in sets:
            eng.release(ws)
    assert len(charged) == 24 and all(c > 0 for c in charged)
    assert sum(charged) <= wall
