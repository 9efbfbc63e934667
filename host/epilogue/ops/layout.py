"""Indexing and layout: static index and slice, take and gather with a fill, concat, and the
data-dependent pack and dyn_slice (static size, padded)."""

from __future__ import annotations

import numpy as np
import torch

from host.epilogue.ir import Dim, ProgramError, Value
from host.epilogue.tensors import fill_of, gather_fill
from host.epilogue.ops.spec import ARRAY, HOST, MAX_STATIC_LEN, TENSOR, Attr, Variant, define, family, max_bound

F = family("layout", "Indexing and layout:")
FILL = {"fill": Attr("value", None)}  # None: the dtype's default fill
SIZE = Attr("int", lo=0, hi=MAX_STATIC_LEN)


def _fill(t, at, dtype: str) -> None:
    if at["fill"] is not None:
        if isinstance(at["fill"], list):
            t.fail("attr 'fill' must be a scalar")
        t.const(at["fill"], dtype)


def slice_len(d: Dim, start, stop) -> Dim:
    """The length of d[start:stop]; raises ProgramError for forms a symbolic dim does not support."""
    start = 0 if start is None else start
    if d.known:
        return Dim.of(len(range(d.off)[slice(start, stop)]))
    # Symbolic dim: support the common forms x[a:], x[:-b], x[-a:], x[a:-b] (assuming they fit).
    if stop is None and start >= 0:
        return d + (-start)
    if stop is None and start < 0:
        return Dim.of(-start)
    if start >= 0 and stop is not None and stop < 0:
        return d + (stop - start)
    if start >= 0 and stop is not None and stop >= 0:
        return Dim.of(stop - start)
    raise ProgramError(f"slice [{start}:{stop}] of symbolic dim {d} is not supported")


def _index_infer(t, av, at):
    (x,) = av
    if not x.shape:
        t.fail("cannot index a scalar")
    ax = t.axis(x, at)
    i, d = at["i"], x.shape[ax]
    if d.known and not -d.off <= i < d.off:  # symbolic dims are checked when the pass binds them
        t.fail(f"index {i} out of range for dim {d}")
    return [Value(x.dtype, x.shape[:ax] + x.shape[ax + 1:], x.ub)]


def _scalar_of_vector(values, op) -> bool:
    out = values[op.outs[0]]
    return not out.shape and out.dtype in ("i64", "bool") and len(values[op.args[0]].shape) == 1


define("index", F, args=1, attrs={"i": Attr("int"), "axis": Attr("int", 0)}, infer=_index_infer,
       impl=lambda ctx, op, a: [a[0].select(op.attrs["axis"] + 1, op.attrs["i"])],
       # a cell of a vector in host memory, read as a Python scalar (no select, no tolist)
       variants=(Variant((ARRAY,), (HOST,), lambda ctx, op, a: [a.item(b, op.attrs["i"]) for b in range(len(a))],
                         host_memory=True, when=_scalar_of_vector, ctx=False,
                         inline=lambda op: "{0}.item(0, %d)" % op.attrs["i"]),),
       doc="`index(x; i, axis=0)`: a static index (negative from the end), removing the axis.")


def _slice_infer(t, av, at):
    (x,) = av
    if not x.shape:
        t.fail("cannot slice a scalar")
    ax = t.axis(x, at)
    try:
        n = slice_len(x.shape[ax], at["start"], at["stop"])
    except ProgramError as e:
        t.fail(str(e))
    return [Value(x.dtype, x.shape[:ax] + (n,) + x.shape[ax + 1:], x.ub)]


def _slice(ctx, op, a):
    ax = op.attrs["axis"] + 1
    return [a[0][(slice(None),) * ax + (slice(op.attrs["start"], op.attrs["stop"]),)]]


define("slice", F, args=1, attrs={"start": Attr("int?", None), "stop": Attr("int?", None), "axis": Attr("int", 0)},
       infer=_slice_infer, impl=_slice,
       variants=(Variant((ARRAY,), (ARRAY,), lambda ctx, op, a: _slice(ctx, op, [a])[0], host_memory=True, ctx=False),),
       doc="`slice(x; start, stop, axis=0)`: a Python slice, step 1, null = open end. On symbolic dims: "
           "`[a:]`, `[-a:]`, `[a:-b]`, `[a:b]`, checked again when bound.")


def _take_infer(t, av, at):
    x, idx = av
    t.need(idx, "i64")
    if not x.shape:
        t.fail("cannot take from a scalar")
    _fill(t, at, x.dtype)
    return [Value(x.dtype, idx.shape + x.shape[1:], x.ub)]


def _take(ctx, op, a):
    x, idx = a
    B = ctx.B
    fill = fill_of(op, ctx.values[op.outs[0]].dtype)
    n, rest = x.shape[1], list(x.shape[2:])
    flat = idx.reshape(B, -1)
    m = flat.shape[1]
    if n == 0:
        return [torch.full([B, *idx.shape[1:], *rest], fill, dtype=x.dtype, device=ctx.device)]
    ok = ((flat >= 0) & (flat < n)).view(B, m, *[1] * len(rest))
    ic = flat.clamp(0, n - 1).view(B, m, *[1] * len(rest)).expand(B, m, *rest)
    out = x.gather(1, ic).masked_fill(~ok, fill)
    return [out.reshape(B, *idx.shape[1:], *rest)]


define("take", F, args=2, attrs=FILL, infer=_take_infer, impl=_take,
       doc="`take(x, idx: i64; fill)`: x[idx] along axis 0; the result is idx.shape + x.shape[1:]; indices "
           "outside [0, len) give fill.")


def _gather_infer(t, av, at):
    x, idx = av
    t.need(idx, "i64")
    if len(x.shape) != len(idx.shape) or not x.shape or x.shape[:-1] != idx.shape[:-1]:
        t.fail(f"shape mismatch: gather needs equal leading dims, got {x} and {idx}")
    _fill(t, at, x.dtype)
    return [Value(x.dtype, idx.shape, x.ub)]


def _gather(ctx, op, a):
    x, idx = a
    fill = fill_of(op, ctx.values[op.outs[0]].dtype)
    n = x.shape[-1]
    if n == 0:
        return [torch.full(idx.shape, fill, dtype=x.dtype, device=ctx.device)]
    ok = (idx >= 0) & (idx < n)
    return [x.gather(-1, idx.clamp(0, n - 1)).masked_fill(~ok, fill)]


define("gather", F, args=2, attrs=FILL, infer=_gather_infer, impl=_gather,
       doc="`gather(x, idx: i64; fill)`: along the last axis (torch.gather); equal leading dims; "
           "out-of-range indices give fill.")


def _scatter_add_infer(t, av, at):
    x, idx, val = av
    t.need(x, "f32")
    t.nonscalar(x, "scatter_add")
    t.need(idx, "i64")
    t.need(val, "f32")
    t.rank(idx, 1)
    if idx.shape != val.shape:
        t.fail(f"shape mismatch: scatter_add needs as many values as indices, got {idx} and {val}")
    return [Value("f32", x.shape)]


def _scatter_add(ctx, op, a):
    return [scatter_add(*a)]


def scatter_add(x: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """x [B, ..., V] with val [B, n] added at idx [B, n] of the last axis in each of a batch row's
    rows; indices outside [0, V) ignored. The one way a logit bias is added (the host's Sampler
    too), so both give the same bits."""
    n = x.shape[-1]
    ok = (idx >= 0) & (idx < n)
    delta = torch.zeros(x.shape[0], n, dtype=x.dtype, device=x.device)
    delta.scatter_add_(-1, idx.clamp(0, max(n - 1, 0)), val.masked_fill(~ok, 0.0))
    return x + delta.view(x.shape[0], *([1] * (x.dim() - 2)), n)


define("scatter_add", F, args=3, infer=_scatter_add_infer, impl=_scatter_add,
       doc="`scatter_add(x: f32 [..., V], idx: i64 [n], val: f32 [n])`: x with val[j] added at index idx[j] of "
           "the last axis, in every row (a logit bias); repeated indices add up, indices outside [0, V) are "
           "ignored.")


def _concat_infer(t, av, at):
    a, b = av
    if a.dtype != b.dtype:
        t.fail(f"wrong dtype: {a.dtype} and {b.dtype} differ")
    if len(a.shape) != len(b.shape) or not a.shape:
        t.fail(f"shape mismatch: {a} and {b}")
    ax = t.axis(a, at)
    for k, (x, y) in enumerate(zip(a.shape, b.shape)):
        if k != ax and x != y:
            t.fail(f"shape mismatch: {a} and {b}")
    da, db = a.shape[ax], b.shape[ax]
    if da.known:
        n = db + da.off
    elif db.known:
        n = da + db.off
    else:
        t.fail(f"shape mismatch: cannot concatenate two symbolic dims {da} and {db}")
    return [Value(a.dtype, a.shape[:ax] + (n,) + a.shape[ax + 1:], max_bound(a.ub, b.ub))]


define("concat", F, args=2, attrs={"axis": Attr("int", 0)}, infer=_concat_infer,
       impl=lambda ctx, op, a: [torch.cat(a, dim=op.attrs["axis"] + 1)],
       variants=(Variant((ARRAY, ARRAY), (ARRAY,), lambda ctx, op, a, b: np.concatenate((a, b), op.attrs["axis"] + 1),
                         host_memory=True, ctx=False),),
       doc="`concat(a, b; axis=0)`: static concatenation (at most one of the two axes symbolic).")


def _pack_infer(t, av, at):
    a, alen, b, blen = av
    if a.dtype != b.dtype:
        t.fail(f"wrong dtype: {a.dtype} and {b.dtype} differ")
    t.rank(a, 1), t.rank(b, 1)
    for ln in (alen, blen):
        t.need(ln, "i64"), t.rank(ln, 0)
    _fill(t, at, a.dtype)
    return [Value(a.dtype, (Dim.of(at["size"]),), max_bound(a.ub, b.ub))]


def _pack(ctx, op, a):
    x, xl, y, yl = a
    B, size = ctx.B, op.attrs["size"]
    fill = fill_of(op, ctx.values[op.outs[0]].dtype)
    j = torch.arange(size, device=ctx.device).unsqueeze(0).expand(B, size)
    la = xl.clamp(0, x.shape[1]).unsqueeze(1)
    lb = yl.clamp(0, y.shape[1]).unsqueeze(1)
    from_a = gather_fill(x, torch.where(j < la, j, -1), fill)
    from_b = gather_fill(y, torch.where((j >= la) & (j < la + lb), j - la, -1), fill)
    return [torch.where(j < la, from_a, from_b)]


def _filled(ctx, op, x):
    fill = fill_of(op, ctx.values[op.outs[0]].dtype)
    if isinstance(x, np.ndarray):
        return np.full((x.shape[0], op.attrs["size"]), fill, dtype=x.dtype)
    return torch.full((x.shape[0], op.attrs["size"]), fill, dtype=x.dtype, device=x.device)


def _pack_copy(ctx, op, x, xl: list, y, yl):
    """pack with host offsets: copies of contiguous runs, no index tensors (any device; numpy
    arrays in host memory, with host lengths)."""
    out, size = _filled(ctx, op, x), op.attrs["size"]
    for b, la in enumerate(xl):
        a = min(max(la, 0), x.shape[1], size)
        out[b, :a] = x[b, :a]
        m = min(y.shape[1], size - a)
        if isinstance(yl, list):
            m = min(m, max(yl[b], 0))
            out[b, a:a + m] = y[b, :m]
        elif m > 0:  # a device length: cells past it keep the fill
            keep = torch.arange(m, device=y.device) < yl[b]
            out[b, a:a + m] = torch.where(keep, y[b, :m], out[b, a:a + m])
    return out


PACK_VARIANTS = (Variant((ARRAY, HOST, ARRAY, HOST), (ARRAY,), _pack_copy, host_memory=True),
                 Variant((TENSOR, HOST, TENSOR, HOST), (TENSOR,), _pack_copy),
                 Variant((TENSOR, HOST, TENSOR, TENSOR), (TENSOR,), _pack_copy))


define("pack", F, args=4, variants=PACK_VARIANTS, attrs={"size": SIZE, **FILL}, infer=_pack_infer, impl=_pack,
       doc="`pack(a [n], a_len, b [m], b_len; size, fill)` -> [size]: a[:a_len] then b[:b_len] (lengths are "
           "i64 scalars, clamped to [0, n] and [0, m]), then fill.")


def _dyn_slice_infer(t, av, at):
    x, start, length = av
    t.rank(x, 1)
    for s in (start, length):
        t.need(s, "i64"), t.rank(s, 0)
    _fill(t, at, x.dtype)
    return [Value(x.dtype, (Dim.of(at["size"]),), x.ub)]


def _dyn_slice(ctx, op, a):
    x, start, length = a
    B, size = ctx.B, op.attrs["size"]
    j = torch.arange(size, device=ctx.device).unsqueeze(0).expand(B, size)
    idx = torch.where(j < length.unsqueeze(1), start.unsqueeze(1) + j, -1)
    return [gather_fill(x, idx, fill_of(op, ctx.values[op.outs[0]].dtype))]


def _dyn_slice_copy(ctx, op, x, starts: list, lengths):
    """dyn_slice with a host start: a copy of a contiguous run, no index tensors (any device;
    numpy arrays in host memory, with host lengths)."""
    out, n, size = _filled(ctx, op, x), x.shape[1], op.attrs["size"]
    for b, st in enumerate(starts):
        ln = lengths[b] if isinstance(lengths, list) else size
        j0, j1 = max(0, -st), min(size, ln, n - st)
        if j1 <= j0:
            continue
        if isinstance(lengths, list):
            out[b, j0:j1] = x[b, st + j0:st + j1]
        else:  # a device length: cells past it keep the fill
            keep = torch.arange(j0, j1, device=x.device) < lengths[b]
            out[b, j0:j1] = torch.where(keep, x[b, st + j0:st + j1], out[b, j0:j1])
    return out


DYN_SLICE_VARIANTS = (Variant((ARRAY, HOST, HOST), (ARRAY,), _dyn_slice_copy, host_memory=True),
                      Variant((TENSOR, HOST, HOST), (TENSOR,), _dyn_slice_copy),
                      Variant((TENSOR, HOST, TENSOR), (TENSOR,), _dyn_slice_copy))


define("dyn_slice", F, args=3, variants=DYN_SLICE_VARIANTS, attrs={"size": SIZE, **FILL}, infer=_dyn_slice_infer, impl=_dyn_slice,
       doc="`dyn_slice(x [n], start, length; size, fill)` -> [size]: x[start + j] for j < length; fill where "
           "j >= length or the index is outside x.")
