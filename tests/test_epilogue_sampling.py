"""Rejection sampling keeps the target distribution (chi-square, p > 0.001), and the
test catches a broken rule (a verifier that always accepts the draft)."""

import torch
from op_reference import covers
from scipy.stats import chisquare

from host.epilogue import Env, compile_program
from host.epilogue.ops import speculative
from host.epilogue.ir import VERSION

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


def first_tokens(one_hot=False):
    g = torch.Generator().manual_seed(1234)
    drafts = torch.stack([torch.multinomial(Q[i], TRIALS, replacement=True, generator=g) for i in range(K)], 1)
    text = TEXT if not one_hot else TEXT.replace('"args": [3, 0, 4]', '"args": [3, 0]')
    prog = compile_program(text)
    hidden = torch.cat([Q, torch.zeros(1, V)])
    envs = [Env(logits=P, window=torch.cat([torch.tensor([0]), drafts[t]]), hidden=hidden, seed=t, round=3)
            for t in range(TRIALS)]
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


def test_deterministic_drafts_one_hot_q():
    toks, _, _ = first_tokens(one_hot=True)
    assert chi_p(toks[:, 0], P[0]) > ALPHA


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
