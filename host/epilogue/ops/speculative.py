"""Speculative decoding: prompt lookup (n-gram match) and verification of a draft chain,
greedy and by Leviathan et al.'s rejection rule."""

from __future__ import annotations

import numpy as np
import torch

from host.epilogue.ir import Dim, Value
from host.epilogue.tensors import Stream, exp_race
from host.epilogue.ops.spec import ARRAY, HOST, Attr, Variant, define, family, max_bound

F = family("speculative", "Speculative decoding:")


def _ngram_infer(t, av, at):
    seq = av[0]
    t.need(seq, "i64"), t.rank(seq, 1)
    if len(av) == 2:
        t.need(av[1], "i64"), t.rank(av[1], 0)
    if at["ngram_max"] < at["ngram_min"]:
        t.fail(f"attr 'ngram_max'={at['ngram_max']} is below ngram_min={at['ngram_min']}")
    return [Value("i64", (Dim.of(at["k"]),), seq.ub), Value("i64", (), [Dim.of(at["k"])])]


def _ngram(ctx, op, a):
    at = op.attrs
    return ngram_lookup(a[0], a[1] if len(a) == 2 else None, at["ngram_min"], at["ngram_max"], at["k"])


def _ngram_host(ctx, op, seq, lengths=None):
    at = op.attrs
    return ngram_lookup_host(seq, lengths, at["ngram_min"], at["ngram_max"], at["k"])


define("ngram_lookup", F, args=(1, 2), results=2,
       # a byte search of the history in host memory, with host lengths
       variants=(Variant((ARRAY,), (ARRAY, HOST), _ngram_host, host_memory=True, ctx=False),
                 Variant((ARRAY, HOST), (ARRAY, HOST), _ngram_host, host_memory=True, ctx=False)),
       attrs={"k": Attr("int", lo=1, hi=1024), "ngram_min": Attr("int", 1, lo=1, hi=64),
              "ngram_max": Attr("int", lambda at: max(at["ngram_min"], 3), lo=1, hi=64)},
       infer=_ngram_infer, impl=_ngram,
       doc="""`ngram_lookup(seq: i64 [n], [length: i64 []]; k, ngram_min=1, ngram_max=max(ngram_min, 3))`
-> (tokens i64 [k], count i64 []). Over seq[:length] (default n): for g from ngram_max down to
ngram_min, the suffix of length g; its most recent earlier occurrence starting at i < length-g
(occurrences may overlap the suffix); the first g with a match wins. A suffix holding a negative
token (padding) matches nothing. tokens = seq[i+g : min(i+g+k, length)] padded with -1; count =
their number (0 and all -1 when nothing matches).""")


def ngram_lookup(h: torch.Tensor, length: torch.Tensor | None, nmin: int, nmax: int, k: int):
    """Prompt lookup on [B, N] history: the longest suffix (nmax down to nmin) that also
    occurs earlier; its most recent earlier occurrence; the up-to-k tokens that followed it.

    One pass for all lengths: r[e] = how many tokens ending at e match the suffix (up to nmax),
    for every end e before the suffix's own last token; the best end has the largest r (at
    least nmin), then the largest e. About fifteen small ops, whatever nmax is. A suffix token
    that is negative (padding) matches nothing."""
    B, N = h.shape
    dev = h.device
    L = torch.full((B,), N, dtype=torch.int64, device=dev) if length is None else length.clamp(0, N)
    m = max(min(nmax, N), 0)
    if N < 2 or m < nmin:
        return [torch.full((B, k), -1, dtype=h.dtype, device=dev), torch.zeros((B,), dtype=torch.int64, device=dev)]
    sidx = L.unsqueeze(1) - 1 - torch.arange(m, device=dev)  # [B, m]: suffix[j] = h[L-1-j]
    suffix = torch.where(sidx >= 0, h.gather(1, sidx.clamp(0, N - 1)), -1)
    # back[b, e, j] = h[e-j] (-2 before the start: matches no token, nor the -1 padding)
    back = torch.cat([torch.full((B, m - 1), -2, dtype=h.dtype, device=dev), h], 1).unfold(1, m, 1).flip(-1)
    eq = (back == suffix.unsqueeze(1)) & (suffix >= 0).unsqueeze(1)
    run = eq.to(torch.int64).cumprod(-1).sum(-1)  # [B, N]
    e = torch.arange(N, device=dev)
    run = torch.where((e.unsqueeze(0) <= (L - 2).unsqueeze(1)) & (run >= nmin), run, 0)
    key = torch.where(run > 0, run * N + e, -1).amax(-1)  # longest run, then the latest end
    found = key >= 0
    start = key % N + 1  # first follower
    pos = start.unsqueeze(1) + torch.arange(k, device=dev)
    ok = found.unsqueeze(1) & (pos < L.unsqueeze(1))
    toks = torch.where(ok, h.gather(1, pos.clamp(0, N - 1)), -1)
    return [toks, ok.sum(-1)]


def ngram_lookup_host(h: np.ndarray, lengths: list[int] | None, nmin: int, nmax: int, k: int):
    """ngram_lookup for a history in host memory (int64 [B, N]), with host lengths: the same
    result, found by a byte search of each row (C speed, a few us for a thousand tokens) instead
    of ~15 tensor ops. Returns (tokens [B, k], per-row counts)."""
    B, N = h.shape
    toks, counts = np.full((B, k), -1, dtype=h.dtype), []
    for b in range(B):
        L = N if lengths is None else min(max(lengths[b], 0), N)
        raw = h[b, :L].tobytes()
        start = _latest_match(raw, h[b, :L], L, nmin, min(nmax, N))
        n = 0 if start < 0 else min(k, L - start)
        if n:
            toks[b, :n] = h[b, start:start + n]
        counts.append(n)
    return toks, counts


def _latest_match(raw: bytes, row, L: int, nmin: int, m: int) -> int:
    """Where the followers of the suffix's latest earlier occurrence start (longest suffix
    first, m down to nmin), else -1. raw holds row's L tokens as 8-byte cells."""
    for g in range(min(m, L - 1), nmin - 1, -1):
        if (row[L - g:] < 0).any():  # padding in the suffix matches nothing
            continue
        pat, end = raw[(L - g) * 8:], (L - 1) * 8  # an occurrence must end before the suffix's last token
        while (o := raw.rfind(pat, 0, end)) >= 0:
            if o % 8 == 0:  # cell-aligned: a real occurrence
                return o // 8 + g
            end = o + len(pat) - 1
    return -1


def _verify_infer(name):
    def infer(t, av, at):
        drafts = av[0]
        t.need(drafts, "i64"), t.rank(drafts, 1)
        k = drafts.shape[0]
        if name == "verify_greedy":
            target = av[1]
            t.need(target, "i64"), t.rank(target, 1)
            if target.shape[0] != k + 1:
                t.fail(f"shape mismatch: target {target} must have one more row than drafts {drafts}")
            vocab_ub = max_bound(drafts.ub, target.ub)
        else:
            p = av[1]
            t.need(p, "f32"), t.rank(p, 2)
            if p.shape[0] != k + 1:
                t.fail(f"shape mismatch: p {p} must have one more row than drafts {drafts}")
            if len(av) == 3:
                q = av[2]
                t.need(q, "f32"), t.rank(q, 2)
                if q.shape != (k, p.shape[1]):
                    t.fail(f"shape mismatch: q {q} must be [{k}, {p.shape[1]}]")
            vocab_ub = [p.shape[1] + -1]
        return [Value("i64", (), [k]), Value("i64", (k + 1,), vocab_ub), Value("i64", (), [k + 1])]
    return infer


def _verify_sample(ctx, op, a):
    drafts, p = a[0], a[1]
    q = a[2] if len(a) == 3 else None
    k, V = drafts.shape[1], p.shape[2]
    seed = op.attrs["seed"]
    # row i's draws are keyed by row i's own position (p's rows are the window's rows), never by
    # where the window starts: the outcome at a position does not depend on how rounds split the text
    draw = ctx.row_uniforms(Stream.SAMPLE, seed, k + 1, [V])
    if q is None:
        return verify_race(drafts, p, draw)
    u_accept = ctx.row_uniforms(Stream.VERIFY_ACCEPT, seed, k, [])
    u_resid = ctx.row_uniforms(Stream.VERIFY_RESIDUAL, seed, k, [V])
    return verify_sample(drafts, p, q, u_accept, torch.cat([u_resid, draw[:, k:]], 1))


define("verify_greedy", F, args=2, results=3, infer=_verify_infer("verify_greedy"),
       impl=lambda ctx, op, a: verify_greedy(a[0], a[1]),
       variants=(Variant((ARRAY, ARRAY), (ARRAY, ARRAY, ARRAY), lambda ctx, op, d, t: verify_greedy_np(d, t),
                         host_memory=True, ctx=False),),
       doc="""`verify_greedy(drafts: i64 [k], target: i64 [k+1])` -> (accepted n i64 [], tokens i64 [k+1],
count i64 []). n = number of leading drafts equal to target; tokens = target[:n+1] (the accepted
drafts, then the target's token at the first mismatch, or the bonus token when all are accepted),
then -1; count = n+1. Typical: drafts = window[1:], target = argmax(logits) with dims
`{"R": "W"}`; k may be 0.""")

define("verify_sample", F, args=(2, 3), results=3, attrs={"seed": Attr("int", 0)},
       infer=_verify_infer("verify_sample"), impl=_verify_sample,
       doc="""`verify_sample(drafts: i64 [k], p: f32 [k+1, V], [q: f32 [k, V]]; seed=0)` -> the same three
results. p's rows are the window's rows (readout on every row) and q's the drafts' distributions;
each row's random draws are keyed by the run's seed, the op's seed and that row's own position.
Without q the drafts were deterministic (prompt lookup, a grammar, earlier requests): row i's
token is the target's own draw t_i from p_i (the exponential race the `sample` op runs, over
row i's uniforms) and a draft is accepted while it equals t_i, so the committed tokens are the
same whatever was drafted (an accepted draft with probability p_i(x), as rejection sampling with
a one-hot q gives). With q, Leviathan et al.'s rule: draft i is accepted when u_i * q_i(x_i) <
p_i(x_i) (with probability min(1, p/q)); the token at the first rejection is drawn from
normalise(max(0, p_n - q_n)) (from p_n when that is all zero), and the bonus token after k
accepted drafts is t_k. n = leading accepts; drafts outside [0, V) are rejected. Either way the
output tokens follow p exactly.""")


def verify_greedy(drafts: torch.Tensor, target: torch.Tensor):
    """drafts [B, k], target [B, k+1] -> accepted n, tokens [B, k+1] (target[:n+1], then -1), count n+1."""
    k = drafts.shape[1]
    n = (drafts == target[:, :k]).to(torch.int64).cumprod(-1).sum(-1)
    j = torch.arange(k + 1, device=drafts.device).unsqueeze(0)
    toks = torch.where(j <= n.unsqueeze(1), target, torch.full_like(target, -1))
    return [n, toks, n + 1]


def verify_greedy_np(drafts: np.ndarray, target: np.ndarray):
    """verify_greedy on int64 arrays in host memory: a scan of a few Python ints per pass costs
    less than numpy's cumprod and where on a window this short."""
    k = drafts.shape[1]
    toks, ns = target.copy(), []
    for b, (d, t) in enumerate(zip(drafts.tolist(), target.tolist())):
        n = 0
        while n < k and d[n] == t[n]:
            n += 1
        toks[b, n + 1:] = -1
        ns.append(n)
    n = np.array(ns, dtype=np.int64)
    return n, toks, n + 1


def verify_race(drafts, p, u):
    """Deterministic drafts against the target's own draws: t = exp_race(p, u) per row [B, k+1]
    (p as given: the weights plain sampling draws from), then verify_greedy(drafts, t)."""
    return verify_greedy(drafts, exp_race(p, u))


def verify_sample(drafts, p, q, u_accept, u_race):
    """Leviathan et al. rejection sampling. drafts [B, k], p [B, k+1, V] target probabilities,
    q [B, k, V] draft probabilities; u_race [B, k+1, V]: each row's residual draw's uniforms, then
    the bonus row's."""
    B, k = drafts.shape
    V = p.shape[2]
    pk = p[:, :k] / p[:, :k].sum(-1, keepdim=True).clamp_min(1e-30)
    valid = (drafts >= 0) & (drafts < V)
    dc = drafts.clamp(0, V - 1).unsqueeze(-1)
    q = q / q.sum(-1, keepdim=True).clamp_min(1e-30)
    px = pk.gather(-1, dc).squeeze(-1)
    qx = q.gather(-1, dc).squeeze(-1)
    accept = valid & (u_accept * qx < px)  # u < p(x)/q(x) without dividing
    n = accept.to(torch.int64).cumprod(-1).sum(-1)
    resid = (pk - q).clamp_min(0)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, pk)  # p == q: residual is empty
    # row k: the bonus token is the target's own draw t_k, raced over p as given (as verify_race and
    # `sample` race it: the same bits whichever rule verified the drafts before it)
    dist = torch.cat([resid, p[:, k:]], dim=1)
    samples = exp_race(dist, u_race)  # [B, k+1]
    s = samples.gather(1, n.unsqueeze(1))
    j = torch.arange(k + 1, device=p.device).unsqueeze(0)
    dpad = torch.cat([drafts, torch.full((B, 1), -1, dtype=drafts.dtype, device=drafts.device)], dim=1)  # k may be 0
    toks = torch.where(j < n.unsqueeze(1), dpad, torch.where(j == n.unsqueeze(1), s, torch.full_like(dpad, -1)))
    return [n, toks, n + 1]


