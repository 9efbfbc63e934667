"""Effects: what an epilogue leaves behind (channel writes, the fold count, the stop flag).
They have no result and no kernel: the executor applies them. A program has at most one
write per channel, one fold and one stop."""

from __future__ import annotations

from host.epilogue.ir import Dim, dim_leq
from host.epilogue.ops.spec import Attr, define, family

F = family("effects", "Effects (no result; at most one write per channel, one fold, one stop):")


def _write_infer(name):
    def infer(t, av, at):
        ch = t.channel(at["channel"])
        vals = av[0]
        t.rank(vals, 1)
        if vals.dtype != ch.dtype:
            t.fail(f"wrong dtype: {vals.dtype} written to {ch.dtype} channel {ch.name!r}")
        if len(av) == 2:
            t.need(av[1], "i64"), t.rank(av[1], 0)
        if name == "set" and vals.shape[0].known and vals.shape[0].off > ch.capacity:
            t.fail(f"{vals} does not fit channel {ch.name!r} of capacity {ch.capacity}")
        return []
    return infer


define("put", F, args=(1, 2), results=0, attrs={"channel": Attr("channel")}, infer=_write_infer("put"), kernel=None,
       doc="`put(values [M], [count: i64 []]; channel)`: append values[:count] (count defaults to M, clamped "
           "to [0, M]) at the channel's length; cells past capacity are dropped and the write reports overflow.")
define("set", F, args=(1, 2), results=0, attrs={"channel": Attr("channel")}, infer=_write_infer("set"), kernel=None,
       doc="`set(values [M], [count]; channel)`: overwrite cells [0, count) and set the length to count (cells "
           "past count keep their old contents).")


def _fold_infer(t, av, at):
    (x,) = av
    t.need(x, "i64"), t.rank(x, 0)
    w = t.subst(Dim("W", 0))
    if not any(dim_leq(b, w) for b in x.ub):
        bounds = ", ".join(map(str, x.ub)) or "unbounded"
        t.fail(f"fold is not provably <= window {w} (bounds: {bounds}); use minimum(fold, size(window))")
    return []


def _stop_infer(t, av, at):
    (x,) = av
    t.need(x, "bool"), t.rank(x, 0)
    return []


define("fold", F, args=1, results=0, infer=_fold_infer, kernel=None,
       doc="`fold(n: i64 [])`: the rows of this window that become committed state (clamped to [0, W]).")
define("stop", F, args=1, results=0, infer=_stop_infer, kernel=None, doc="`stop(flag: bool [])`: raise the stop flag.")
