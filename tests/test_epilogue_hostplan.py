"""The generated host plan (hostplan.py) against the interpreter, on the same inputs."""

import copy

import numpy as np
import pytest
import torch

from guest import trace
from host.epilogue import SimpleChannel, compile_program
from host.epilogue.env import Env

Program = trace.Program
CHANNELS = {"out": 5, "win": 2, "more": 3}  # name -> capacity, all i64 (argmax's dtype)


def greedy(max_tokens=6, eos=(2, 5)):
    """A greedy decode program: argmax, put, set, a constant fold, stop at EOS or a round limit
    (text-completion's before its loop ended on an empty window instead)."""
    p = Program()
    p.channel("out", "i64", 5)
    p.channel("win", "i64", 2)
    tok = p.logits().argmax()
    p.put("out", tok)
    p.set("win", tok)
    p.fold(p.const(1))
    done = p.round() >= max_tokens - 1
    first = tok[0]
    for e in eos:
        done = done | (first == e)
    p.stop_if(done)
    return p


def no_effects(eos=(2, 5)):
    """No fold and no stop (the pass's fold and an empty window end it): the next window is set
    with a count, none after EOS."""
    p = Program()
    p.channel("out", "i64", 5)
    p.channel("win", "i64", 2)
    tok = p.logits().argmax()
    p.put("out", tok)
    eos_seen = p.const(False)
    for e in eos:
        eos_seen = eos_seen | (tok[0] == e)
    p.set("win", tok, count=p.where(eos_seen, 0, 1))
    return p


def scalars():
    """Every kind of op the plan takes: host counts, clamped folds, wrapping i64, size, where, logic."""
    p = Program(window=3)
    for name, cap in CHANNELS.items():
        p.channel(name, "i64", cap)
    x = p.logits()
    tok = x.argmax()
    r, n = p.round(), p.length("out")
    k = p.minimum(r % 3 + 1, p.maximum(n - 2, 1))
    p.put("out", tok, count=k)
    p.set("win", tok, count=r // 0 + p.where(r > 1, 5, 0) - r % 0)
    p.put("more", tok, count=n - 4)
    p.fold(p.minimum(p.where(r > 2, -r, abs(-r) * 100 + x.size(0) - 2), 3))  # negative from round 3
    big = p.const(2 ** 62) * 4 + r  # wraps to r, as on the device
    p.stop_if(~((n + r) >= 6) ^ (tok[-1] != 3) & (big == r) | (tok[0] < 0))
    return p


def env(rnd, lengths, R=2, V=7, window=3, seed=0, as_numpy=True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, V, generator=g)
    chans = {}
    for name, cap in CHANNELS.items():
        buf = torch.randint(0, 9, (cap,), generator=g)
        chans[name] = SimpleChannel(buf, lengths.get(name, 0), buf.numpy())
    return Env(logits=logits.numpy() if as_numpy else logits, channels=chans, round=rnd, window_len=window)


def results_equal(a, b) -> bool:
    if (a.fold, bool(a.stop) if a.stop is not None else None) != (b.fold, bool(b.stop) if b.stop is not None else None):
        return False
    if a.channels.keys() != b.channels.keys():
        return False
    return all((int(a.channels[k].length), bool(a.channels[k].overflow)) ==
               (int(b.channels[k].length), bool(b.channels[k].overflow))
               and torch.equal(a.channels[k].buf, b.channels[k].buf) for k in a.channels)


@pytest.mark.parametrize("make", [greedy, no_effects, scalars])
def test_plan_matches_the_interpreter(make):
    prog = compile_program(make().to_json())
    assert prog._plan is not None
    checked = 0
    for rnd in range(5):
        for out_len in (0, 2, 4, 5):
            for seed in range(3):
                e1 = env(rnd, {"out": out_len, "more": out_len // 2}, seed=seed)
                e2 = copy.deepcopy(e1)
                for ch in e2.channels.values():
                    ch.host = ch.buf.numpy()  # deepcopy gives the array its own memory
                bind = prog._bind(e1)
                planned = prog._plan(e1, bind)
                interpreted = prog._run_batch([e2], bind, False)[0]
                assert results_equal(planned, interpreted), (rnd, out_len, seed, prog._plan.source)
                checked += 1
    assert checked == 60
    if make is no_effects:  # the plan reports no fold and no stop, as the interpreter does
        res = prog._plan(env(0, {}), prog._bind(env(0, {})))
        assert res.fold is None and res.stop is None


def test_run_takes_the_plan_and_falls_back_where_it_cannot():
    prog = compile_program(greedy().to_json())
    calls = []
    interpret = prog._run_batch
    prog._run_batch = lambda *a: calls.append(1) or interpret(*a)
    try:
        res = prog.run([env(0, {})])[0]
        assert not calls and res.channels["out"].length == 2  # a token per readout row
        # float64 logits are not a host float32 array: the interpreter runs them, with the same result
        e = env(0, {})
        e.logits = e.logits.astype(np.float64)
        res = prog.run([e])[0]
        assert calls and res.channels["out"].length == 2  # a token per readout row
        # a torch tensor in host memory takes the plan too
        calls.clear()
        assert prog.run([env(1, {}, as_numpy=False)])[0].fold == 1 and not calls
    finally:
        del prog._run_batch


@pytest.mark.parametrize("body", ["softmax", "window", "sample", "f32 const"])
def test_programs_that_need_tensors_have_no_plan(body):
    p = Program()
    p.channel("out", "i64", 4)
    x = p.logits()
    if body == "softmax":
        tok = x.softmax().argmax()
    elif body == "window":
        tok = p.window()
    elif body == "sample":
        tok = p.sample(x, temperature=0.7)
    else:
        tok = (x * 2.0).argmax()
    p.put("out", tok)
    assert compile_program(p.to_json())._plan is None
