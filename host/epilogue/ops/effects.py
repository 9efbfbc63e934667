"""Effects: what an epilogue leaves behind (channel writes, the fold count, the stop flag).
They have no result and no implementation: the executor applies them. A program has at most one
write per channel, one fold and one stop."""

from __future__ import annotations

import torch


from host.epilogue.env import host_length
from host.epilogue.ir import Dim, ProgramError, dim_leq
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


define("put", F, args=(1, 2), results=0, attrs={"channel": Attr("channel")}, infer=_write_infer("put"), impl=None,
       doc="`put(values [M], [count: i64 []]; channel)`: append values[:count] (count defaults to M, clamped "
           "to [0, M]) at the channel's length; cells past capacity are dropped and the write reports overflow.")
define("set", F, args=(1, 2), results=0, attrs={"channel": Attr("channel")}, infer=_write_infer("set"), impl=None,
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


define("fold", F, args=1, results=0, infer=_fold_infer, impl=None,
       doc="`fold(n: i64 [])`: the rows of this window that become committed state (clamped to [0, W]).")
define("stop", F, args=1, results=0, infer=_stop_infer, impl=None, doc="`stop(flag: bool [])`: raise the stop flag.")


# --- applying a write (the executor calls these; they are the effects' implementations) -------

def write_cells(ch, put: bool, cells, count, capacity: int) -> tuple:
    """Write one pass's cells to channel `ch` in place: appended (put) or from cell 0 (set), the
    first `count` of them (None: all; a host int, or a 0-d device tensor), as many as fit.
    cells: a list or 1-D numpy array in host memory, or a 1-D tensor on the channel's device.
    Returns (new length, overflow): host values where the count is a host value, else 0-d tensors.

    Where a cell goes depends only on the channel's length at the start of the round, a host
    int, so a write with a host count is one copy; with a device count the cells past it keep
    their old contents (a select) and the new length stays on the device until the readback."""
    start = host_length(ch) if put else 0
    size = len(cells)
    room = max(min(size, capacity - start), 0)
    if count is None or isinstance(count, int):
        n = size if count is None else min(max(count, 0), size)
        k = min(n, room)
        if k:
            if isinstance(cells, torch.Tensor):  # narrow/select: a few us cheaper each than indexing
                ch.buf.narrow(0, start, k).copy_(cells.narrow(0, 0, k))  # converts the dtype
            else:  # numpy's assignment converts the dtype as torch's copy_ does, at about half its cost
                dst = ch.buf.numpy() if getattr(ch, "host", None) is None else ch.host
                try:
                    if k == 1:  # one cell (a decode step's token): no slices
                        dst[start] = cells[0]
                    else:
                        dst[start:start + k] = cells[:k]
                except OverflowError:  # an i64 constant past an int32 channel's range: the program's fault
                    raise ProgramError(f"a value written to the channel does not fit its {dst.dtype} cells") from None
        return start + k, n > room
    cells = cells if isinstance(cells, torch.Tensor) else torch.as_tensor(cells)
    n = count.clamp(0, size)
    if room:
        dst = ch.buf[start:start + room]
        keep = torch.arange(room, device=ch.buf.device) < n
        dst.copy_(torch.where(keep, cells[:room].to(dst.dtype), dst))
    return start + torch.clamp(n, max=room), n > room
