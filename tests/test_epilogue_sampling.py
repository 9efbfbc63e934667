"""Rejection sampling keeps the target distribution (chi-square, p > 0.001), and the
test catches a broken rule (a verifier that always accepts the draft)."""

import torch
from op_reference import covers
from scipy.stats import chisquare

from host.epilogue import Env, compile_program
from host.epilogue.ops import speculative
from host.epilogue.ir import VERSION
from host.epilogue.tensors import exp_race

V, K, TRIALS, ALPHA = 5, 2, 6000, 1e-3
P = torch.tensor([[0.50, 0.05, 0.20, 0.05, 0.20], [0.1, 0.2, 0.3, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])
Q = torch.tensor([[0.05, 0.60, 0.05, 0.25, 0.05], [0.3, 0.1, 0.1, 0.4, 0.1]])

# verify_sample(window[1:], p=logits (already probabilities), q=hidden[:K])
TEXT = __import__("json").dumps({
    "version": VERSION, "dims": {"W": K + 1, "R": K + 1, "V": V, "H": V},
    "inputs": [{"kind": "logits"}, {"kind": "window"}, {"kind": "hidden"}],
    "ops": [{"op": "slice", "args": [1], "attrs": {"start": 1}},
            {"op": "slice", "args": [2], "attrs": {"stop": K}},
            {"op": "verify_sample", "args": [3, 0, 4], "attrs": {"seed": 7}},
            {"op": "fold", "args": [7]}],
})


def first_tokens(one_hot=False, draft_seed=1234, logits=P, position=0):
    g = torch.Generator().manual_seed(draft_seed)
    drafts = torch.stack([torch.multinomial(Q[i], TRIALS, replacement=True, generator=g) for i in range(K)], 1)
    text = TEXT if not one_hot else TEXT.replace('"args": [3, 0, 4]', '"args": [3, 0]')
    prog = compile_program(text)
    hidden = torch.cat([Q, torch.zeros(1, V)])
    envs = [Env(logits=logits, window=torch.cat([torch.tensor([0]), drafts[t]]), hidden=hidden, seed=t, round=3,
                position=position) for t in range(TRIALS)]
    res = prog.run(envs, keep_values=True)
    toks = torch.stack([r.values[6] for r in res])  # [TRIALS, K+1]
    return toks, torch.stack([r.values[5] for r in res]), drafts


def chi_p(samples, probs):
    obs = torch.bincount(samples, minlength=V).double()
    exp = probs.double() / probs.double().sum() * len(samples)
    return chisquare(obs.numpy(), exp.numpy()).pvalue


@covers("verify_sample")
def test_rejection_sampling_keeps_target_distribution():
    toks, n, _ = first_tokens()
    assert chi_p(toks[:, 0], P[0]) > ALPHA
    # given the first draft was accepted, the second token is distributed as P[1]
    assert chi_p(toks[n >= 1, 1], P[1]) > ALPHA
    # both accepted: bonus token from P[2]
    assert (n == K).sum() > 100 and chi_p(toks[n == K, 2], P[2]) > ALPHA
    assert ((toks >= 0).sum(1) == n + 1).all()


@covers("verify_sample")
def test_deterministic_drafts_keep_target_distribution():
    toks, n, _ = first_tokens(one_hot=True)
    assert chi_p(toks[:, 0], P[0]) > ALPHA
    assert chi_p(toks[n >= 1, 1], P[1]) > ALPHA
    assert (n == K).sum() > 50 and chi_p(toks[n == K, 2], P[2]) > ALPHA


def test_deterministic_drafts_commit_the_targets_own_draws():
    """Without q, a row's token is the target's draw at that row's position whatever was drafted,
    and however the rounds split the text: the same seed gives the same tokens with any drafter."""
    a, na, _ = first_tokens(one_hot=True)
    b, nb, db = first_tokens(one_hot=True, draft_seed=99)
    assert torch.equal(a[:, 0], b[:, 0])  # other drafts, the same first token
    both = (na >= 1) & (nb >= 1)
    assert both.sum() > 100 and torch.equal(a[both, 1], b[both, 1])
    # a window starting one row later (its rows are the first window's rows 1..): its first token is
    # the first window's second where that window accepted its first draft
    later, _, _ = first_tokens(one_hot=True, logits=torch.cat([P[1:], P[:1]]), position=1)
    assert torch.equal(later[na >= 1, 0], a[na >= 1, 1])
    assert not torch.equal(later[:, 0], a[:, 0])  # the position keys the draw


def test_the_bonus_token_is_the_targets_own_draw_under_either_rule():
    """After k accepted drafts both rules commit t_k, the race over row k's p as given: scaled
    (unnormalised) weights give the same token under the rejection rule as without q."""
    g = torch.Generator().manual_seed(5)
    p = torch.rand(64, K + 1, V, generator=g) * 3.7  # weights, not probabilities
    drafts = torch.full((64, K), 1)
    q = torch.zeros(64, K, V)
    q[:, :, 1] = 1.0
    p[:, :K, 1] = 1e6  # draft 1 holds nearly all of rows < K's mass: accepted
    u_race = torch.rand(64, K + 1, V, generator=g)
    n, toks, _ = speculative.verify_sample(drafts, p, q, torch.full((64, K), 0.5), u_race)
    _, race, _ = speculative.verify_race(drafts, p, u_race)
    assert (n == K).all() and torch.equal(toks[:, K], race[:, K])


def test_broken_race_is_detected(monkeypatch):
    def always_accept(drafts, p, u):
        return speculative.verify_greedy(drafts, torch.cat([drafts, exp_race(p[:, -1:], u[:, -1:])], 1))

    monkeypatch.setattr(speculative, "verify_race", always_accept)
    toks, _, drafts = first_tokens(one_hot=True)
    assert torch.equal(toks[:, 0], drafts[:, 0])
    assert chi_p(toks[:, 0], P[0]) < ALPHA


def test_broken_rule_is_detected(monkeypatch):
    real = speculative.verify_sample

    def always_accept(drafts, p, q, u_accept, u_race):
        return real(drafts, p, q, torch.zeros_like(u_accept), u_race)

    monkeypatch.setattr(speculative, "verify_sample", always_accept)
    toks, _, drafts = first_tokens()
    assert torch.equal(toks[:, 0], drafts[:, 0])
    assert chi_p(toks[:, 0], P[0]) < ALPHA


def test_same_seed_same_round_same_sample():
    a, _, _ = first_tokens()
    b, _, _ = first_tokens()
    assert torch.equal(a, b)


# --- penalties (issue 53) ---------------------------------------------------------------

def _penalize_program(R: int, W: int, V: int, **attrs) -> str:
    return __import__("json").dumps({
        "version": VERSION, "dims": {"R": R, "W": W, "V": V},
        "inputs": [{"kind": "logits"}, {"kind": "history"}, {"kind": "window"}],
        "ops": [{"op": "penalize", "args": [0, 1, 2], "attrs": attrs}]})


@covers("penalize")
def test_penalize_is_hf_repetition_then_openai_penalties_row_by_row():
    """Readout on the window's last R rows: row r counts the history and the window up to its row;
    repetition is HF's processor to the bit, then OpenAI's frequency and presence over the output."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from host.runtime.sampling import Context, Sampler
    from host.epilogue.ops.sampling import Penalties

    g = torch.Generator().manual_seed(0)
    V, R, start = 50, 3, 12
    x = torch.randn(R, V, generator=g) * 4
    hist = torch.randint(0, V, (20,), generator=g)
    win = torch.tensor([7, 7, 60, 3])  # 60 is outside the vocabulary: it counts for nothing
    prog = compile_program(_penalize_program(R, len(win), V, start=start, presence=0.7, frequency=0.4,
                                             repetition=1.3))
    got = prog.run([Env(logits=x, history=hist, window=win)], keep_values=True)[0].values[3]
    sampler = Sampler(0.0, 1.0, 0, penalties=Penalties(0.7, 0.4, 1.3, start))
    ctx = torch.cat([hist, win])
    ends = [len(hist) + len(win) - R + 1 + r for r in range(R)]
    for r in range(R):
        seen = ctx[:ends[r]]
        seen = seen[seen < V]
        want = RepetitionPenaltyLogitsProcessor(1.3)(seen[None], x[r:r + 1].clone())[0]
        out = ctx[start:ends[r]]
        counts = torch.bincount(out[out < V], minlength=V).float()
        want = want - 0.4 * counts - 0.7 * (counts > 0).float()
        assert torch.equal(got[r], want), r
    assert counts[7] >= 2 and got[R - 1][7] != x[R - 1][7]
    # the host's sampler (a guest-driven pass) counts the same context: greedy picks the same tokens
    picks = sampler.sample(x, 0, Context(ctx.tolist(), ends))
    assert picks == got.argmax(-1).tolist()
    # off: the logits unchanged
    same = compile_program(_penalize_program(R, len(win), V)).run([Env(logits=x, history=hist, window=win)],
                                                                  keep_values=True)[0].values[3]
    assert torch.equal(same, x)


def test_penalize_refuses_bad_values():
    import pytest

    from host.epilogue.ir import ProgramError

    with pytest.raises(ProgramError, match="repetition penalty 0.0 must be > 0"):
        compile_program(_penalize_program(1, 2, 5, repetition=0.0))
    with pytest.raises(ProgramError, match="out of range"):
        compile_program(_penalize_program(1, 2, 5, start=-1))
