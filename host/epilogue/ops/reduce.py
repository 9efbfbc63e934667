"""Reductions over an axis (removing it) and scans along one (keeping it)."""

from __future__ import annotations

import torch

from host.epilogue.ir import Dim, Value
from host.epilogue.tensors import argmax, argmax_np
from host.epilogue.ops.spec import ARRAY, Attr, Variant, define, family

F = family("reduce", "Reductions over `axis` (default -1), removing it; scans along it:")
AXIS = {"axis": Attr("int", -1)}


def _reduction(name: str, dtypes: tuple[str, ...], fn, doc: str, variants=()) -> None:
    def infer(t, av, at):
        (x,) = av
        if not x.shape:
            t.fail(f"cannot reduce a scalar {x}")
        ax = t.axis(x, at)
        t.need(x, *dtypes)
        shape = x.shape[:ax] + x.shape[ax + 1:]
        if name in ("any", "all"):
            return [Value("bool", shape)]
        if name in ("argmax", "argmin"):
            return [Value("i64", shape, [x.shape[ax] + -1])]
        if name == "sum" and x.dtype == "bool":
            return [Value("i64", shape, [x.shape[ax]])]
        return [Value(x.dtype, shape, x.ub if name in ("min", "max") else [])]

    define(name, F, args=1, attrs=AXIS, infer=infer, doc=doc, variants=variants,
           impl=lambda ctx, op, a: [fn(a[0], op.attrs["axis"] + 1)])


def _sum(x, dim):
    return x.sum(dim, dtype=torch.int64) if x.dtype == torch.bool else x.sum(dim)


_reduction("sum", ("i64", "f32", "bool"), _sum, "`sum(x; axis=-1)`: the sum (i64|f32; bool sums to i64).")
_reduction("prod", ("i64", "f32"), lambda x, d: torch.prod(x, dim=d), "`prod(x; axis=-1)`: the product (i64|f32).")
_reduction("min", ("i64", "f32"), lambda x, d: torch.amin(x, dim=d), "`min(x; axis=-1)`: the smallest (i64|f32).")
_reduction("max", ("i64", "f32"), lambda x, d: torch.amax(x, dim=d), "`max(x; axis=-1)`: the largest (i64|f32).")
_reduction("argmax", ("i64", "f32"), lambda x, d: argmax(x, d),
           "`argmax(x; axis=-1)` -> i64: the index of the largest (the first on ties; a NaN counts as the largest).",
           # numpy's, on a readout in host memory: no tensor made (a greedy round makes none)
           (Variant((ARRAY,), (ARRAY,), lambda ctx, op, a: argmax_np(a, op.attrs["axis"] + 1), host_memory=True,
                    ctx=False, inline=lambda op: "{0}.argmax(axis=%d)" % (op.attrs["axis"] + 1)),))
_reduction("argmin", ("i64", "f32"), lambda x, d: torch.argmin(x, dim=d),
           "`argmin(x; axis=-1)` -> i64: the index of the smallest (the first on ties).")
_reduction("any", ("bool",), lambda x, d: torch.any(x, dim=d), "`any(x; axis=-1)`: some element is true (bool).",
           (Variant((ARRAY,), (ARRAY,), lambda ctx, op, a: a.any(axis=op.attrs["axis"] + 1), host_memory=True,
                    ctx=False),))
_reduction("all", ("bool",), lambda x, d: torch.all(x, dim=d), "`all(x; axis=-1)`: every element is true (bool).",
           (Variant((ARRAY,), (ARRAY,), lambda ctx, op, a: a.all(axis=op.attrs["axis"] + 1), host_memory=True,
                    ctx=False),))


def _scan(name: str, doc: str) -> None:
    def infer(t, av, at):
        (x,) = av
        if not x.shape:
            t.fail(f"cannot scan a scalar {x}")
        ax = t.axis(x, at)
        t.need(x, "i64", "f32", "bool")
        if x.dtype != "bool":
            return [Value(x.dtype, x.shape)]
        return [Value("i64", x.shape, [Dim.of(1)] if name == "cumprod" else [x.shape[ax]])]

    def impl(ctx, op, a):
        x = a[0].to(torch.int64) if a[0].dtype == torch.bool else a[0]
        ax = op.attrs["axis"] + 1
        return [x.cumsum(ax) if name == "cumsum" else x.cumprod(ax)]

    define(name, F, args=1, attrs=AXIS, infer=infer, impl=impl, doc=doc)


_scan("cumsum", "`cumsum(x; axis=-1)`: running sums, same shape (bool input gives i64).")
_scan("cumprod", "`cumprod(x; axis=-1)`: running products, same shape (bool input gives i64).")
