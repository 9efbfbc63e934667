"""The cross-request suffix index (issue 43 item 3): its drafts equal a brute-force reference over
the same texts, its draft length follows the match, it stays within its token bound (LRU over
documents, every namespace together), and a namespace never drafts another's text."""

from __future__ import annotations

import random

import pytest
import torch

from host.engine.suffix_index import KEY, MAX_CANDIDATES, SuffixStore
from host.epilogue import Env, SimpleChannel, compile_program

from guest import trace
from op_reference import covers


def reference(docs: list[list[int]], context: list[int], k: int, max_match=32, factor=1.0, min_prob=0.1):
    """The draft by exhaustive search: every position after the context's last two tokens, most
    recent text first; the longest backward matches vote step by step."""
    cands = [(d, i) for d in reversed(range(len(docs))) for i in reversed(range(KEY, len(docs[d])))
             if docs[d][i - KEY:i] == context[-KEY:]]
    assert len(cands) <= MAX_CANDIDATES  # the reference has no cap: keep tests under it

    def match(d, i):
        m = 0
        while m < min(max_match, len(context), i) and docs[d][i - m - 1] == context[-m - 1]:
            m += 1
        return m

    if not cands:
        return []
    best = max(match(d, i) for d, i in cands)
    live = [(d, i) for d, i in cands if match(d, i) == best]
    out, prob = [], 1.0
    for step in range(min(k, max(1, int(factor * best)))):
        nexts = [docs[d][i + step] for d, i in live if i + step < len(docs[d])]
        if not nexts:
            break
        top = max(nexts.count(t) for t in nexts)
        tok = next(t for t in nexts if nexts.count(t) == top)  # ties: the most recent candidate's
        if prob * top / len(live) < min_prob:
            break
        prob *= top / len(live)
        out.append(tok)
        live = [(d, i) for d, i in live if i + step < len(docs[d]) and docs[d][i + step] == tok]
    return out


def test_drafts_equal_the_reference_on_random_texts():
    rng = random.Random(7)
    for trial in range(40):
        store = SuffixStore(10_000)
        ix = store.index("ns")
        docs = [[rng.randrange(6) for _ in range(rng.randrange(3, 14))] for _ in range(rng.randrange(1, 6))]
        for d in docs:
            ix.insert(d)
        docs = [d for i, d in enumerate(docs) if d not in docs[:i]]  # an equal text is listed once
        for _ in range(30):
            ctx = [rng.randrange(6) for _ in range(rng.randrange(2, 10))]
            k = rng.randrange(1, 9)
            factor = rng.choice([0.5, 1.0, 2.0])
            want = reference(docs, ctx, k, factor=factor)
            assert ix.draft(ctx, k, factor=factor).tokens == want, (trial, docs, ctx, k, factor)


def test_the_longest_match_wins_and_its_length_bounds_the_draft():
    store = SuffixStore()
    ix = store.index("")
    ix.insert([1, 2, 3, 4, 5, 6, 7, 8, 9])
    ix.insert([0, 0, 2, 3, 40, 41, 42, 43])
    d = ix.draft([1, 2, 3], 8)  # matched 3 tokens in the first text, 2 in the second
    assert (d.tokens, d.match, d.score) == ([4, 5, 6], 3, 3.0)
    assert ix.draft([1, 2, 3], 8, factor=2.0).tokens == [4, 5, 6, 7, 8, 9]
    assert ix.draft([1, 2, 3], 2).tokens == [4, 5]
    assert ix.draft([7, 2, 3], 8).tokens == [40, 41]  # two texts matched 2 tokens: the more recent's tie
    assert ix.draft([5, 5], 8).tokens == [] and ix.draft([3], 8).tokens == []
    assert ix.draft([1, 2, 3], 8, min_match=4).tokens == []


def test_votes_set_the_probability_and_min_prob_stops_the_draft():
    store = SuffixStore()
    ix = store.index("")
    for tail in ([7, 8, 1], [7, 8, 2], [7, 9, 3], [6, 9, 4]):
        ix.insert([1, 2, 3] + tail)
    d = ix.draft([1, 2, 3], 3, factor=1.0)
    # the third step's tie goes to the more recent text
    assert d.tokens == [7, 8, 2] and d.score == pytest.approx(0.75 + 0.5 + 0.25)
    assert ix.draft([1, 2, 3], 3, min_prob=0.3).tokens == [7, 8]
    assert ix.draft([1, 2, 3], 3, min_prob=0.8).tokens == []


def test_namespaces_never_see_each_others_texts():
    store = SuffixStore()
    a, b = store.index("key-a"), store.index("key-b")
    a.insert([10, 11, 12, 13, 14])
    assert a.draft([10, 11], 4).tokens == [12, 13]
    assert b.draft([10, 11], 4).tokens == []
    assert store.index("key-a") is a


def test_memory_is_bounded_least_recently_used_first_over_every_namespace():
    store = SuffixStore(max_tokens=50)
    texts = [[n * 100 + i for i in range(20)] for n in range(6)]
    store.index("a").insert(texts[0])
    store.index("b").insert(texts[1])
    assert store.index("a").draft(texts[0][:3], 2).tokens  # texts[0] is now the more recent
    store.index("b").insert(texts[2])  # 60 tokens: the least recently used text (texts[1]) goes
    assert store.tokens == 40 and store.evictions == 1
    assert store.index("b").draft(texts[1][:3], 2).tokens == []
    assert store.index("a").draft(texts[0][:3], 2).tokens == [3, 4]
    for t in texts[3:]:
        store.index("c").insert(t)
        assert store.tokens <= 50
    assert store.index("a").draft(texts[0][:3], 2).tokens == []
    store.index("a").insert(list(range(1000, 1200)))  # longer than the bound: its end is kept
    assert store.tokens == 50 and store.index("a").draft([1150, 1151], 2).tokens == [1152, 1153]


def test_lookups_stay_exact_through_evictions_and_the_index_rebuild():
    rng = random.Random(3)
    store = SuffixStore(max_tokens=600)
    ix = store.index("")
    kept: list[list[int]] = []
    for _ in range(120):  # 12,000 tokens through a 600-token store: the index is rebuilt
        t = [rng.randrange(40) for _ in range(100)]
        ix.insert(t)
        kept = (kept + [t])[-6:]
    assert store.tokens == 600 and ix._dead <= max(ix._live, 1 << 12)
    docs = ix.documents()
    assert docs == kept
    for _ in range(200):
        ctx = [rng.randrange(40) for _ in range(6)]
        assert ix.draft(ctx, 5).tokens == reference(docs, ctx, 5)


def test_a_repeated_text_is_kept_once():
    store = SuffixStore()
    ix = store.index("")
    for _ in range(3):
        ix.insert([1, 2, 3, 4])
    assert len(store) == 1 and store.tokens == 4 and store.insertions == 1
    ix.insert([1, 2])  # too short to offer a continuation
    assert len(store) == 1


# --- the op ----------------------------------------------------------------------------

@covers("suffix_draft")
def test_op_drafts_from_each_pass_own_index(scalar_path):
    """One batched run: each pass drafts from the index its env binds (none: nothing), over the
    first `length` cells of its context; a negative token in the matched tail drafts nothing."""
    p = trace.Program()
    p.channel("ctx", "i64", 8)
    p.channel("len", "i64", 1)
    p.channel("out", "i64", 7)
    d, n, score, match = p.suffix_draft(p.read("ctx"), p.read("len")[0], 4, factor=2.0)
    j = p.arange(3)
    p.set("out", p.concat(d, p.where(j == 0, n, p.where(j == 1, (score * 1000.0).cast("i64"), match))))
    prog = compile_program(p.to_json())
    store = SuffixStore()
    a, b = store.index("a"), store.index("b")
    a.insert([1, 2, 3, 4, 5, 6, 7])
    b.insert([1, 2, 3, 9, 9, 9, 9])
    cases = [(a, [0, 1, 2, 3, 0, 0, 0, 0], 4), (b, [0, 1, 2, 3, 0, 0, 0, 0], 4), (None, [1, 2, 3, 0, 0, 0, 0, 0], 3),
             (a, [1, 2, 3, 4, 5, 0, 0, 0], 2), (a, [-1, 2, 3, 0, 0, 0, 0, 0], 3), (a, [2, 3, 0, 0, 0, 0, 0, 0], 99)]
    envs = [Env(channels={"ctx": chan(c), "len": chan([n]), "out": chan([0] * 7)}, suffix=s) for s, c, n in cases]
    got = [r.channels["out"].buf.tolist() for r in prog.run(envs)]
    for (s, c, n), row in zip(cases, got):
        ctx = c[:min(n, len(c))]
        d = None if s is None or any(x < 0 for x in ctx) else s.draft(ctx, 4, factor=2.0)
        want = d.tokens if d else []
        assert row[:4] == want + [-1] * (4 - len(want)) and row[4] == len(want), (ctx, row)
        assert row[6] == (d.match if want else 0)
    assert got[0] == [4, 5, 6, 7, 4, 4000, 3]
    assert got[1][:4] == [9, 9, 9, 9] and got[2][4:] == [0, 0, 0] and got[4][4:] == [0, 0, 0]
    assert got[3][:5] == [3, 4, 5, 6, 4] and got[3][6] == 2  # the context is [1, 2]: the match is 2 long, factor 2


def chan(values):
    return SimpleChannel(torch.tensor(values, dtype=torch.int64), torch.tensor(len(values), dtype=torch.int64))
