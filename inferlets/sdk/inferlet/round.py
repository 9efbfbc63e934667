"""The parts of a speculative round's device program that every device-loop inferlet traces the
same way: verify the window, emit and fold what it commits, and the context prompt lookup
searches for the next drafts. Pure Python (runs inside the Wasm component): only the tracer."""


def verify_window(p, drafts, logits, temperature, top_p, seed, verify=None, top_k=0, min_p=0.0, bias=None,
                  penalties=None):
    """n accepted drafts, vt = the committed tokens (accepted drafts, then the target's), cnt = n + 1:
    greedy (temperature <= 0) or sampled: each row's token is the target's own draw from its
    distribution under the one sampling rule (temperature, top-k, min-p, top-p: `p.filtered`), and
    drafts are accepted while they equal it (op verify_sample without q), so the committed tokens
    are the same whatever was drafted and have plain sampling's distribution.
    verify(p, drafts, probs, seed) replaces that rule (e.g. head_verify's rejection rule).
    bias: a logit bias {token id: value}, added first (greedy too); then penalties (args.Penalties),
    row i counting the drafts before it as plain decoding counts its committed tokens."""
    logits = p.penalized(p.biased(logits, bias), penalties)
    if temperature <= 0:
        return p.verify_greedy(drafts, logits.argmax())
    x = p.filtered(logits, temperature, top_k, top_p, min_p)
    rule = verify or (lambda prog, d, probs, s: prog.verify_sample(d, probs, seed=s))
    return rule(p, drafts, x.softmax(), seed)


def head_verify(p, drafter, drafts, from_head):
    """verify_window's rule by Leviathan's rejection rule for drafts that may come from an MTP head:
    q = the head's distributions (from_head, a bool scalar) or one-hot (deterministic drafts, e.g.
    prompt lookup's). mtp_program(rejection=True) uses it."""
    q = p.draft_probs(drafts, from_head, drafter)
    return lambda prog, d, probs, s: prog.verify_sample(d, probs, q, seed=s)


def emit_and_fold(p, n, vt, cnt, eos_ids, max_tokens, base):
    """Append the committed tokens to "out", cut after the first EOS and at max_tokens in total;
    fold t0 plus the accepted drafts (fewer when the output was cut: the rows before the last
    emitted token); stop at EOS or the limit. base: the frozen length when the loop started, so
    the tokens produced so far are history length - base. Returns (out_len, emit, fold)."""
    out_len = p.history().size() - base
    room = p.maximum(max_tokens - out_len, 0)
    j = p.arange("W")
    hit = j < 0  # all false, [W]
    for e in eos_ids:
        hit = hit | (vt == int(e))
    hit = hit & (j < cnt)
    any_eos = hit.any()
    emit = p.minimum(p.where(any_eos, hit.cast("i64").argmax() + 1, cnt), room)
    p.put("out", vt, emit)
    fold = p.minimum(n + 1, p.maximum(emit, 1))
    p.fold(fold)
    p.stop_if(any_eos | (out_len + emit >= max_tokens))
    return out_len, emit, fold


def lookup_context(p, win, vt, cnt, Lw, K):
    """The last Lw history tokens, then t0 and this round's committed tokens: the text prompt
    lookup searches for the next drafts. Returns (ctx [Lw + K + 2], its length)."""
    hist = p.history()
    N = hist.size()
    hl = p.minimum(N, Lw)
    ctx = p.pack(p.dyn_slice(hist, N - hl, hl, size=Lw), hl, p.concat(win[:1], vt), cnt + 1, size=Lw + K + 2)
    return ctx, hl + cnt + 1
