"""MTP speculative decoding as device programs: the model's multi-token-prediction head drafts,
and drafting, verification and commit all run in the epilogue.

Pure Python (runs inside the Wasm component): only the epilogue tracer.

The prompt's pass (`mtp_prefill_program`) runs the whole prompt with readout on every row and folds
all but its last token; its epilogue runs the head over the folded rows (each row's hidden state
with the token after it) and chains it into the first window's drafts. Each round of the loop
(`mtp_program`) then verifies the window [t0, d1..dk] (greedy, or sampled against the target's own
draws, which the head's sampled drafts are coupled to: op mtp_draft), emits and folds 1 + accepted
rows, runs the head over exactly
the rows it folds (so its KV rows stay those of the committed text) and chains it k times for the
next window. The draft length adapts by cacheback's gate (`cacheback.gate`) under the head's rule
(`cacheback.HEAD_GATE`: a longer moving average, and no halving after a miss).
"""

from . import trace
from .cacheback import HEAD_GATE, gate
from .round import emit_and_fold, head_verify, verify_window


def mtp_prefill_program(*, drafter, draft_len=4, max_tokens=256, temperature=0.0, seed=0, window_capacity=None,
                        min_prob=0.0):
    """The prompt's pass: window = the prompt, readout on every row, fold len(prompt) - 1. Writes
    the first window [prompt[-1], drafts...] to channel "window" (capacity window_capacity, default
    draft_len + 1). min_prob: the head's confidence stop (op mtp_draft)."""
    K = int(draft_len)
    if K < 1:
        raise ValueError("draft_len must be >= 1")
    p = trace.Program(readout="window")
    p.channel("window", "i64", max(int(window_capacity or 0), K + 1))
    win, hidden = p.window(), p.hidden()
    W = win.size()
    t0 = p.dyn_slice(win, W - 1, 1, size=1)
    d, dn = p.mtp_draft(hidden, win[1:], W - 1, drafter, K, temperature, seed, min_prob=min_prob)
    k1 = p.minimum(dn, max(min(K, max_tokens - 1), 0))
    p.set("window", p.concat(t0, d), k1 + 1)
    return p.to_json()


def mtp_program(*, drafter, start, draft_len=4, eos_ids=(), max_tokens=256, temperature=0.0, top_p=1.0, seed=0,
                adaptive=True, probe_after=4, probe_max=32, gate_rule=HEAD_GATE, top_k=0, min_p=0.0,
                logit_bias=None, penalties=None, min_prob=0.0, rejection=False):
    """Trace the MTP round. start: the frozen length when the loop starts (len(prompt) - 1).
    min_prob: the chain stops before a draft the head gives less than that probability (op mtp_draft).
    seed: the ops' own seed, as cacheback_program's (default 0: plain decoding's draws).
    rejection: sampled drafts are verified by Leviathan's rule with the head's distributions as q
    (op draft_probs) instead of against the target's own draws; the output has the same
    distribution, but the committed tokens then depend on the draws, not only on the seed.
    Returns (json_text, channel specs {name, dtype, capacity, init}): "out", "window" (filled by the
    prefill program), and "spec_state" (the draft gate's state) when adaptive."""
    from .cacheback import GATE_INIT

    K = int(draft_len)
    if K < 1 or max_tokens < 1 or not 0 < top_p <= 1 or not 1 <= probe_after <= probe_max or not 0 <= min_prob <= 1:
        raise ValueError("need draft_len >= 1, max_tokens >= 1, 0 < top_p <= 1, 1 <= probe_after <= probe_max, "
                         "0 <= min_prob <= 1")
    p = trace.Program(readout="window")
    p.channel("out", "i64", max_tokens)
    p.channel("window", "i64", K + 1)
    logits, win, hidden = p.logits(), p.window(), p.hidden()
    drafts = win[1:]
    rule = head_verify(p, drafter, drafts, True) if temperature > 0 and rejection else None
    n, vt, cnt = verify_window(p, drafts, logits, temperature, top_p, seed, rule, top_k, min_p, logit_bias,
                               penalties)
    out_len, emit, fold = emit_and_fold(p, n, vt, cnt, eos_ids, max_tokens, int(start))
    # the head over the rows this round folds (row r with vt[r], the token after it), then its chain,
    # as long as the gate and the room left allow (a round that will not draft runs no chain)
    limit = p.maximum(max_tokens - out_len - emit - 1, 0)
    if adaptive:
        limit = p.minimum(limit, gate(p, drafts.size(), n, K, int(probe_after), int(probe_max), rule=gate_rule))
    d, k_next = p.mtp_draft(hidden, vt, fold, drafter, K, temperature, seed, limit=limit, min_prob=min_prob)
    t0 = p.dyn_slice(vt, n, 1, size=1)
    p.set("window", p.concat(t0, d), k_next + 1)
    specs = [{"name": "out", "dtype": "i64", "capacity": max_tokens, "init": []},
             {"name": "window", "dtype": "i64", "capacity": K + 1, "init": []}]
    if adaptive:
        specs.append({"name": "spec_state", "dtype": "i64", "capacity": 4, "init": [GATE_INIT, 0, int(probe_after), 1]})
    return p.to_json(), specs
