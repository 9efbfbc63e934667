"""The Cacheback speculative-decoding device program on the tiny model, driven by the device loop.

Greedy runs must equal plain greedy decoding token for token; sampled runs must have the
target distribution (chi-square against the exact distribution from the reference model).
"""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from host.engine import Engine, Pass
from host.engine.loop import DeviceLoop
from host.engine.scheduler import Scheduler
from host.epilogue import compile_program

from guest import cells, chan, plain_greedy
from guest import cacheback as spec
from guest import speculative
from guest import args as guest_args

# every test here runs with both scalar paths of the executor (see conftest.scalar_path)
pytestmark = pytest.mark.usefixtures("scalar_path")

REPETITIVE = [5, 9, 13, 4, 7, 5, 9, 13, 4, 7, 5, 9, 13, 4, 7, 5, 9]
PLAIN = [30, 71, 12, 55, 3, 88, 41, 17]


@pytest.fixture
def big(tiny):
    """The tiny model behind an engine with room for many concurrent loops."""
    eng, ref = tiny
    return Engine(eng.model, eng.tokenizer, name="tiny-big", kv_pages=16384, page_size=4), ref


def start(sched, eng, prompt, seed=0, namespace=None, **kw):
    """namespace: bind the engine's suffix index of that namespace (as the runtime does), else none."""
    text, chans = spec.cacheback_program(prompt=prompt, **kw)
    ws = eng.new_working_set(namespace=namespace or "")
    if len(prompt) > 1:
        eng.forward([Pass(ws, prompt[:-1], [0])])
    channels = {c["name"]: chan(c["capacity"], c["init"]) for c in chans}
    folds = []
    loop = DeviceLoop(ws, compile_program(text), channels, channels["window"],
                      max_window=channels["window"].buf.shape[0], rounds=1000, seed=seed,
                      suffix=eng.suffix_source(ws) if namespace is not None else None,
                      on_round=lambda lp, w, f, cost: folds.append((w, f)))
    return loop, channels, folds, sched.start_loop(loop)


def run(eng, prompt, **kw):
    sched = Scheduler(eng)
    try:
        loop, channels, folds, fut = start(sched, eng, prompt, **kw)
        stats = fut.result(timeout=60)
    finally:
        sched.close()
    assert all(0 <= f <= w for w, f in folds)
    return cells(channels["out"]), stats, folds, loop


def gate_replay(folds, K, probe_after=4, probe_max=32):
    """Replay the draft gate (spec.draft_gate) from the (window, fold) log. Returns whether no
    window drafted more than the gate allowed, and the state after the last round (a fold is
    1 + accepted drafts unless EOS or max-tokens cut the round: the last one only)."""
    state, ok = [spec.GATE_INIT, 0, probe_after, 0], True
    for i, (w, f) in enumerate(folds):
        state, k = spec.draft_gate(state, w - 1, f - 1, K, probe_after, probe_max)
        ok = ok and (i + 1 == len(folds) or folds[i + 1][0] - 1 <= k)
    return ok, state


def test_draft_gate_closes_backs_off_and_reopens():
    state, k, ks = [spec.GATE_INIT, 0, 4, 0], 4, []
    for _ in range(100):  # every draft fails
        state, k = spec.draft_gate(state, k, 0, 8)
        ks.append(k)
    drafting = [i for i, k in enumerate(ks) if k]
    e, n = spec.GATE_INIT, 0  # each failed draft keeps 3/4 of the estimate: n rounds stay open
    while (e := e - e // 4) >= spec.GATE_OPEN:
        n += 1
    assert n >= 2 and drafting[:n] == list(range(n)) and drafting[n] > n
    assert set(ks) == {0, 4}  # after a failed draft, and for probes: half of K
    gaps = [b - a for a, b in zip(drafting[n - 1:], drafting[n:])]
    assert gaps[:5] == [4, 8, 16, 32, 32]  # a failed probe doubles the wait for the next, up to 32
    state, k = spec.draft_gate(state, 4, 4, 8)  # a probe accepted whole reopens the gate at full length
    assert k == 8 and state == [state[0], 0, 4, 1] and state[0] >= spec.GATE_OPEN
    state, k = spec.draft_gate(state, 8, 5, 8)  # accepted in part: still open, half length
    assert k == 4 and state[3] == 0
    assert spec.draft_gate([500, 0, 4, 1], 0, 0, 8) == ([500, 0, 4, 1], 8)  # no draft: no change
    assert spec.short_draft(1) == 1 and spec.short_draft(5) == 3


def test_the_head_gate_follows_more_rounds_and_drafts_all_k():
    rule, lookup = spec.HEAD_GATE, spec.LOOKUP_GATE
    assert rule.memory > lookup.memory and not rule.shorten

    def open_rounds(r):  # failed drafts from a full estimate before the gate closes
        state, k, n = [spec.GATE_INIT, 0, 4, 1], 2, 0
        while True:
            state, k = spec.draft_gate(state, k, 0, 2, rule=r)
            if not k:
                return n
            n += 1

    assert open_rounds(rule) > open_rounds(lookup) >= 2
    state, k = spec.draft_gate([500, 0, 4, 1], 2, 1, 2, rule=rule)  # accepted in part: still all K
    assert k == 2 and state == [500 - 500 // 8 + 125, 0, 4, 0]
    assert spec.draft_gate([500, 0, 4, 1], 2, 1, 2, rule=lookup)[1] == 1
    for bad in (0, 3, 7, -4):
        with pytest.raises(ValueError, match="divisor of 1000"):
            spec.GateRule(memory=bad)


@pytest.mark.parametrize("prompt,repetitive", [(REPETITIVE, True), (PLAIN, False)])
def test_greedy_equals_plain_decoding(big, prompt, repetitive):
    eng, _ = big
    want = plain_greedy(eng, prompt, 40)
    got, stats, folds, loop = run(eng, prompt, max_tokens=40, draft_len_max=4, lookup_window=16, lru_size=16)
    assert got == want
    assert stats.accepted <= stats.drafted and all(f <= w for w, f in folds)
    assert loop.ws.frozen == len(prompt) - 1 + len(got)  # the last token is next round's t0, as in plain decoding
    ok, state = gate_replay(folds, K=4)
    assert ok and cells(loop.channels["spec_state"]) == state  # the device rule is the reference's
    if repetitive:
        assert stats.accepted > 0 and stats.rounds < len(got)


def test_lru_fallback_drafts_what_left_the_lookup_window(big):
    eng, _ = big
    period = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
    prompt = period * 2 + period[:3]  # the match lies 12 back: outside a lookup window of 8
    want = plain_greedy(eng, prompt, 24)
    kw = dict(max_tokens=24, draft_len_max=3, lookup_window=8, lru_ngram=2)
    sched = Scheduler(eng)
    try:
        loop, chans, folds, fut = start(sched, eng, prompt, lru_size=6, **kw)
        with_lru = fut.result(timeout=60)
    finally:
        sched.close()
    got0, without, _, _ = run(eng, prompt, lru_size=0, **kw)
    assert cells(chans["out"]) == want and got0 == want
    assert with_lru.drafted > without.drafted
    # The device table equals a plain-Python replay: each round, the leaders leaving the window.
    _, init = spec.cacheback_program(prompt=prompt, lru_size=6, **kw)
    table, stamps = (next(c["init"] for c in init if c["name"] == n) for n in ("lru_table", "lru_stamps"))
    seq, N, Lw, g, K = loop.ws.tokens, len(prompt) - 1, 8, 2, 3
    for _, f in folds:
        span = f + g + K - 1
        part = [seq[i] if i >= 0 else -1 for i in range(N - Lw, N - Lw + span)]
        table, stamps = spec.lru_update(table, stamps, part, span, f, g, K)
        N += f
    assert cells(chans["lru_table"]) == table and cells(chans["lru_stamps"]) == stamps
    assert max(stamps) > 6  # entries were inserted and evicted along the way


def test_single_token_prompt_and_bad_arguments(big):
    eng, _ = big
    got, _, _, _ = run(eng, [17], max_tokens=12, draft_len_max=3, lookup_window=8)
    assert got == plain_greedy(eng, [17], 12)
    for bad in (dict(lookup_window=5), dict(max_tokens=0), dict(ngram_min=3, ngram_max=2), dict(top_p=0.0)):
        with pytest.raises(ValueError):
            spec.cacheback_program(prompt=[1, 2], **{"draft_len_max": 3, "lookup_window": 16, **bad})
    with pytest.raises(ValueError):
        spec.cacheback_program(prompt=[])


def test_channel_specs_and_first_window(big):
    text, chans = spec.cacheback_program(prompt=REPETITIVE, draft_len_max=4, lookup_window=10,
                                         lru_size=6, lru_ngram=2, max_tokens=50)
    by = {c["name"]: c for c in chans}
    assert set(by) == {"out", "window", "lru_table", "lru_stamps", "spec_state"}
    # the first draft is the gate's first length: half of K
    assert by["window"]["init"] == [9] + spec.ngram_lookup(REPETITIVE[-11:], 4)[:2] and by["window"]["capacity"] == 5
    assert by["lru_table"]["capacity"] == 6 * (2 + 4) == len(by["lru_table"]["init"])
    # the prompt's leaders left of the lookup window are in the table already
    assert spec.lru_lookup(by["lru_table"]["init"], by["lru_stamps"]["init"], [5, 9], 2, 4) == [13, 4, 7, 5]
    assert by["spec_state"]["init"] == [spec.GATE_INIT, 0, 4, 0] and by["out"]["init"] == []
    assert compile_program(text).checked.alias == {"R": "W"}
    # a history that can never outgrow the lookup window (prompt[:-1] + max_tokens <= 10) needs no table
    for n, has in ((10 - len(REPETITIVE[-6:]) + 1, False), (10 - len(REPETITIVE[-6:]) + 2, True)):
        text, chans = spec.cacheback_program(prompt=REPETITIVE[-6:], draft_len_max=4, lookup_window=10,
                                             lru_size=6, max_tokens=n)
        assert ("lru_table" in {c["name"] for c in chans}) == has
        assert ("lru_lookup" in text) == has


def test_eos_and_max_tokens_cut_like_plain_decoding(big):
    eng, _ = big
    want = plain_greedy(eng, REPETITIVE, 40)
    eos = want[12]
    first = want.index(eos)
    got, _, _, loop = run(eng, REPETITIVE, max_tokens=40, eos_ids=[96, eos], draft_len_max=4, lookup_window=16)
    assert got == want[:first + 1]
    assert loop.ws.frozen == len(REPETITIVE) - 1 + len(got)
    for limit in (1, 7, 13):
        got, stats, _, _ = run(eng, REPETITIVE, max_tokens=limit, draft_len_max=4, lookup_window=16)
        assert got == want[:limit]


def test_draft_len_zero_is_plain_decoding_one_row_per_round(big):
    eng, _ = big
    want = plain_greedy(eng, REPETITIVE, 20)
    got, stats, folds, _ = run(eng, REPETITIVE, max_tokens=20, draft_len_max=0)
    assert got == want
    assert stats.rounds == 20 and stats.drafted == 0 and all(w == 1 and f == 1 for w, f in folds)


def test_seeded_sampled_run_repeats(big):
    eng, _ = big
    kw = dict(max_tokens=24, draft_len_max=4, lookup_window=16, temperature=0.1, top_p=0.9)
    a = run(eng, REPETITIVE, seed=7, **kw)[0]
    b = run(eng, REPETITIVE, seed=7, **kw)[0]
    others = [run(eng, REPETITIVE, seed=s, **kw)[0] for s in (8, 9)]
    assert a == b and len(a) == 24
    assert any(o != a for o in others)


# --- the sampled output has the target distribution --------------------------------

# A prompt (a greedy continuation of REPETITIVE) whose lookup drafts [92, 32, 79]: at T=0.05 the
# target gives them moderate probability, so both acceptances and rejections happen.
DIST_PROMPT = [9, 13, 4, 7, 5, 9, 79, 63, 71, 55, 88, 33, 86, 32, 79, 63, 21, 79, 63, 21, 79, 63, 21, 79, 63, 85, 65,
               92, 32, 79, 63, 85, 65]
T, TOP_P, RUNS = 0.05, 0.95, 600


def target_probs(logits, top_k=0, min_p=0.0):
    """softmax(logits / T) cut by top-k, then min-p, then top-p (written independently of the
    device ops, in float64 on probabilities)."""
    probs = torch.softmax(logits.double() / T, -1)
    if top_k:
        probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, 0.0)
    if min_p:
        probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    probs = probs / probs.sum()
    srt, order = probs.sort(descending=True)
    keep = (srt.cumsum(-1) - srt) < TOP_P
    out = torch.zeros_like(probs)
    out[order[keep]] = srt[keep]
    return out / out.sum()


def exact_pairs(ref, prompt, **filters):
    with torch.inference_mode():
        p1 = target_probs(ref(torch.tensor([prompt])).logits[0, -1], **filters)
        firsts = p1.nonzero().flatten().tolist()
        l2 = ref(torch.tensor([prompt + [x] for x in firsts])).logits[:, -1]
    return {(x, y): float(p1[x] * q) for x, row in zip(firsts, l2) for y, q in enumerate(target_probs(row, **filters))
            if q > 0}


def sample_pairs(eng, verify=None, prompt=DIST_PROMPT, **filters):
    sched = Scheduler(eng)
    try:
        # max_tokens=3 lets the first window carry 2 drafts: both compared tokens go through the rule.
        runs = [start(sched, eng, prompt, seed=s, max_tokens=3, draft_len_max=3, lookup_window=16,
                      temperature=T, top_p=TOP_P, verify=verify, **filters) for s in range(RUNS)]
        stats = [fut.result(timeout=120) for _, _, _, fut in runs]
    finally:
        sched.close()
    pairs = [tuple(cells(ch["out"])[:2]) for _, ch, _, _ in runs]
    for loop, *_ in runs:
        eng.release(loop.ws)
    return pairs, stats


def chi_square_p(pairs, exact):
    counts: dict = {}
    for pr in pairs:
        counts[pr] = counts.get(pr, 0) + 1
    n = len(pairs)
    big_cells = [c for c, q in exact.items() if q * n >= 5]
    obs = [counts.get(c, 0) for c in big_cells]
    exp = [exact[c] * n for c in big_cells]
    if n - sum(exp) > 1e-6:  # the small cells together, where they hold any mass
        obs.append(n - sum(obs))
        exp.append(n - sum(exp))
    elif n != sum(obs):
        return 0.0  # draws outside cells that hold all the mass
    return chisquare(obs, exp).pvalue


def accept_every_draft(p, drafts, probs, seed):
    """A broken rule on purpose: no p/q test, every draft is kept, the bonus token from p."""
    d = drafts.size()
    return d, p.concat(drafts, p.sample_probs(probs, seed)[-1:]), d + 1


def test_sampled_output_has_the_target_distribution(big):
    eng, ref = big
    exact = exact_pairs(ref, DIST_PROMPT)
    assert spec.ngram_lookup(DIST_PROMPT, 3) == [92, 32, 79]  # the first window drafts these
    pairs, stats = sample_pairs(eng)
    assert all(len(pr) == 2 for pr in pairs)
    accepted = sum(s.accepted for s in stats)
    assert 0 < accepted < sum(s.drafted for s in stats)  # the rule both accepted and rejected drafts
    assert chi_square_p(pairs, exact) > 0.001
    # The same test catches a rule that skips the p/q test.
    bad, _ = sample_pairs(eng, verify=accept_every_draft)
    assert chi_square_p(bad, exact) < 1e-6


# --- drafts from earlier requests (the suffix index, issue 43) -----------------------------

def test_suffix_drafts_from_earlier_requests_are_exact_and_namespaced(big):
    eng, _ = big
    want = plain_greedy(eng, PLAIN, 40)  # its release lists prompt + output in namespace ""
    kw = dict(max_tokens=40, draft_len_max=4, lookup_window=16, lru_size=0, ngram_min=2)
    got, base, _, _ = run(eng, PLAIN, namespace=None, **kw)  # no index bound: own-context drafts only
    assert got == want
    got, stats, _, _ = run(eng, PLAIN, namespace="", **kw)
    assert got == want and stats.accepted >= base.accepted + 8 and stats.rounds < base.rounds
    got, other, _, _ = run(eng, PLAIN, namespace="other", **kw)  # another namespace's index: empty
    assert got == want and (other.drafted, other.accepted, other.rounds) == (base.drafted, base.accepted, base.rounds)
    # an earlier text that went otherwise after the first token: its drafts are rejected
    ws = eng.new_working_set(namespace="wrong")
    eng.forward([Pass(ws, PLAIN + want[:1] + [t + 1 for t in want[1:]], [0])])
    eng.release(ws)
    got, stats, _, _ = run(eng, PLAIN, namespace="wrong", **kw)
    assert got == want and stats.drafted > base.drafted and stats.accepted <= base.accepted
    # a working set created uncached neither lists its text nor drafts from the index
    ws = eng.new_working_set(namespace="quiet", prefix_caching=False)
    eng.forward([Pass(ws, PLAIN + want, [0])])
    assert eng.suffix_source(ws) is None
    eng.release(ws)
    assert eng.suffix.index("quiet").tokens == 0


def test_sampled_output_with_suffix_drafts_has_the_target_distribution(big):
    """The second token of each run is verified against a draft from the index: the argmax
    continuation after half of the possible first tokens, the runner-up after the others."""
    eng, ref = big
    prompt = PLAIN
    exact = exact_pairs(ref, prompt)
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + [x] for x in sorted({a for a, _ in exact})])).logits[:, -1]
    for i, (a, row) in enumerate(zip(sorted({a for a, _ in exact}), logits)):
        ws = eng.new_working_set()
        eng.forward([Pass(ws, prompt + [a, int(row.topk(2).indices[i % 2])], [0])])
        eng.release(ws)

    def pairs_of(verify=None):
        sched = Scheduler(eng)
        try:
            runs = [start(sched, eng, prompt, seed=s, namespace="", max_tokens=3, draft_len_max=3, lookup_window=16,
                          ngram_min=2, lru_size=0, temperature=T, top_p=TOP_P, verify=verify) for s in range(RUNS)]
            stats = [fut.result(timeout=120) for _, _, _, fut in runs]
        finally:
            sched.close()
        for loop, *_ in runs:
            loop.ws.indexed = False  # the runs' own texts stay out of the index
            eng.release(loop.ws)
        return [tuple(cells(ch["out"])[:2]) for _, ch, _, _ in runs], stats

    listed = eng.suffix.tokens
    pairs, stats = pairs_of()
    assert eng.suffix.tokens == listed
    accepted = sum(s.accepted for s in stats)
    assert 0 < accepted < sum(s.drafted for s in stats)
    assert chi_square_p(pairs, exact) > 0.001
    bad, _ = pairs_of(accept_every_draft)
    assert chi_square_p(bad, exact) < 1e-6


# issue 40: top-k and min-p are part of the one sampling rule, so verification sees the
# distribution they shape; each cuts tokens the top-p nucleus alone keeps here
@pytest.mark.parametrize("filters", [{"top_k": 2}, {"min_p": 0.1}])
def test_sampled_output_under_top_k_and_min_p_has_their_distribution(big, filters):
    eng, ref = big
    exact, plain = exact_pairs(ref, DIST_PROMPT, **filters), exact_pairs(ref, DIST_PROMPT)
    assert set(exact) < set(plain)  # the filter drops pairs the nucleus alone keeps
    pairs, stats = sample_pairs(eng, **filters)
    accepted = sum(s.accepted for s in stats)
    assert 0 < accepted < sum(s.drafted for s in stats)
    assert chi_square_p(pairs, exact) > 0.001
    assert all(pr in exact for pr in pairs)  # nothing the filter cut is ever drawn
    # sampled as if the filter were not there: told apart
    unfiltered, _ = sample_pairs(eng)
    assert not all(pr in exact for pr in unfiltered) or chi_square_p(unfiltered, exact) < 1e-6


# --- the guest-side rule ------------------------------------------------------------

def test_guest_verify_is_distributed_as_the_target():
    rng = random.Random(1)
    V, k, trials = 5, 2, 20000
    p_rows = [[0.1, 0.4, 0.2, 0.3, 0.0], [0.25, 0.25, 0.1, 0.1, 0.3], [0.5, 0.1, 0.1, 0.2, 0.1]]
    q_rows = [[0.4, 0.1, 0.1, 0.1, 0.3], [0.2, 0.2, 0.2, 0.2, 0.2]]
    first, second = [0] * V, [0] * V
    for _ in range(trials):
        drafts = [rng.choices(range(V), q)[0] for q in q_rows]
        toks = speculative.verify(drafts, q_rows, p_rows, rng)
        assert 1 <= len(toks) <= k + 1 and toks[:-1] == drafts[:len(toks) - 1]
        first[toks[0]] += 1
        if len(toks) > 1:
            second[toks[1]] += 1
    # p rows do not depend on the context here, so token 0 ~ p0 and token 1 ~ p1.
    for counts, p in ((first, p_rows[0]), (second, p_rows[1])):
        n = sum(counts)
        cells = [i for i in range(V) if p[i] > 0]
        assert all(counts[i] == 0 for i in range(V) if p[i] == 0)
        assert chisquare([counts[i] for i in cells], [p[i] * n for i in cells]).pvalue > 0.001
    # deterministic drafts (q one-hot) and a broken rule that always accepts is caught
    det = [0] * V
    for _ in range(trials):
        det[speculative.verify([4], None, p_rows[:2], rng)[0]] += 1
    assert det[4] == 0  # p0(4) = 0: never accepted
    assert chisquare([det[i] for i in range(4)], [p_rows[0][i] * trials for i in range(4)]).pvalue > 0.001
    bad = [0] * V
    for _ in range(trials):
        x = rng.choices(range(V), q_rows[0])[0]
        bad[x] += 1  # "accept every draft" gives q, not p
    obs = bad[:4]  # p0 has no mass on token 4
    assert chisquare(obs, [p_rows[0][i] * sum(obs) for i in range(4)]).pvalue < 1e-6


# --- penalties (issue 53): verify row i counts the drafts before it --------------------------

def sdk_penalties(presence=0.0, frequency=0.0, repetition=1.0, output_start=0):
    return guest_args.Penalties(presence, frequency, repetition, output_start)


def plain_penalized(eng, prompt, n, pen):
    """Plain greedy decoding under penalties: one engine pass per token, the host's Sampler at
    temperature 0 choosing each token with the context so far counted."""
    from host.epilogue.ops.sampling import Penalties
    from host.runtime.sampling import Context, Sampler

    s = Sampler(0.0, 1.0, 0, penalties=Penalties(pen.presence, pen.frequency, pen.repetition, pen.output_start))
    ws = eng.new_working_set()
    (out,) = eng.forward([Pass(ws, prompt, [len(prompt) - 1])])
    ctx, toks = list(prompt), []
    for _ in range(n):
        t = s.sample(out.logits[-1:], len(ctx) - 1, Context(ctx, [len(ctx)]))[0]
        toks.append(t)
        ctx.append(t)
        (out,) = eng.forward([Pass(ws, [t], [0])])
    eng.release(ws)
    return toks


@pytest.mark.parametrize("pen", [dict(repetition=1.5), dict(presence=1.0, frequency=0.5),
                                 dict(presence=-0.5, frequency=-0.3, repetition=0.8)])
def test_greedy_under_penalties_equals_plain_decoding_under_them(big, pen):
    eng, _ = big
    p = sdk_penalties(**pen, output_start=len(REPETITIVE))
    want = plain_penalized(eng, REPETITIVE, 32, p)
    assert want != plain_greedy(eng, REPETITIVE, 32)  # the penalties change the text
    got, stats, _, _ = run(eng, REPETITIVE, max_tokens=32, draft_len_max=4, lookup_window=16, penalties=p)
    assert got == want
    assert stats.drafted > 0


def penalized_logits(logits, context, output, pen):
    """The penalties written independently of the device op, in float64: repetition over the
    context, then frequency x count and presence over the output."""
    x = logits.double().clone()
    for t in set(context):
        x[t] = x[t] / pen.repetition if x[t] > 0 else x[t] * pen.repetition
    for t in set(output):
        x[t] -= pen.frequency * output.count(t) + pen.presence
    return x


def exact_pairs_penalized(ref, prompt, pen):
    with torch.inference_mode():
        p1 = target_probs(penalized_logits(ref(torch.tensor([prompt])).logits[0, -1], prompt, [], pen))
        firsts = p1.nonzero().flatten().tolist()
        l2 = ref(torch.tensor([prompt + [x] for x in firsts])).logits[:, -1]
    return {(x, y): float(p1[x] * q) for x, row in zip(firsts, l2)
            for y, q in enumerate(target_probs(penalized_logits(row, prompt + [x], [x], pen))) if q > 0}


def test_sampled_output_under_penalties_has_their_distribution(big, monkeypatch):
    """A negative presence penalty makes the second token repeat the first: only where verify row 1
    counts the draft before it does an accepted first draft get that boost."""
    from host.epilogue.ops import sampling

    eng, ref = big
    pen = sdk_penalties(presence=-0.5, frequency=-0.02, repetition=1.1, output_start=len(DIST_PROMPT))
    exact = exact_pairs_penalized(ref, DIST_PROMPT, pen)
    pairs, stats = sample_pairs(eng, penalties=pen)
    accepted = sum(s.accepted for s in stats)
    assert 0 < accepted < sum(s.drafted for s in stats)
    assert chi_square_p(pairs, exact) > 0.001
    # sampled as if there were no penalties: told apart
    plain, _ = sample_pairs(eng)
    assert chi_square_p(plain, exact) < 1e-6
    # verification that counts no draft before its row (each row sees the history and t0 only): told apart
    real = sampling.penalize
    monkeypatch.setattr(sampling, "penalize", lambda x, ctx, ends, p: real(x, ctx, ends[..., :1].expand_as(ends), p))
    blind, _ = sample_pairs(eng, penalties=pen)
    assert chi_square_p(blind, exact) < 1e-6
