"""Constructors: constants, filled and counting tensors, and the host-known size of an axis."""

from __future__ import annotations

import torch

from host.epilogue.ir import Dim, Value
from host.epilogue.tensors import TORCH_DTYPE
from host.epilogue.ops.spec import Attr, define, family

F = family("construct", "Constructors:")


def _const_infer(t, av, at):
    dt = at["dtype"]
    flat, shp = t.const(at["value"], dt)
    ub = [Dim.of(max(flat))] if dt == "i64" and flat else []
    v = at["value"]
    return [Value(dt, tuple(Dim.of(n) for n in shp), ub, v if dt == "i64" and not isinstance(v, list) else None)]


def _const_impl(ctx, op, a):
    t = torch.tensor(op.attrs["value"], dtype=TORCH_DTYPE[op.attrs["dtype"]], device=ctx.device)
    return [t.unsqueeze(0).expand(ctx.B, *t.shape)]


define("const", F, args=0, attrs={"value": Attr("value"), "dtype": Attr("dtype")},
       infer=_const_infer, impl=_const_impl,
       doc="`const(; value, dtype)`: a scalar or a rectangular nested list (at most 65536 elements, rank 8).")


def _full_infer(t, av, at):
    dt = at["dtype"]
    t.const(at["value"], dt)
    if isinstance(at["value"], list):
        t.fail("attr 'value' must be a scalar")
    return [Value(dt, t.shape(at["shape"]), [Dim.of(at["value"])] if dt == "i64" else [])]


def _full_impl(ctx, op, a):
    return [torch.full([ctx.B, *ctx.shape(ctx.values[op.outs[0]])], op.attrs["value"],
                       dtype=TORCH_DTYPE[op.attrs["dtype"]], device=ctx.device)]


define("full", F, args=0, attrs={"shape": Attr("dims"), "value": Attr("value"), "dtype": Attr("dtype")},
       infer=_full_infer, impl=_full_impl, doc="`full(; shape, value, dtype)`: a tensor of one scalar value.")


def _arange_infer(t, av, at):
    n = t.subst(at["n"])
    return [Value("i64", (n,), [n + (at["start"] - 1)])]


def _arange_impl(ctx, op, a):
    n = ctx.shape(ctx.values[op.outs[0]])[0]
    start = op.attrs["start"]
    return [torch.arange(start, start + n, device=ctx.device).unsqueeze(0).expand(ctx.B, n)]


define("arange", F, args=0, attrs={"n": Attr("dim"), "start": Attr("int", 0)},
       infer=_arange_infer, impl=_arange_impl,
       doc="`arange(; n, start=0)` -> i64 [n]: start, start+1, ... (n an int or a dim).")


def _size_infer(t, av, at):
    (x,) = av
    if not x.shape:
        t.fail(f"a scalar {x} has no axis")
    ax = t.axis(x, at)
    return [Value("i64", (), [x.shape[ax]])]


def measured(values: list[Value], op, bind: dict[str, int]) -> int:
    """The dim a size op measures, under this binding: a host int, whatever the device."""
    return values[op.args[0]].shape[op.attrs["axis"]].resolve(bind)


define("size", F, args=1, attrs={"axis": Attr("int", 0)}, infer=_size_infer,
       impl=lambda ctx, op, a: [torch.full((ctx.B,), measured(ctx.values, op, ctx.bind), dtype=torch.int64,
                                             device=ctx.device)],
       doc="`size(x; axis=0)` -> i64 []: the length of an axis (known to the host).")
