"""A program's plan for host memory (values read early, numpy where it is faster) against the
plan a device gets (every value a tensor until the readback), on the same inputs."""

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


def run_as(prog, envs, host: bool, keep=False):
    """Run with the plan for host memory, or with the one a device gets (no value read early)."""
    from host.epilogue import plan
    fn = plan.build(prog.checked, host, len(envs), keep, prog._shaped)
    return fn(envs, prog._bind(envs[0]), torch.device("cpu")), fn.source


def fresh(e):
    e2 = copy.deepcopy(e)
    for ch in e2.channels.values():
        ch.host = ch.buf.numpy()  # deepcopy gives the array its own memory
    return e2


@pytest.mark.parametrize("make", [greedy, no_effects, scalars])
def test_host_plan_matches_the_device_plan(make):
    prog = compile_program(make().to_json())
    checked = 0
    for rnd in range(5):
        for out_len in (0, 2, 4, 5):
            for seed in range(3):
                e1 = env(rnd, {"out": out_len, "more": out_len // 2}, seed=seed)
                e2 = fresh(e1)
                (on_host,), src = run_as(prog, [e1], True)
                (on_device,), _ = run_as(prog, [e2], False)
                assert results_equal(on_host, on_device), (rnd, out_len, seed, src)
                checked += 1
    assert checked == 60
    if make is no_effects:  # no fold and no stop are reported
        res = prog.run([env(0, {})])[0]
        assert res.fold is None and res.stop is None


@pytest.mark.parametrize("make", [greedy, scalars])
def test_a_batch_equals_its_passes_alone(make):
    prog = compile_program(make().to_json())
    envs = [env(r, {"out": r % 5, "more": 1}, seed=r) for r in range(4)]
    alone = [prog.run([fresh(e)])[0] for e in envs]
    for host in (True, False):
        together, _ = run_as(prog, [fresh(e) for e in envs], host)
        assert all(results_equal(a, b) for a, b in zip(together, alone))


def test_a_greedy_round_in_host_memory_makes_no_tensor():
    """text-completion's shape of program: numpy's argmax, host scalars, no torch call, no implementation."""
    prog = compile_program(no_effects().to_json())
    (res,), src = run_as(prog, [env(0, {})], True)
    assert "torch." not in src and "k" not in {line.strip()[:1] for line in src.splitlines()}, src
    assert "argmax" in src and res.channels["out"].length == 2
    # float64 logits and tensors in host memory take the same plan, with the same result
    e = env(0, {})
    e.logits = e.logits.astype(np.float64)
    assert prog.run([e])[0].channels["out"].length == 2
    assert prog.run([env(1, {}, as_numpy=False)])[0].channels["out"].length == 2


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cacheback_host_plan_matches_the_device_plan(temperature):
    """The whole cacheback round (lookup, LRU, verification, gate), host forms against tensors."""
    from guest import cacheback
    text, chans = cacheback.cacheback_program(prompt=[5, 6, 7, 5, 6, 7, 5], draft_len_max=3,
                                                lookup_window=10, lru_size=4, max_tokens=30, temperature=temperature)
    prog = compile_program(text)
    g = torch.Generator().manual_seed(3)
    hist = torch.tensor([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 8, 5, 6])
    for rnd in range(6):
        W = 1 + rnd % 4
        logits = torch.randn(W, 11, generator=g) * 3
        outs = []
        for host in (True, False):
            chs = {c["name"]: SimpleChannel(torch.tensor(c["init"] + [0] * (c["capacity"] - len(c["init"])),
                                                         dtype=torch.int64), len(c["init"])) for c in chans}
            e = Env(logits=logits.clone(), window=hist[-W:].clone(), history=hist.clone(), channels=chs,
                    seed=7, round=rnd)
            (r,), src = run_as(prog, [e], host)
            outs.append((r, chs))
        (a, ca), (b, cb) = outs
        assert int(a.fold) == int(b.fold) and bool(a.stop) == bool(b.stop)
        for name in ca:
            assert torch.equal(ca[name].buf, cb[name].buf), name
            if name in a.channels:
                assert int(a.channels[name].length) == int(b.channels[name].length), name


def _variant_cases():
    """(op, variant index, plan for host memory?, program builder): a program whose plan takes it."""
    def greedy_tok():
        return greedy()

    def ngram(length):
        p = Program()
        p.channel("out", "i64", 8)
        toks, cnt = p.ngram_lookup(p.history(), 3, 1, 2, length=p.const(6) if length else None)
        p.put("out", toks, cnt)
        return p

    def dyn_slice(device_len):
        p = Program()
        p.channel("out", "i64", 8)
        h = p.history()
        p.put("out", p.dyn_slice(h, p.const(1), h[4] + 1 if device_len else p.const(3), size=4))
        return p

    def pack(device_len):
        p = Program()
        p.channel("out", "i64", 8)
        h = p.history()
        p.put("out", p.pack(h, p.const(2), h, h[3] if device_len else p.const(2), size=6))
        return p

    def lru():
        p = Program()
        p.channel("t", "i64", 4 * 3)
        p.channel("s", "i64", 4)
        h = p.history()
        t, s = p.lru_update(p.read("t"), p.read("s"), h[:4], p.const(4), p.const(2), g=2, k=1)
        p.set("t", t)
        p.set("s", s)
        return p

    def suffix():  # no index is bound here: test_suffix_index runs both paths over one
        p = Program()
        p.channel("out", "i64", 8)
        toks, cnt, _, _ = p.suffix_draft(p.history(), p.const(6), 3)
        p.put("out", toks, cnt)
        return p

    def where():
        p = Program(window=3)
        p.channel("out", "i64", 8)
        w = p.window()
        p.put("out", p.where(p.round() > 1, w, w + 1))
        return p

    def cast():
        p = Program()
        p.channel("out", "i64", 8)
        p.put("out", p.history()[:2], p.cast(p.round() > 1, "i64") + 1)
        return p

    def on_window(fn):
        """An op on the window (an array in host memory) and a cell of the history, both i64, then a
        bool of the first cells; the result (cast to i64 if bool) goes to "out"."""
        def make():
            p = Program(window=3)
            p.channel("out", "i64", 8)
            w, h = p.window(), p.history()
            r = fn(p, w, h[3], w < 7)
            p.put("out", r.cast("i64") if r.dtype == "bool" else r)
            return p
        return make

    binary = {"add": lambda p, w, x, c: w + x, "sub": lambda p, w, x, c: x - w, "mul": lambda p, w, x, c: w * x,
              "minimum": lambda p, w, x, c: p.minimum(w, x), "maximum": lambda p, w, x, c: p.maximum(w, x),
              "eq": lambda p, w, x, c: w == x, "ne": lambda p, w, x, c: w != x, "lt": lambda p, w, x, c: w < x,
              "le": lambda p, w, x, c: w <= x, "gt": lambda p, w, x, c: w > x, "ge": lambda p, w, x, c: w >= x,
              "and": lambda p, w, x, c: c & (w == 3), "or": lambda p, w, x, c: c | (w == 3),
              "xor": lambda p, w, x, c: c ^ (w == 3), "not": lambda p, w, x, c: ~c}
    arrays = [(name, 0, True, on_window(fn)) for name, fn in binary.items()] + [
        ("where", 1, True, on_window(lambda p, w, x, c: p.where(c, w, x))),
        ("cast", 1, True, on_window(lambda p, w, x, c: (w - 3).cast("bool"))),
        ("any", 0, True, on_window(lambda p, w, x, c: p.where(c.any(), w, x))),
        ("all", 0, True, on_window(lambda p, w, x, c: p.where(c.all(), w, x))),
        ("slice", 0, True, on_window(lambda p, w, x, c: w[1:])),
        ("concat", 0, True, on_window(lambda p, w, x, c: p.concat(w[1:], w))),
        ("verify_greedy", 0, True, on_window(lambda p, w, x, c: p.verify_greedy(w[1:], p.history()[2:5])[1]))]
    return arrays + [
        ("argmax", 0, True, greedy_tok), ("index", 0, True, greedy_tok),
        ("ngram_lookup", 0, True, lambda: ngram(False)), ("ngram_lookup", 1, True, lambda: ngram(True)),
        ("dyn_slice", 0, True, lambda: dyn_slice(False)), ("dyn_slice", 1, False, lambda: dyn_slice(False)),
        ("dyn_slice", 2, False, lambda: dyn_slice(True)),
        ("pack", 0, True, lambda: pack(False)), ("pack", 1, False, lambda: pack(False)),
        ("pack", 2, False, lambda: pack(True)),
        ("lru_update", 0, True, lru), ("suffix_draft", 0, True, suffix), ("where", 0, True, where),
        ("cast", 0, True, cast)]


CASES = _variant_cases()


def test_every_variant_has_a_case():
    from host.epilogue.ops import OPS
    declared = {(name, j) for name, spec in OPS.items() for j in range(len(spec.variants))}
    assert declared == {(op, j) for op, j, _, _ in CASES}


@pytest.mark.parametrize("op,j,host,make", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_each_variant_is_taken_and_equals_the_implementation(op, j, host, make):
    """The plan takes the variant (its name is in the generated source) and gives what the plan
    for the other situation gives (host memory against a device: other implementations)."""
    prog = compile_program(make().to_json())
    hist = torch.tensor([7, 3, 7, 3, 1, 7, 3, 2])
    results = []
    for on_host in (host, not host):
        chans = {name: SimpleChannel(torch.full((ch.capacity,), -1, dtype=torch.int64), 0)
                 for name, ch in prog.checked.channels.items()}
        e = Env(logits=torch.randn(2, 7, generator=torch.Generator().manual_seed(1)), window=hist[:3].clone(),
                history=hist.clone(), channels=chans, round=2, window_len=3)
        (res,), src = run_as(prog, [e], on_host)
        if on_host == host:
            name = f"{op}{[o.index for o in prog.checked.ops if o.name == op][0]}_v{j}"
            assert f"{name}(" in src or f"# {name}" in src, src  # called, or written inline
        results.append((res, chans))
    (a, ca), (b, cb) = results
    assert results_equal(a, b)
    assert all(torch.equal(ca[k].buf, cb[k].buf) for k in ca)
