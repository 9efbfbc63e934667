"""The LRU n-gram table of Cacheback drafting: lookup and a batched, loop-free update."""

from __future__ import annotations

import torch

from host.epilogue.ir import Dim, Value
from host.epilogue.tensors import argmax
from host.epilogue.ops.spec import TENSOR, Attr, Variant, define, family

F = family("lru", "The LRU n-gram table (Cacheback):")
GK = {"g": Attr("int", lo=1, hi=64), "k": Attr("int", lo=1, hi=1024)}


def _table(t, av, at):
    """`table` i64 [S*(g+k)] (row s = leader[g] then followers[k], padded with -1) and
    `stamps` i64 [S] (last-used order, -1 = empty slot)."""
    table, stamps = av[0], av[1]
    g, k = at["g"], at["k"]
    for v in av:
        t.need(v, "i64")
    t.rank(table, 1), t.rank(stamps, 1)
    S, T = stamps.shape[0], table.shape[0]
    if not (S.known and T.known) or T.off != S.off * (g + k):
        t.fail(f"shape mismatch: table {table} must be [S*(g+k)] = [{S}*{g + k}] for stamps {stamps}")
    return table


def _lookup_infer(t, av, at):
    table = _table(t, av, at)
    key = av[2]
    t.rank(key, 1)
    if key.shape[0] != Dim.of(at["g"]):
        t.fail(f"shape mismatch: key {key} must be [{at['g']}] (attr g)")
    return [Value("i64", (Dim.of(at["k"]),), table.ub), Value("i64", (), [Dim.of(at["k"])])]


def _update_infer(t, av, at):
    table = _table(t, av, at)
    seq, length, leaders = av[2], av[3], av[4]
    t.rank(seq, 1), t.rank(length, 0), t.rank(leaders, 0)
    n = seq.shape[0]
    if not n.known or n.off > 1024:
        t.fail(f"seq {seq} must have a static length <= 1024 (the update compares every pair of positions)")
    return [Value("i64", table.shape), Value("i64", av[1].shape)]


define("lru_lookup", F, args=3, results=2, attrs=GK, infer=_lookup_infer,
       impl=lambda ctx, op, a: lru_lookup(a[0], a[1], a[2], op.attrs["g"], op.attrs["k"]),
       doc="""`lru_lookup(table: i64 [S*(g+k)], stamps: i64 [S], key: i64 [g]; g, k)` -> (followers i64 [k],
count i64 [] <= k). Row s of `table` is a leader n-gram of g tokens then up to k follower tokens
padded with -1; `stamps[s]` orders rows by last use, -1 = empty slot. Returns the followers of the
live row whose leader equals `key` (the highest stamp if several; none when `key` has a negative
token), cut at their first -1; count 0 and all -1 when no row matches. Pure: it does not touch
the stamps. S, g and k are static (table and stamps are typically channels of those capacities,
initialised to -1).""")

def _update_or_skip(ctx, op, table, stamps, seq, length, leaders):
    """In host memory: a sequence of padding only (no leader qualifies) leaves the table as it is,
    without the torch implementation's ~20 ops (the rounds before any token leaves the lookup window)."""
    if bool((seq.numpy() < 0).all()):
        return table, stamps
    return tuple(lru_update(table, stamps, seq, length, leaders, op.attrs["g"], op.attrs["k"]))


define("lru_update", F, args=5, results=2, attrs=GK, infer=_update_infer,
       impl=lambda ctx, op, a: lru_update(*a, op.attrs["g"], op.attrs["k"]),
       variants=(Variant((TENSOR,) * 5, (TENSOR, TENSOR), _update_or_skip, host_memory=True, ctx=False),),
       doc="""`lru_update(table, stamps, seq: i64 [n], length: i64 [], leaders: i64 []; g, k)` -> (table'
[S*(g+k)], stamps' [S]) (n static, <= 1024). The candidates are the leaders seq[i:i+g], i = 0 ..
leaders-1, with followers seq[i+g : min(i+g+k, length)] cut at the first negative token; a
candidate without a follower or with a negative token is skipped. They are written as one group:
of equal leaders only the last occurrence counts; a leader that a live row holds refreshes that
row's followers; new leaders take, in order, the empty rows and then the rows with the lowest
stamps (lowest index on ties) that this update does not refresh; when there are more new leaders
than such rows the earliest new leaders are dropped. The written rows are stamped max(stamps)+1,
+2, ... in sequence order, so later ones rank as more recent. Write the results back with `set`
to keep the table across rounds.""")


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
