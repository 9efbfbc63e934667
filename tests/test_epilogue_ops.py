"""Each epilogue op against a plain torch reference (CPU), via traced programs."""


import numpy as np
import pytest
import torch

from host.epilogue import Env, SimpleChannel, apply_writes, compile_program


from guest import trace
from op_reference import covers

# every test here runs with both scalar paths of the executor (see conftest.scalar_path)
pytestmark = pytest.mark.usefixtures("scalar_path")

Program = trace.Program


def values(p, *outs, **env):
    prog = compile_program(p.to_json())
    r = prog.run([Env(**env)], keep_values=True)[0]
    final = p.to_dict()
    n_in = len(final["inputs"])
    idx = [p._where[o.id][1] + (n_in if p._where[o.id][0] == "op" else 0) for o in outs]
    return [r.values[i] for i in idx]


torch.manual_seed(0)
X = torch.randn(4, 6)
Y = torch.randn(4, 6)
I = torch.tensor([[3, -1, 0, 7, 2, 2], [1, 1, 1, 0, -5, 9], [0, 0, 0, 0, 0, 0], [5, 4, 3, 2, 1, 0]])


@covers('add', 'sub', 'mul', 'div', 'minimum', 'maximum', 'eq', 'ne', 'lt', 'le', 'gt', 'ge')
@pytest.mark.parametrize("name,ref", [
    ("add", torch.add), ("sub", torch.sub), ("mul", torch.mul), ("div", torch.div),
    ("minimum", torch.minimum), ("maximum", torch.maximum),
    ("eq", torch.eq), ("ne", torch.ne), ("lt", torch.lt), ("le", torch.le), ("gt", torch.gt), ("ge", torch.ge),
])
def test_binary_f32(name, ref):
    p = Program(vocab=6, hidden=6)
    a, b = p.logits(), p.hidden()
    out = p._bin(name, a, b)
    (got,) = values(p, out, logits=X, hidden=Y)
    assert torch.equal(got, ref(X, Y))


@covers('floordiv', 'mod', 'add', 'neg', 'abs', 'mul', 'minimum')
def test_int_ops_and_broadcast():
    p = Program()
    h = p.history()
    outs = [h // 3, h % 3, h + 1, -h, abs(h), h * h, p.minimum(h, 2), h // 0]
    got = values(p, *outs, history=I[3])
    r = I[3]
    for g, e in zip(got, [r // 3, r % 3, r + 1, -r, r.abs(), r * r, r.clamp(max=2), torch.zeros_like(r)]):
        assert torch.equal(g, e)


@covers('and', 'or', 'xor', 'not', 'where')
def test_logic_and_where():
    p = Program(vocab=6, hidden=6)
    a, b = p.logits(), p.hidden()
    c = (a > 0) & ~(b > 0) | ((a < -1) ^ (b < -1))
    w = p.where(c, a, b)
    g = values(p, c, w, logits=X, hidden=Y)
    ce = (X > 0) & ~(Y > 0) | ((X < -1) ^ (Y < -1))
    assert torch.equal(g[0], ce) and torch.equal(g[1], torch.where(ce, X, Y))


@covers('sum', 'prod', 'min', 'max', 'argmax', 'argmin', 'any', 'all', 'cumsum', 'cumprod')
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_reductions_and_scans(axis):
    p = Program()
    x = p.logits()
    b = x > 0
    outs = [x.sum(axis), x.prod(axis), x.min(axis), x.max(axis), x.argmax(axis), x.argmin(axis),
            b.any(axis), b.all(axis), b.sum(axis), x.cumsum(axis), b.cumprod(axis), b.cumsum(axis)]
    got = values(p, *outs, logits=X)
    bx = X > 0
    exp = [X.sum(axis), X.prod(axis), X.amin(axis), X.amax(axis), X.argmax(axis), X.argmin(axis),
           bx.any(axis), bx.all(axis), bx.sum(axis), X.cumsum(axis), bx.long().cumprod(axis), bx.long().cumsum(axis)]
    for g, e in zip(got, exp):
        assert g.dtype == e.dtype and torch.allclose(g.float(), e.float(), atol=1e-5)


@covers('softmax', 'top_k', 'top_p', 'exp', 'log', 'cast')
def test_softmax_topk_topp_exp_log_cast():
    p = Program()
    x = p.logits()
    outs = [x.softmax(0.7), x.top_k(2), x.top_p(0.5), x.exp(), x.exp().log(), x.cast("i64"), (x > 0).cast("f32")]
    got = values(p, *outs, logits=X)
    assert torch.allclose(got[0], torch.softmax(X / 0.7, -1))
    kth = X.topk(2, -1).values[:, -1:]
    assert torch.equal(got[1], X.masked_fill(X < kth, -torch.inf))
    # top-p reference: smallest set of top tokens whose mass reaches p
    for row, g in zip(X, got[2]):
        srt, order = row.sort(descending=True)
        pr = torch.softmax(srt, -1)
        keep_n = int((pr.cumsum(-1) < 0.5).sum()) + 1
        kept = set(order[:keep_n].tolist())
        assert {i for i in range(6) if g[i] != -torch.inf} == kept
    assert torch.allclose(got[3], X.exp()) and torch.allclose(got[4], X, atol=1e-5)
    assert torch.equal(got[5], X.to(torch.int64)) and torch.equal(got[6], (X > 0).float())


@covers('min_p')
def test_min_p():
    """An entry survives when its probability is at least p times the top one's (ties with the top kept)."""
    p = Program()
    x = p.logits()
    got = values(p, x.min_p(0.3), x.min_p(1.0), x.min_p(0.0), logits=X)
    probs = torch.softmax(X.double(), -1)
    keep = probs >= 0.3 * probs.max(-1, keepdim=True).values
    assert torch.equal(got[0] == -torch.inf, ~keep) and torch.equal(got[0][keep], X[keep])
    assert torch.equal(got[1] == -torch.inf, X < X.max(-1, keepdim=True).values)
    assert torch.equal(got[2], X)


@covers('scatter_add')
def test_scatter_add():
    """A logit bias: each value added at its index in every row; repeats add up; outside [0, V) ignored."""
    p = Program()
    x = p.logits()
    got = values(p, p.scatter_add(x, p.const([1, 5, 1, -1, 6]), p.const([0.5, -2.0, 0.25, 9.0, 9.0])), logits=X)
    want = X.clone()
    want[:, 1] += 0.75
    want[:, 5] += -2.0
    assert torch.equal(got[0], want)


@covers('index', 'slice', 'take', 'gather', 'concat', 'const', 'arange', 'full', 'size')
def test_index_slice_take_gather_concat_const_arange_full_size():
    p = Program(readout=4, vocab=6)
    x, h = p.logits(), p.history()
    outs = [x[1], x[-1], x[1:3], x[:, 2], x[:, -2:], h[I[0].clamp(0, 5).tolist()[0]:], p.take(h, p.const([2, -1, 9, 0])),
            p.gather(x, p.const([[0, 5], [1, 1], [-1, 2], [6, 3]])), p.concat(h[:2], p.const([7, 8])),
            p.arange(4, start=2), p.full([2, "V"], 1.5, "f32"), x.size(1), h[p.const([5, 0])]]
    got = values(p, *outs, logits=X, history=I[3])
    h0 = I[3]
    exp = [X[1], X[-1], X[1:3], X[:, 2], X[:, -2:], h0[3:], torch.tensor([3, -1, -1, 5]),
           torch.tensor([[X[0, 0], X[0, 5]], [X[1, 1], X[1, 1]], [0.0, X[2, 2]], [0.0, X[3, 3]]]),
           torch.tensor([5, 4, 7, 8]), torch.arange(2, 6), torch.full((2, 6), 1.5), torch.tensor(6),
           torch.tensor([0, 5])]
    for g, e in zip(got, exp):
        assert torch.equal(g, e.to(g.dtype)), (g, e)


@covers('pack', 'dyn_slice')
def test_pack_and_dyn_slice_with_device_lengths():
    p = Program()
    h = p.history()
    a = p.pack(h, 2, p.const([9, 8, 7]), p.const(2), size=6)
    b = p.pack(h, h[5] + 1, h, 0, size=3)  # h[5] = 0 -> take 1
    c = p.dyn_slice(h, 1, h[4] + 1, size=4)  # length 2
    d = p.dyn_slice(h, 4, 5, size=4)  # runs past the end -> -1
    got = values(p, a, b, c, d, history=I[3])
    assert got[0].tolist() == [5, 4, 9, 8, -1, -1]
    assert got[1].tolist() == [5, -1, -1]
    assert got[2].tolist() == [4, 3, -1, -1]
    assert got[3].tolist() == [1, 0, -1, -1]


def test_pack_and_dyn_slice_host_offsets_equal_device_offsets():
    """Offsets the host knows (constants) take a copy path; the same offsets as device values
    take the gather path: both must give the same cells for every in- and out-of-range case,
    also when only the start is known to the host."""
    hist = torch.tensor([11, 12, 13, 14, 15])
    cases = [(s, n) for s in (-3, -1, 0, 2, 4, 6) for n in (-1, 0, 2, 5, 9)]
    results = {}
    for start_on_host, len_on_host in ((True, True), (True, False), (False, False)):
        p = Program()
        h = p.history()
        nums = p.concat(h, p.const(list(range(-3, 10))))  # nums[8 + v] == v, computed on the device

        def val(v, on_host):
            return p.const(v) if on_host else nums[8 + v]

        outs = [p.dyn_slice(h, val(s, start_on_host), val(n, len_on_host), size=4) for s, n in cases]
        outs += [p.pack(h, val(s, start_on_host), h, val(n, len_on_host), size=7) for s, n in cases]
        results[start_on_host, len_on_host] = [g.tolist() for g in values(p, *outs, history=hist)]
    want = results[False, False]
    assert want[cases.index((2, 2))] == [13, 14, -1, -1]
    assert results[True, True] == want and results[True, False] == want


def ngram_ref(h, k, lo, hi):
    L = len(h)
    for n in range(hi, lo - 1, -1):
        if L < n + 1:
            continue
        suf = h[L - n:]
        for i in range(L - n - 1, -1, -1):
            if h[i:i + n] == suf:
                cont = h[i + n:i + n + k]
                return cont + [-1] * (k - len(cont)), len(cont)
    return [-1] * k, 0


@covers('ngram_lookup')
@pytest.mark.parametrize("hist,k,lo,hi", [
    ([1, 2, 3, 4, 1, 2, 3], 3, 1, 3),  # suffix 1 2 3 occurs at 0 -> 4 1 2
    ([1, 2, 3, 4, 1, 2, 3], 5, 1, 3),  # continuation runs into the suffix -> 4 1 2 3, count 4
    ([5, 6, 7, 8], 2, 1, 3),  # no match
    ([9, 1, 2, 8, 2, 7, 1, 2], 3, 1, 2),  # longest (2) wins over the more recent 1-gram
    ([3, 3, 3, 3], 2, 1, 3),  # overlapping matches
    ([4, 2, 9, 2, 5, 2], 2, 1, 1),  # most recent earlier occurrence of "2" -> 5 2
    ([7], 3, 1, 3),  # too short
])
def test_ngram_lookup(hist, k, lo, hi):
    p = Program()
    toks, cnt = p.ngram_lookup(p.history(), k, ngram_min=lo, ngram_max=hi)
    got = values(p, toks, cnt, history=torch.tensor(hist))
    et, ec = ngram_ref(hist, k, lo, hi)
    assert got[0].tolist() == et and int(got[1]) == ec


def test_ngram_lookup_random_against_reference():
    # small alphabets make many overlapping matches of every length; lengths cut the buffer short
    import random
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 40)
        hist = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(n)]
        k, lo = rng.randint(1, 6), rng.randint(1, 3)
        hi = rng.randint(lo, 4)
        L = rng.randint(0, n)
        p = Program()
        toks, cnt = p.ngram_lookup(p.history(), k, ngram_min=lo, ngram_max=hi, length=p.const(L))
        got = values(p, toks, cnt, history=torch.tensor(hist + [-1] * 3))
        et, ec = ngram_ref(hist[:L], k, lo, hi)
        assert (got[0].tolist(), int(got[1])) == (et, ec), (hist, L, k, lo, hi)


def test_ngram_lookup_host_equals_the_tensor_impl():
    # the CPU executor's byte search against the torch implementation: multi-byte token values (a
    # match may start mid-cell and must be skipped), padding inside the length, batches
    import random

    from host.epilogue.ops import speculative
    rng = random.Random(11)
    for _ in range(500):
        B, n = rng.randint(1, 3), rng.randint(1, 50)
        alphabet = rng.choice([[0, 1], [0, 1, 256], [0, 1, 256, 65536, -1], list(range(7))])
        h = torch.tensor([[rng.choice(alphabet) for _ in range(n)] for _ in range(B)])
        L = [rng.randint(0, n) for _ in range(B)]
        k, lo = rng.randint(1, 6), rng.randint(1, 3)
        hi = rng.randint(lo, 4)
        toks, cnt = speculative.ngram_lookup(h, torch.tensor(L), lo, hi, k)
        htoks, hcnt = speculative.ngram_lookup_host(h.numpy(), L, lo, hi, k)
        assert (htoks.tolist(), hcnt) == (toks.tolist(), cnt.tolist()), (h.tolist(), L, k, lo, hi)
    # 256 then 0 holds the bytes of "1, 0" one byte in: that is no occurrence of the suffix 1, 0
    h = np.array([[256, 0, 0, 5, 1, 0]])
    assert speculative.ngram_lookup_host(h, None, 2, 2, 2)[1] == [0]


def test_argmax_helper_equals_torch_argmax():
    # the CPU path runs numpy's argmax: same index as torch for ties (the first), NaN (the
    # first NaN), infinities, integer dtypes, any axis and non-contiguous input
    from host.epilogue import tensors
    g = torch.Generator().manual_seed(5)
    for trial in range(300):
        x = torch.randint(-3, 4, (3, 17), generator=g).float()  # many ties
        if trial % 3 == 0:
            x[torch.rand(x.shape, generator=g) < 0.1] = float("nan")
        if trial % 5 == 0:
            x[torch.rand(x.shape, generator=g) < 0.1] = float("inf") * (1 if trial % 2 else -1)
        for t in (x, x.t(), x.long(), x[:, ::2], x[0]):
            if t.dtype == torch.int64 and trial % 3 == 0:
                continue  # NaN has no integer value
            for dim in range(t.dim()):
                got = tensors.argmax(t, dim)
                assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim)), (t, dim)


def test_ngram_lookup_with_device_length():
    # a history buffer padded past its length: only the first L tokens count
    p = Program()
    toks, cnt = p.ngram_lookup(p.history(), 2, 1, 2, length=p.const(5))
    got = values(p, toks, cnt, history=torch.tensor([1, 2, 3, 1, 2, 9, 9, 9]))
    assert got[0].tolist() == [3, 1] and int(got[1]) == 2


@covers('verify_greedy')
@pytest.mark.parametrize("drafts,target,n", [
    ([4, 5, 6], [1, 5, 6, 7], 0),
    ([4, 5, 6], [4, 5, 0, 7], 2),
    ([4, 5, 6], [4, 5, 6, 7], 3),
    ([-1, -1, -1], [4, 5, 6, 7], 0),  # padded drafts never match
])
def test_verify_greedy(drafts, target, n):
    p = Program(window=4, readout=4)
    d = p.window()[1:]
    logits = p.logits()
    acc, toks, cnt = p.verify_greedy(d, logits.argmax())
    p.fold(cnt)
    lg = torch.full((4, 10), -5.0)
    lg[torch.arange(4), torch.tensor(target)] = 5.0
    got = values(p, acc, toks, cnt, logits=lg, window=torch.tensor([0] + drafts))
    assert int(got[0]) == n and int(got[2]) == n + 1
    assert got[1].tolist() == target[:n + 1] + [-1] * (3 - n)


@covers('put', 'set', 'fold', 'stop')
def test_channels_put_set_fold_stop_and_overflow():
    p = Program(window=3)
    p.channel("out", "i64", 5)
    p.channel("win", "i64", 3)
    w = p.window()
    p.put("out", w, w[0])  # append w[:w[0]]
    p.set("win", w[1:], 1)
    p.fold(w.size())
    p.stop_if(p.length("out") >= 4)
    prog = compile_program(p.to_json())
    out = SimpleChannel(torch.tensor([7, 7, 0, 0, 0], dtype=torch.int32), torch.tensor(2))
    win = SimpleChannel.empty(3)
    chans = {"out": out, "win": win}
    r = prog.run([Env(window=torch.tensor([2, 8, 9]), channels=chans)])[0]
    assert int(r.fold) == 3 and not bool(r.stop)
    apply_writes(r, chans)
    assert out.buf.tolist() == [7, 7, 2, 8, 0] and int(out.length) == 4 and out.buf.dtype == torch.int32
    assert win.buf.tolist() == [8, 0, 0] and int(win.length) == 1
    r = prog.run([Env(window=torch.tensor([3, 8, 9]), channels=chans)])[0]
    assert bool(r.stop) and bool(r.channels["out"].overflow)
    apply_writes(r, chans)
    assert out.buf.tolist() == [7, 7, 2, 8, 3] and int(out.length) == 5


def test_batched_equals_unbatched_and_groups_by_shape():
    p = Program()
    lg = p.logits()
    t = p.sample(lg, temperature=0.8, top_k=5, seed=3)
    p.channel("o", "i64", 8)
    p.put("o", t)
    prog = compile_program(p.to_json())
    logits = [torch.randn(R, 11) for R in [2, 2, 3, 2]]

    def envs():  # fresh channels for each run: the executor writes them in place
        return [Env(logits=lg, seed=100 + i, round=i, channels={"o": SimpleChannel.empty(8)})
                for i, lg in enumerate(logits)]

    together = prog.run(envs())
    alone = [prog.run([e])[0] for e in envs()]
    for a, b in zip(together, alone):
        assert a.channels["o"].buf is not b.channels["o"].buf
        assert torch.equal(a.channels["o"].buf, b.channels["o"].buf)
    for a, b, lg in zip(together, alone, logits):
        assert int(a.channels["o"].length) == int(b.channels["o"].length) == lg.shape[0]


@covers('rand')
def test_sampling_deterministic_per_seed_and_position():
    p = Program()
    t = p.sample(p.logits(), seed=1)
    r = p.rand([3], seed=2)
    lg = torch.zeros(64, 50)
    a = values(p, t, r, logits=lg, seed=5, position=2)
    b = values(p, t, r, logits=lg, seed=5, position=2, round=9)  # the round does not matter
    c = values(p, t, r, logits=lg, seed=5, position=3)
    d = values(p, t, r, logits=lg, seed=6, position=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], d[0])


@covers('sample')
def test_sample_matches_distribution_roughly():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    p = Program()
    t = p.sample_probs(p.logits())
    prog = compile_program(p.to_json())
    res = prog.run([Env(logits=probs.expand(4000, 4).clone(), seed=1)], keep_values=True)[0].values[1]
    freq = torch.bincount(res, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03) and t is not None
