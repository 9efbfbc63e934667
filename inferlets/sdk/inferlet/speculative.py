"""The guest-side rejection rule (Leviathan et al.) for proposers that run in the guest.

Pure Python (runs inside the Wasm component). The device loop's rule is the epilogue op
`verify_sample`; this is the same rule for a proposer that verifies in the guest (proposer.py).
"""


def _normalise(w):
    s = float(sum(w))
    return [x / s for x in w] if s > 0 else list(w)


def _categorical(w, rng):
    """Index i with probability w_i / sum(w); -1 when no weight is positive."""
    total = float(sum(x for x in w if x > 0))
    if total <= 0:
        return -1
    u = rng.random() * total
    last = -1
    for i, x in enumerate(w):
        if x > 0:
            last = i
            u -= x
            if u < 0:
                return i
    return last


def verify(drafts, draft_probs, target_probs, rng):
    """Leviathan et al.'s rejection rule for a guest-side proposer.

    drafts: k token ids; draft_probs: k distributions over the vocabulary the drafts were
    drawn from (None: deterministic drafts, q one-hot); target_probs: k+1 target
    distributions (rows need not be normalised); rng: has .random() -> [0, 1).
    Draft i is accepted with probability min(1, p_i(x)/q_i(x)); at the first rejection the
    token is drawn from normalise(max(0, p_i - q_i)), or from p_k when all are accepted.
    Returns the committed tokens: the accepted drafts, then that token (len = accepted + 1).
    Their distribution is exactly the target's.
    """
    if len(target_probs) != len(drafts) + 1 or (draft_probs is not None and len(draft_probs) != len(drafts)):
        raise ValueError("need len(target_probs) == len(drafts) + 1 == len(draft_probs) + 1")
    out = []
    for i, x in enumerate(drafts):
        p = _normalise(target_probs[i])
        V = len(p)
        if draft_probs is None:
            q = [0.0] * V
            if 0 <= x < V:
                q[x] = 1.0
        else:
            q = _normalise(draft_probs[i])
        ok = 0 <= x < V
        if ok and rng.random() * q[x] < p[x]:
            out.append(x)
            continue
        resid = [max(0.0, a - b) for a, b in zip(p, q)]
        out.append(_categorical(resid if sum(resid) > 0 else p, rng))
        return out
    out.append(_categorical(target_probs[len(drafts)], rng))
    return out
