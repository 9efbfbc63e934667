"""Torch implementations of the IR's ops, on batched tensors [B, ...].

Every runtime value carries a leading batch dim B (passes of several working
sets running the same program). Axis attrs in the IR are for the unbatched
value; the validator has normalised them to be non-negative, so +1 here.
No kernel reads a tensor back to the host: lengths and counts stay on the device
(ngram_lookup_host is the executor's variant for host-readable memory, with host lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from host.epilogue.validate import Op, Value

TORCH_DTYPE = {"i64": torch.int64, "f32": torch.float32, "bool": torch.bool}
DEFAULT_FILL = {"i64": -1, "f32": 0.0, "bool": False}
_MASK64 = (1 << 64) - 1


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, rnd: int, op_index: int, salt: int) -> int:
    """Generator seed for one row of one sampling op: a host-side hash of host ints (no sync)."""
    h = 0
    for part in (seed, rnd, op_index, salt):
        h = _splitmix(h ^ (part & _MASK64))
    return h & ((1 << 63) - 1)


@dataclass
class Ctx:
    B: int
    device: torch.device
    bind: dict[str, int]
    seeds: list[int]
    rounds: list[int]
    values: list[Value]

    def shape(self, v: Value) -> list[int]:
        return [d.resolve(self.bind) for d in v.shape]

    def uniforms(self, op: Op, shape: list[int]) -> torch.Tensor:
        """[B, *shape] uniforms in [0, 1); row b drawn from its own generator so a row's
        draws do not depend on which other passes share the batch."""
        salt = op.attrs.get("seed", 0)
        rows = []
        for s, r in zip(self.seeds, self.rounds):
            g = torch.Generator(device=self.device)
            g.manual_seed(row_seed(s, r, op.index, salt))
            rows.append(torch.rand(shape, generator=g, device=self.device, dtype=torch.float32))
        return torch.stack(rows)


def _align(t: torch.Tensor, rank: int) -> torch.Tensor:
    while t.dim() - 1 < rank:
        t = t.unsqueeze(1)
    return t


def _fill_of(op: Op, dtype: str):
    return op.attrs.get("fill", DEFAULT_FILL[dtype])


def _gather_fill(x: torch.Tensor, idx: torch.Tensor, fill) -> torch.Tensor:
    """x[b, idx[b, j]] along dim 1 of 2-D x; out-of-range indices give `fill`."""
    n = x.shape[1]
    if n == 0:
        return torch.full(idx.shape, fill, dtype=x.dtype, device=x.device)
    ok = (idx >= 0) & (idx < n)
    out = x.gather(1, idx.clamp(0, n - 1))
    return out.masked_fill(~ok, fill)


def _exp_race(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample an index over the last axis with P(i) = w_i / sum(w) (exponential race:
    argmax of log w - log E, E = -log u ~ Exp(1)); no normalisation needed, no sync.
    Rows without a positive weight give -1."""
    logw = torch.where(weights > 0, weights.clamp_min(1e-38).log(), torch.full_like(weights, -torch.inf))
    e = -torch.log(u.clamp_min(1e-38))
    idx = argmax(logw - torch.log(e))
    return torch.where((weights > 0).any(-1), idx, torch.full_like(idx, -1))


_NP_ARGMAX = (torch.float32, torch.float64, torch.int64, torch.int32)


def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """torch.argmax over `dim` (first index of the largest value; a NaN counts as the largest).
    On the CPU, numpy's vectorised argmax gives the same index ~10x faster than torch's
    (5 us against 50 us for one row of a 49k vocabulary here): greedy decoding pays it every round."""
    if x.device.type == "cpu" and x.dtype in _NP_ARGMAX and x.numel() and not x.requires_grad:
        return torch.from_numpy(argmax_np(x.numpy(), dim))
    return x.argmax(dim)


def argmax_np(x: np.ndarray, dim: int) -> np.ndarray:
    """`argmax` of an array in host memory, as an array (the method: np.argmax's Python wrappers
    cost more than the call itself right after a model call)."""
    out = x.argmax(axis=dim)
    return out if isinstance(out, np.ndarray) else np.asarray(out)


def _safe_int_div(a, b, mode):
    zero = b == 0
    b1 = torch.where(zero, torch.ones_like(b), b)
    out = torch.div(a, b1, rounding_mode="floor") if mode == "floordiv" else torch.remainder(a, b1)
    return out.masked_fill(zero, 0)


_BIN = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "minimum": torch.minimum, "maximum": torch.maximum,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
    "and": torch.logical_and, "or": torch.logical_or, "xor": torch.logical_xor,
    "floordiv": lambda a, b: _safe_int_div(a, b, "floordiv"),
    "mod": lambda a, b: _safe_int_div(a, b, "mod"),
}
_UN = {"neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "not": torch.logical_not}


def run_op(ctx: Ctx, op: Op, a: list[torch.Tensor]) -> list[torch.Tensor]:
    name, at = op.name, op.attrs
    outv = [ctx.values[o] for o in op.outs]
    B, dev = ctx.B, ctx.device

    if name in _BIN:
        r = len(outv[0].shape)
        return [_BIN[name](_align(a[0], r), _align(a[1], r))]
    if name in _UN:
        return [_UN[name](a[0])]
    if name == "where":
        r = len(outv[0].shape)
        return [torch.where(*(_align(t, r) for t in a))]
    if name == "cast":
        return [a[0].to(TORCH_DTYPE[at["dtype"]])]
    if name == "const":
        t = torch.tensor(at["value"], dtype=TORCH_DTYPE[at["dtype"]], device=dev)
        return [t.unsqueeze(0).expand(B, *t.shape)]
    if name == "full":
        return [torch.full([B, *ctx.shape(outv[0])], at["value"], dtype=TORCH_DTYPE[at["dtype"]], device=dev)]
    if name == "arange":
        n = ctx.shape(outv[0])[0]
        start = at.get("start", 0)
        return [torch.arange(start, start + n, device=dev).unsqueeze(0).expand(B, n)]
    if name == "size":
        x = ctx.values[op.args[0]]
        d = x.shape[at.get("axis", 0) % len(x.shape)].resolve(ctx.bind)
        return [torch.full((B,), d, dtype=torch.int64, device=dev)]

    if name in ("sum", "prod", "min", "max", "argmax", "argmin", "any", "all"):
        x = a[0]
        ax = at.get("axis", -1) % (x.dim() - 1) + 1
        if name == "sum":
            return [x.sum(ax, dtype=torch.int64) if x.dtype == torch.bool else x.sum(ax)]
        fn = {"prod": torch.prod, "min": torch.amin, "max": torch.amax, "argmax": argmax,
              "argmin": torch.argmin, "any": torch.any, "all": torch.all}[name]
        return [fn(x, dim=ax)]
    if name in ("cumsum", "cumprod"):
        x = a[0]
        ax = at.get("axis", -1) % (x.dim() - 1) + 1
        if x.dtype == torch.bool:
            x = x.to(torch.int64)
        return [x.cumsum(ax) if name == "cumsum" else x.cumprod(ax)]

    if name == "softmax":
        x = a[0]
        ax = at.get("axis", -1) % (x.dim() - 1) + 1
        return [torch.softmax(x / float(at.get("temperature", 1.0)), dim=ax)]
    if name == "top_k":
        x = a[0]
        k = min(at["k"], x.shape[-1])
        kth = x.topk(k, dim=-1).values[..., -1:]
        return [x.masked_fill(x < kth, -torch.inf)]
    if name == "top_p":
        x = a[0]
        srt, order = x.sort(dim=-1, descending=True)
        probs = torch.softmax(srt, dim=-1)
        # Drop a token when the tokens ranked above it already hold mass >= p (the top one is always kept).
        drop_sorted = (probs.cumsum(-1) - probs) >= float(at["p"])
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        return [x.masked_fill(drop, -torch.inf)]
    if name == "sample":
        w = a[0]
        return [_exp_race(w, ctx.uniforms(op, list(w.shape[1:])))]
    if name == "rand":
        return [ctx.uniforms(op, ctx.shape(outv[0]))]

    if name == "index":
        x = a[0]
        ax = at.get("axis", 0) % (x.dim() - 1) + 1
        return [x.select(ax, at["i"])]
    if name == "slice":
        x = a[0]
        ax = at.get("axis", 0) % (x.dim() - 1) + 1
        return [x[(slice(None),) * ax + (slice(at.get("start"), at.get("stop")),)]]
    if name == "take":
        x, idx = a
        fill = _fill_of(op, outv[0].dtype)
        n, rest = x.shape[1], list(x.shape[2:])
        flat = idx.reshape(B, -1)
        m = flat.shape[1]
        if n == 0:
            return [torch.full([B, *idx.shape[1:], *rest], fill, dtype=x.dtype, device=dev)]
        ok = ((flat >= 0) & (flat < n)).view(B, m, *[1] * len(rest))
        ic = flat.clamp(0, n - 1).view(B, m, *[1] * len(rest)).expand(B, m, *rest)
        out = x.gather(1, ic).masked_fill(~ok, fill)
        return [out.reshape(B, *idx.shape[1:], *rest)]
    if name == "gather":
        x, idx = a
        fill = _fill_of(op, outv[0].dtype)
        n = x.shape[-1]
        if n == 0:
            return [torch.full(idx.shape, fill, dtype=x.dtype, device=dev)]
        ok = (idx >= 0) & (idx < n)
        return [x.gather(-1, idx.clamp(0, n - 1)).masked_fill(~ok, fill)]
    if name == "concat":
        ax = at.get("axis", 0) % (a[0].dim() - 1) + 1
        return [torch.cat(a, dim=ax)]
    if name == "pack":
        x, xl, y, yl = a
        size = at["size"]
        fill = _fill_of(op, outv[0].dtype)
        j = torch.arange(size, device=dev).unsqueeze(0).expand(B, size)
        la = xl.clamp(0, x.shape[1]).unsqueeze(1)
        lb = yl.clamp(0, y.shape[1]).unsqueeze(1)
        from_a = _gather_fill(x, torch.where(j < la, j, -1), fill)
        from_b = _gather_fill(y, torch.where((j >= la) & (j < la + lb), j - la, -1), fill)
        return [torch.where(j < la, from_a, from_b)]
    if name == "dyn_slice":
        x, start, length = a
        size = at["size"]
        j = torch.arange(size, device=dev).unsqueeze(0).expand(B, size)
        idx = torch.where(j < length.unsqueeze(1), start.unsqueeze(1) + j, -1)
        return [_gather_fill(x, idx, _fill_of(op, outv[0].dtype))]

    if name == "ngram_lookup":
        return ngram_lookup(a[0], a[1] if len(a) == 2 else None, *ngram_params(at))
    if name == "verify_greedy":
        return verify_greedy(a[0], a[1])
    if name == "verify_sample":
        drafts, p = a[0], a[1]
        q = a[2] if len(a) == 3 else None
        k, V = drafts.shape[1], p.shape[2]
        u_accept = ctx.uniforms(op, [k])
        u_race = ctx.uniforms(Op(op.index, op.name, op.args, {"seed": op.attrs.get("seed", 0) ^ 0x5EED}, op.outs),
                              [k + 1, V])
        return verify_sample(drafts, p, q, u_accept, u_race)
    if name == "lru_lookup":
        return lru_lookup(a[0], a[1], a[2], at["g"], at["k"])
    if name == "lru_update":
        return lru_update(a[0], a[1], a[2], a[3], a[4], at["g"], at["k"])
    raise NotImplementedError(name)  # effects are handled by the executor


def ngram_params(at: dict) -> tuple[int, int, int]:
    """An ngram_lookup op's (ngram_min, ngram_max, k), with the IR's defaults."""
    nmin = at.get("ngram_min", 1)
    return nmin, at.get("ngram_max", max(nmin, 3)), at["k"]


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


def ngram_lookup_host(h: torch.Tensor, lengths: list[int] | None, nmin: int, nmax: int, k: int):
    """ngram_lookup for a history whose memory the host reads (the CPU), with host lengths:
    the same result, found by a byte search of each row (C speed, a few us for a thousand
    tokens) instead of ~15 tensor ops. Returns (tokens [B, k], per-row counts)."""
    B, N = h.shape
    rows = h.to(torch.int64).numpy()
    toks, counts = torch.full((B, k), -1, dtype=h.dtype), []
    for b in range(B):
        L = N if lengths is None else min(max(lengths[b], 0), N)
        raw = rows[b, :L].tobytes()
        start = _latest_match(raw, rows[b, :L], L, nmin, min(nmax, N))
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


def verify_greedy(drafts: torch.Tensor, target: torch.Tensor):
    """drafts [B, k], target [B, k+1] -> accepted n, tokens [B, k+1] (target[:n+1], then -1), count n+1."""
    k = drafts.shape[1]
    n = (drafts == target[:, :k]).to(torch.int64).cumprod(-1).sum(-1)
    j = torch.arange(k + 1, device=drafts.device).unsqueeze(0)
    toks = torch.where(j <= n.unsqueeze(1), target, torch.full_like(target, -1))
    return [n, toks, n + 1]


def verify_sample(drafts, p, q, u_accept, u_race):
    """Leviathan et al. rejection sampling. drafts [B, k], p [B, k+1, V] target probabilities,
    q [B, k, V] draft probabilities (None: drafts were deterministic, q is one-hot)."""
    B, k = drafts.shape
    V = p.shape[2]
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    valid = (drafts >= 0) & (drafts < V)
    dc = drafts.clamp(0, V - 1).unsqueeze(-1)
    if q is None:
        q = torch.zeros(B, k, V, dtype=p.dtype, device=p.device).scatter(-1, dc, 1.0)
    else:
        q = q / q.sum(-1, keepdim=True).clamp_min(1e-30)
    px = p[:, :k].gather(-1, dc).squeeze(-1)
    qx = q.gather(-1, dc).squeeze(-1)
    accept = valid & (u_accept * qx < px)  # u < p(x)/q(x) without dividing
    n = accept.to(torch.int64).cumprod(-1).sum(-1)
    resid = (p[:, :k] - q).clamp_min(0)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p[:, :k])  # p == q: residual is empty
    dist = torch.cat([resid, p[:, k:]], dim=1)  # row k: bonus token from p
    samples = _exp_race(dist, u_race)  # [B, k+1]
    s = samples.gather(1, n.unsqueeze(1))
    j = torch.arange(k + 1, device=p.device).unsqueeze(0)
    dpad = torch.cat([drafts, torch.full((B, 1), -1, dtype=drafts.dtype, device=drafts.device)], dim=1)  # k may be 0
    toks = torch.where(j < n.unsqueeze(1), dpad, torch.where(j == n.unsqueeze(1), s, torch.full_like(dpad, -1)))
    return [n, toks, n + 1]


def lru_lookup(table: torch.Tensor, stamps: torch.Tensor, key: torch.Tensor, g: int, k: int):
    """table [B, S*(g+k)], stamps [B, S], key [B, g] -> followers [B, k] (-1 padded), count [B].
    The live entry whose leader equals key (the most recent one if several); none: count 0."""
    B, S = stamps.shape
    rows = table.view(B, S, g + k)
    match = (stamps >= 0) & (rows[..., :g] == key.unsqueeze(1)).all(-1) & (key >= 0).all(-1, keepdim=True)
    best = argmax(torch.where(match, stamps, torch.full_like(stamps, -1)))
    fol = rows[..., g:].gather(1, best.view(B, 1, 1).expand(B, 1, k)).squeeze(1)
    ok = (fol >= 0).to(torch.int64).cumprod(-1).bool() & match.any(-1, keepdim=True)
    return [torch.where(ok, fol, torch.full_like(fol, -1)), ok.sum(-1)]


def lru_update(table: torch.Tensor, stamps: torch.Tensor, seq: torch.Tensor, length: torch.Tensor,
               leaders: torch.Tensor, g: int, k: int):
    """Write the leaders seq[i : i+g], i < leaders, that have a follower, with followers
    seq[i+g : min(i+g+k, length)] (cut at the first negative token), as one group: of equal
    leaders the last counts; a leader already in the table refreshes its row; new leaders take,
    in order, the empty rows and then the least recently stamped rows this update does not
    refresh (when there are more new leaders than such rows, the earliest are dropped).
    Written rows are stamped max(stamps)+1, +2, ... in sequence order. No loop over positions:
    a fixed number of ops whatever the sequence length."""
    B, S = stamps.shape
    n = seq.shape[1]
    dev = seq.device
    if n < g + 1 or S == 0:
        return [table.clone(), stamps.clone()]
    rows = table.view(B, S, g + k)
    L = length.clamp(0, n).unsqueeze(1)
    padded = torch.cat([seq, torch.full((B, k), -1, dtype=seq.dtype, device=dev)], 1)
    ends = torch.arange(g - 1, n - 1, device=dev)  # leader end positions with room for a follower
    E = ends.shape[0]
    leads = padded.unfold(1, g, 1)[:, ends - g + 1]  # [B, E, g]
    pos = ends.view(-1, 1) + 1 + torch.arange(k, device=dev)  # [E, k]
    fols = padded[:, pos]  # [B, E, k]
    ok = ((fols >= 0) & (pos < L.unsqueeze(1))).to(torch.int64).cumprod(-1).bool()
    fols = torch.where(ok, fols, -1)
    active = ok[..., 0] & (leads >= 0).all(-1) & (ends - g + 1 < leaders.unsqueeze(1))  # [B, E]
    # the last active occurrence of each leader wins
    same = (leads.unsqueeze(2) == leads.unsqueeze(1)).all(-1)  # [B, E, E]
    later = torch.ones(E, E, dtype=torch.bool, device=dev).triu(1)
    eff = active & ~(same & later & active.unsqueeze(1)).any(-1)
    match = (stamps >= 0).unsqueeze(1) & (rows[..., :g].unsqueeze(1) == leads.unsqueeze(2)).all(-1)  # [B, E, S]
    found = match.any(-1)
    hit, new = eff & found, eff & ~found
    hit_slot = argmax(match.to(torch.int64))
    refreshed = torch.zeros(B, S + 1, dtype=torch.bool, device=dev).scatter(
        1, torch.where(hit, hit_slot, S), True)[:, :S]
    # rows new leaders may take: empty, then least recently stamped; refreshed rows last
    order = torch.where(refreshed, stamps.amax(-1, keepdim=True) + 1, stamps).sort(dim=-1, stable=True).indices
    n_free = S - refreshed.sum(-1, keepdim=True)
    rank = new.to(torch.int64).cumsum(-1) - 1
    drop = (new.sum(-1, keepdim=True) - n_free).clamp(min=0)
    new = new & (rank >= drop)
    new_slot = order.gather(1, (rank - drop).clamp(0, S - 1))
    write = hit | new
    slot = torch.where(hit, hit_slot, torch.where(new, new_slot, S))  # S: a spare row, dropped below
    stamp = stamps.amax(-1, keepdim=True) + write.to(torch.int64).cumsum(-1)
    out_rows = torch.cat([rows, rows.new_zeros(B, 1, g + k)], 1)
    out_rows.scatter_(1, slot.unsqueeze(-1).expand(B, E, g + k), torch.cat([leads, fols], -1))
    out_st = torch.cat([stamps, stamps.new_zeros(B, 1)], 1).scatter(1, slot, stamp)
    return [out_rows[:, :S].reshape(B, -1), out_st[:, :S]]
