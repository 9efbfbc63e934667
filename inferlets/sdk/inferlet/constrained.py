"""Grammar-constrained speculative decoding as one epilogue (a device program).

Pure Python (runs inside the Wasm component): only the epilogue tracer.

Each round verifies the window [t0, d1..dk] under the grammar: the matcher's masks for the
window (`grammar_mask`: row j allows what the grammar allows after d1..dj) turn the logits
into constrained logits, verification (greedy, or Leviathan rejection sampling) over them
never accepts a forbidden draft, and its correction or bonus token is always allowed. The
committed tokens go to "out" (cut after EOS and at max_tokens) and to the matcher
(`grammar_commit`), which answers with the tokens the grammar now forces. The next window
drafts those forced tokens first (the mask forces them, so they are always accepted), then
continues by prompt lookup over the history, the committed tokens and the forced ones.
"""

from . import trace
from .reference import ngram_lookup
from .round import emit_and_fold, lookup_context, verify_window

MASKED = -1e30  # a forbidden token's logit: exp() of it, at any temperature, is 0
MATCHER = "grammar"


def constrained_program(*, prompt, draft_len_max=8, ngram_min=2, ngram_max=3, eos_ids=(), max_tokens=256,
                        temperature=0.0, top_p=1.0, seed=0, lookup_window=1024, forced=(), top_k=0, min_p=0.0,
                        logit_bias=None, penalties=None):
    """Trace the constrained speculative-decoding epilogue.

    The guest commits prompt[:-1] to the working set first, binds its matcher (at the grammar's
    start) as the program's matcher "grammar", then loops a pass whose window comes from channel
    "window" with readout on every row and the fold from the program. `forced`: the tokens the
    grammar forces at its start (the first window drafts them). Returns (json_text, channels):
    channel specs {name, dtype, capacity, init} for the guest to create: "out" (the committed
    tokens), "window" and "forced" (cell 0: forced tokens drafted so far).
    temperature <= 0 is greedy; K = 0 is constrained plain decoding.
    """
    K, Lw = int(draft_len_max), int(lookup_window)
    prompt = [int(x) for x in prompt]
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    if K < 0 or max_tokens < 1 or not 1 <= ngram_min <= ngram_max or Lw < 1:
        raise ValueError("need draft_len_max >= 0, max_tokens >= 1, 1 <= ngram_min <= ngram_max, lookup_window >= 1")
    if not 0 < top_p <= 1:
        raise ValueError("top_p must be in (0, 1]")
    base = len(prompt) - 1

    p = trace.Program(readout="window")
    g = p.matcher(MATCHER)
    p.channel("out", "i64", max_tokens)
    p.channel("window", "i64", K + 1)
    p.channel("forced", "i64", 1)
    logits, win = p.logits(), p.window()
    drafts = win[1:]
    masked = p.where(p.grammar_mask(win, g), p.penalized(p.biased(logits, logit_bias), penalties), p.const(MASKED))

    n, vt, cnt = verify_window(p, drafts, masked, temperature, top_p, seed, top_k=top_k, min_p=min_p)
    out_len, emit, _ = emit_and_fold(p, n, vt, cnt, eos_ids, max_tokens, base)

    # The matcher takes what was emitted; it answers with the tokens the grammar forces next.
    f, nf = p.grammar_commit(vt, emit, g, k=K)
    t0 = p.dyn_slice(vt, n, 1, size=1)
    if K == 0:
        p.set("window", t0)
        return p.to_json(), _channels(prompt, K, max_tokens, forced, ngram_min, ngram_max, Lw)

    # Drafts: the forced tokens, then prompt lookup continuing after them.
    ctx, ctx_len = lookup_context(p, win, vt, cnt, Lw, K)
    ctx = p.pack(ctx, ctx_len, f, nf, size=Lw + 2 * K + 2)
    cand, cand_n = p.ngram_lookup(ctx, K, ngram_min, ngram_max, length=ctx_len + nf)
    nxt = p.pack(f, nf, cand, cand_n, size=K)
    k_next = p.minimum(p.minimum(nf + cand_n, K), p.maximum(max_tokens - out_len - emit - 1, 0))
    p.set("window", p.concat(t0, nxt), k_next + 1)
    p.set("forced", p.read("forced")[:1] + p.minimum(nf, k_next))
    return p.to_json(), _channels(prompt, K, max_tokens, forced, ngram_min, ngram_max, Lw)


def _channels(prompt, K, max_tokens, forced, ngram_min, ngram_max, Lw):
    """Channel specs with initial contents: the first window drafts the grammar's forced start,
    then prompt lookup after it."""
    forced = [int(t) for t in forced][:K]
    drafts = list(forced)
    if len(drafts) < K:
        ctx = prompt[-Lw:] + drafts
        drafts += ngram_lookup(ctx, K - len(drafts), ngram_min, ngram_max)
    drafts = drafts[:max(min(K, max_tokens - 1), 0)]
    return [{"name": "out", "dtype": "i64", "capacity": max_tokens, "init": []},
            {"name": "window", "dtype": "i64", "capacity": K + 1, "init": prompt[-1:] + drafts},
            {"name": "forced", "dtype": "i64", "capacity": 1, "init": [min(len(forced), len(drafts))]}]
