"""The LRU n-gram table ops and variable-window programs (dims {"R": "W"})."""

import json
import random

import pytest
import torch

from host.epilogue import Env, ProgramError, SimpleChannel, compile_program

from guest import trace
from op_reference import covers
from guest import reference as ref  # its plain-Python lru_lookup / lru_update are the references

# every test here runs with both scalar paths of the executor (see conftest.scalar_path)
pytestmark = pytest.mark.usefixtures("scalar_path")


def chan(values):
    return SimpleChannel(torch.tensor(values, dtype=torch.int64), torch.tensor(len(values), dtype=torch.int64))


def lru_program(S, g, k, n):
    """Reads table/stamps/seq channels, writes lookup results and the updated table."""
    p = trace.Program()
    for name, cap in (("table", S * (g + k)), ("stamps", S), ("seq", n), ("key", g), ("args", 2),
                      ("found", k + 1), ("table2", S * (g + k)), ("stamps2", S)):
        p.channel(name, "i64", cap)
    table, stamps, args = p.read("table"), p.read("stamps"), p.read("args")
    fol, cnt = p.lru_lookup(table, stamps, p.read("key"), g, k)
    p.set("found", p.concat(fol, p.where(p.arange(1) == 0, cnt, 0)))
    t2, s2 = p.lru_update(table, stamps, p.read("seq"), args[0], args[1], g, k)
    p.set("table2", t2)
    p.set("stamps2", s2)
    return compile_program(p.to_json())


def random_case(rng, S, g, k, n, vocab):
    table, stamps = [-1] * (S * (g + k)), [-1] * S
    for _ in range(rng.randrange(3)):  # some history in the table first
        seq = [rng.randrange(vocab) for _ in range(n)]
        table, stamps = ref.lru_update(table, stamps, seq, n, n, g, k)
    seq = [rng.choice([rng.randrange(vocab), -1]) if rng.random() < 0.1 else rng.randrange(vocab) for _ in range(n)]
    key = [rng.randrange(vocab) for _ in range(g)] if rng.random() < 0.5 else seq[:g]
    return table, stamps, seq, key, rng.randrange(n + 2), rng.randrange(-1, n + 2)


@covers('lru_lookup', 'lru_update')
@pytest.mark.parametrize("S,g,k,n,vocab", [(4, 2, 3, 12, 4), (8, 1, 2, 9, 3), (3, 3, 4, 16, 2), (16, 2, 5, 20, 6)])
def test_lru_ops_match_python_reference_batched(S, g, k, n, vocab):
    rng = random.Random(S * 100 + n)
    prog = lru_program(S, g, k, n)
    cases = [random_case(rng, S, g, k, n, vocab) for _ in range(24)]
    envs = [Env(channels={"table": chan(t), "stamps": chan(s), "seq": chan(q), "key": chan(key),
                          "args": chan([length, leaders]), "found": chan([0] * (k + 1)),
                          "table2": chan(t), "stamps2": chan(s)}) for t, s, q, key, length, leaders in cases]
    results = prog.run(envs)  # one batched call over all 24 cases
    for (t, s, q, key, length, leaders), r in zip(cases, results):
        want_f = ref.lru_lookup(t, s, key, g, k)
        got = r.channels["found"].buf.tolist()
        assert got[k] == len(want_f) and got[:k] == want_f + [-1] * (k - len(want_f))
        want_t, want_s = ref.lru_update(t, s, q, length, leaders, g, k)
        assert r.channels["table2"].buf.tolist() == want_t
        assert r.channels["stamps2"].buf.tolist() == want_s


def test_lru_evicts_least_recently_used_and_refreshes():
    g, k = 1, 1
    t, s = ref.lru_update([-1] * 4, [-1] * 2, [1, 10, 2, 20], 4, 3, g, k)  # 1->10, 10->2, 2->20: 1->10 evicted
    assert ref.lru_lookup(t, s, [1], g, k) == [] and ref.lru_lookup(t, s, [2], g, k) == [20]
    t, s = ref.lru_update(t, s, [10, 3], 2, 1, g, k)  # refresh 10 (now 10->3), so 2->20 is the oldest
    t, s = ref.lru_update(t, s, [7, 8], 2, 1, g, k)  # insert 7 evicts 2
    assert ref.lru_lookup(t, s, [10], g, k) == [3] and ref.lru_lookup(t, s, [2], g, k) == []
    assert ref.lru_lookup(t, s, [7], g, k) == [8]


def test_lru_rejects_bad_shapes():
    def bad(table_cap, key_len, seq_sym=False):
        obj = {"version": 1, "dims": {}, "channels": [
            {"name": "t", "dtype": "i64", "capacity": table_cap}, {"name": "s", "dtype": "i64", "capacity": 4},
            {"name": "k", "dtype": "i64", "capacity": key_len}],
            "inputs": [{"kind": "channel", "name": "t"}, {"kind": "channel", "name": "s"},
                       {"kind": "channel", "name": "k"}, {"kind": "window"}, {"kind": "round"}],
            "ops": [{"op": "lru_lookup", "args": [0, 1, 2], "attrs": {"g": 2, "k": 3}},
                    {"op": "lru_update", "args": [0, 1, 3 if seq_sym else 2, 4, 4], "attrs": {"g": 2, "k": 3}}]}
        return json.dumps(obj)

    compile_program(bad(20, 2))
    for text, needle in ((bad(21, 2), "op 0 (lru_lookup): shape mismatch"), (bad(20, 3), "key"),
                         (bad(20, 2, seq_sym=True), "op 1 (lru_update)")):
        with pytest.raises(ProgramError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            compile_program(text)


# --- variable windows ---------------------------------------------------------------

def spec_verify_program():
    p = trace.Program(readout="window")
    p.channel("out", "i64", 16)
    p.channel("window", "i64", 8)
    win = p.window()
    n, toks, cnt = p.verify_greedy(win[1:], p.logits().argmax())
    p.put("out", toks, cnt)
    p.set("window", toks, cnt)
    p.fold(n + 1)
    return p


@pytest.mark.parametrize("W", [1, 3, 5])
def test_symbolic_window_runs_for_any_size(W):
    p = spec_verify_program()
    assert p.to_dict()["dims"] == {"R": "W"}
    prog = compile_program(p.to_json())
    V = 7
    target = [3, 1, 4, 1, 5][:W]
    window = [0] + target[:2] + [6, 6][:max(W - 3, 0)]  # the first two drafts match
    window = window[:W]
    logits = torch.nn.functional.one_hot(torch.tensor(target), V).float()
    r = prog.run([Env(logits=logits, window=torch.tensor(window),
                      channels={"out": SimpleChannel.empty(16), "window": SimpleChannel.empty(8)})])[0]
    n = min(2, W - 1)
    assert int(r.fold) == n + 1
    assert r.channels["out"].buf[: int(r.channels["out"].length)].tolist() == target[: n + 1]


def test_symbolic_window_mismatches_still_rejected():
    def rejects(obj, needle):
        with pytest.raises(ProgramError, match=needle):
            compile_program(json.dumps(obj))

    ops = [{"op": "slice", "args": [1], "attrs": {"start": 1}}, {"op": "argmax", "args": [0]},
           {"op": "verify_greedy", "args": [2, 3]}]
    base = {"version": 1, "channels": [], "inputs": [{"kind": "logits"}, {"kind": "window"}], "ops": ops}
    compile_program(json.dumps({**base, "dims": {"R": "W"}}))
    rejects({**base, "dims": {}}, "op 2 .verify_greedy.: shape mismatch")  # R and W unrelated
    rejects({**base, "dims": {"R": "V"}}, "shape mismatch")  # R == V says nothing about W
    rejects({**base, "dims": {"R": 3, "W": 4}}, "shape mismatch")
    # drafts of W rows against a target of W rows: one row short
    rejects({**base, "dims": {"R": "W"}, "ops": ops[:2] + [{"op": "verify_greedy", "args": [1, 3]}]}, "shape mismatch")
    rejects({**base, "dims": {"R": "R"}}, "another symbol")
    rejects({**base, "dims": {"R": "W", "W": "N"}}, "itself an alias")
    rejects({**base, "dims": {"R": "X"}}, "another symbol")


def test_alias_checked_when_the_pass_binds():
    prog = compile_program(spec_verify_program().to_json())
    env = Env(logits=torch.zeros(3, 5), window=torch.tensor([0, 1]),
              channels={"out": SimpleChannel.empty(16), "window": SimpleChannel.empty(8)})
    with pytest.raises(ProgramError, match="R=W"):
        prog.run([env])


def test_tracer_rejects_bad_dim_alias():
    with pytest.raises(trace.TraceError):
        trace.Program(readout="readout")
    with pytest.raises(trace.TraceError):
        trace.Program(readout="bogus")


def test_lru_update_group_semantics_by_hand():
    """The documented rule on a worked example: the last of equal leaders counts, surplus new
    leaders drop the earliest, a refreshed row is never the one evicted, stamps go up in order."""
    prog = lru_program(2, 1, 1, 5)
    table, stamps = [-1] * 4, [-1] * 2
    seq = [5, 6, 5, 7, 8]  # leaders 5->6, 6->5, 5->7, 7->8: three distinct, two rows
    want = ([5, 7, 7, 8], [0, 1])
    assert ref.lru_update(table, stamps, seq, 5, 4, 1, 1) == want
    env = Env(channels={"table": chan(table), "stamps": chan(stamps), "seq": chan(seq), "key": chan([7]),
                        "args": chan([5, 4]), "found": chan([0, 0]), "table2": chan(table), "stamps2": chan(stamps)})
    r = prog.run([env])[0]
    assert (r.channels["table2"].buf.tolist(), r.channels["stamps2"].buf.tolist()) == want
    # 7 is refreshed (row 1), so the new leader 9 evicts row 0 although row 1 was older before
    assert ref.lru_update([5, 7, 7, 8], [1, 0], [7, 9, 4, 1, 1], 4, 2, 1, 1) == ([9, 4, 7, 9], [3, 2])


def test_lru_update_of_a_slice_before_the_history_leaves_the_table_alone():
    """A dyn_slice the host knows lies wholly before the history is all padding, so the update
    is skipped; the table must come out exactly as the full update would leave it."""
    S, g, k = 4, 2, 3
    table, stamps = ref.lru_update([-1] * (S * (g + k)), [-1] * S, [1, 2, 3, 4, 5, 6], 6, 6, g, k)
    outs = {}
    for start in (-20, 0):  # -20: all padding (skipped); 0: the real update
        p = trace.Program()
        p.channel("table", "i64", S * (g + k))
        p.channel("stamps", "i64", S)
        h = p.history()
        t, st = p.read("table"), p.read("stamps")
        seq = p.dyn_slice(h, start, h.size() - p.const(1) + h[0] * 0, size=8)  # a device length
        t2, s2 = p.lru_update(t, st, seq, p.const(8), p.const(8), g, k)
        p.set("table", t2)
        p.set("stamps", s2)
        chans = {"table": chan(table), "stamps": chan(stamps)}
        compile_program(p.to_json()).run([Env(history=torch.tensor([7, 8, 9, 7, 8, 4]), channels=chans)])
        outs[start] = (chans["table"].buf.tolist(), chans["stamps"].buf.tolist())
    assert outs[-20] == (table, stamps)
    assert outs[0] != (table, stamps)  # the same program with real tokens does write
