"""The grammar ops (grammar_mask, grammar_commit) against the matcher's own step-by-step answers,
and masked verification: greedy never accepts a forbidden draft; rejection sampling under a mask
gives the masked target distribution."""

import numpy as np
import pytest
import torch
from scipy import stats

from host.epilogue import Env, ProgramError, SimpleChannel, compile_program
from host.errors import InvalidArgument
from host.grammar import GrammarError, Grammars

from guest import trace
from op_reference import covers

# a byte-level vocabulary small enough to read masks by eye; 0 is EOS
TOKENS = [b"<eos>", b"{", b"}", b'"', b":", b",", b"a", b"b", b"1", b"2", b" ", b'{"', b'":', b"ab", b"x", b"y"]
V = len(TOKENS)


class ByteTokenizer:
    def grammar_tokens(self):
        return list(TOKENS)


@pytest.fixture(scope="module")
def grammars():
    return Grammars(ByteTokenizer(), V, [0])


def allowed(m) -> list[bool]:
    words = m.bitmask()
    return [bool(words[t // 32] >> (t % 32) & 1) for t in range(V)]


def stepwise_masks(m, window):
    """Row j: what a fork of m allows after window[1..j]; all false from a forbidden draft on."""
    f, rows, ok = m.fork(), [], True
    for j in range(len(window)):
        if j and ok:
            ok = f.accept([window[j]]) == 1
        rows.append(allowed(f) if ok else [False] * V)
    return torch.tensor(rows)


def mask_program():
    p = trace.Program(readout="window", vocab=V)
    g = p.matcher("g")
    mask = p.grammar_mask(p.window(), g)
    return p, compile_program(p.to_json()), mask


def run_values(p, prog, env, *outs):
    r = prog.run([env], keep_values=True)[0]
    n_in = len(p.to_dict()["inputs"])
    return [r.values[p._where[o.id][1] + (n_in if p._where[o.id][0] == "op" else 0)] for o in outs]


@covers("grammar_mask")
@pytest.mark.parametrize("window", [[7], [7, 6], [7, 6, 7, 8, 9], [7, 6, 14, 7], [7, 13, 8, 0], [7, 6, 99]])
def test_grammar_mask_rows_are_the_matchers_stepwise_masks(grammars, window):
    m = grammars.compile("regex", "a(b|1)*2").matcher()
    p, prog, mask = mask_program()
    before = allowed(m)
    logits = torch.zeros(len(window), V)
    if max(window) >= V:  # an id outside the vocabulary is a draft no grammar allows
        expect = stepwise_masks(m, [t for t in window if t < V])
        expect = torch.cat([expect, torch.zeros(1, V, dtype=torch.bool)])
    else:
        expect = stepwise_masks(m, window)
    (got,) = run_values(p, prog, Env(logits=logits, window=torch.tensor(window), matchers={"g": m}), mask)
    assert torch.equal(got, expect)
    assert allowed(m) == before and m.consumed == 0  # the walk was rolled back


@covers("grammar_commit")
def test_grammar_commit_consumes_and_reports_forced_tokens(grammars):
    schema = '{"type":"object","properties":{"ab":{"type":"integer"}},"required":["ab"],"additionalProperties":false}'
    m = grammars.compile("json-schema", schema).matcher()
    p = trace.Program()
    g = p.matcher("g")
    p.channel("t", "i64", 4)
    forced, n = p.grammar_commit(p.read("t"), p.length("t"), g, k=3)
    prog = compile_program(p.to_json())
    ch = SimpleChannel(torch.tensor([11, -1, -1, -1]), 1)  # '{"' then padding past the count
    ref = m.fork()
    assert ref.accept([11]) == 1
    got = run_values(p, prog, Env(channels={"t": ch}, matchers={"g": m}, position=5), forced, n)
    f = ref.forced()[:3]
    assert f, "the schema forces the key after '{\"'"
    assert got[0].tolist() == f + [-1] * (3 - len(f)) and int(got[1]) == len(f)
    assert m.consumed == 1
    run_values(p, prog, Env(channels={"t": ch}, matchers={"g": m}, position=5), forced)  # a retried run
    assert m.consumed == 1
    bad = SimpleChannel(torch.tensor([2, -1, -1, -1]), 1)  # '}' is not allowed after '{"'
    with pytest.raises(InvalidArgument, match="not allowed by the grammar"):
        prog.run([Env(channels={"t": bad}, matchers={"g": m}, position=6)])


def test_matchers_must_be_declared_and_bound(grammars):
    p, prog, _ = mask_program()
    with pytest.raises(ProgramError, match="matcher 'g' but it is not bound"):
        prog.run([Env(logits=torch.zeros(2, V), window=torch.tensor([7, 6]))])
    doc = p.to_dict()
    for matchers, msg in ((["h"], "unknown matcher 'g'"), (["g", "g"], "declared twice"), ([3], "non-empty name")):
        bad = dict(doc, matchers=matchers)
        with pytest.raises(ProgramError, match=msg):
            compile_program(__import__("json").dumps(bad))


def test_bad_grammars_are_clean_errors(grammars):
    for kind, src, msg in (("json-schema", "{", "not valid JSON"), ("json-schema", '{"type": 3}', "bad JSON schema"),
                           ("regex", "(a", "bad regex"), ("lark", "start: foo", "bad Lark grammar"),
                           ("yaml", "a: b", "unknown grammar kind")):
        with pytest.raises(GrammarError, match=msg):
            grammars.compile(kind, src)
    g = grammars.compile("regex", "a(b|1)*2")
    assert grammars.compile("regex", "a(b|1)*2") is g  # cached by content


def masked_verify_program(temperature: float):
    """Masked logits, then greedy or rejection-sampled verification of the window's drafts."""
    p = trace.Program(readout="window", vocab=V)
    g = p.matcher("g")
    w, logits = p.window(), p.logits()
    masked = p.where(p.grammar_mask(w, g), logits, p.const(-1e30))
    drafts = w[1:]
    if temperature == 0:
        n, toks, cnt = p.verify_greedy(drafts, masked.argmax())
    else:
        n, toks, cnt = p.verify_sample(drafts, masked.softmax(temperature))
    return p, compile_program(p.to_json()), n, toks


def test_greedy_masked_verification_never_accepts_a_forbidden_draft(grammars):
    m = grammars.compile("regex", "a(b|1)*2").matcher()
    p, prog, n, toks = masked_verify_program(0)
    logits = torch.zeros(4, V)
    logits[:, 14] = 9.0  # the model prefers 'x', which the grammar forbids everywhere
    logits[0, 6] = logits[1, 7] = logits[2, 9] = 1.0
    got_n, got = run_values(p, prog, Env(logits=logits, window=torch.tensor([3, 6, 14, 9]), matchers={"g": m}), n, toks)
    assert int(got_n) == 1 and got.tolist()[:2] == [6, 7]  # 'a' accepted; 'x' rejected for the allowed 'b'


def test_masked_rejection_sampling_gives_the_masked_distribution(grammars):
    """Drafts [a, x]: 'x' is forbidden. Over many seeds the first output token follows the masked,
    tempered target at row 0, and no forbidden token ever comes out; without the mask the
    test fails (the unmasked target puts mass on forbidden tokens)."""
    m = grammars.compile("regex", "(a|b|ab)(b|1)*2").matcher()
    p, prog, n, toks = masked_verify_program(0.8)
    torch.manual_seed(3)
    logits = torch.randn(3, V) * 1.5
    window = torch.tensor([3, 6, 14])
    envs = [Env(logits=logits, window=window, matchers={"g": m}, seed=s) for s in range(3000)]
    out = prog.run(envs, keep_values=True)
    n_in = len(p.to_dict()["inputs"])
    idx = p._where[toks.id][1] + n_in
    first = np.array([int(r.values[idx][0]) for r in out])
    allow = np.array(allowed(m))
    assert allow[first].all()
    target = torch.softmax(torch.where(torch.tensor(allow), logits[0], torch.tensor(-1e30)) / 0.8, -1).numpy()
    support = np.flatnonzero(target > 0)
    counts = np.array([(first == t).sum() for t in support])
    expected = target[support].astype(np.float64)
    assert stats.chisquare(counts, expected / expected.sum() * len(first)).pvalue > 1e-3
