"""Elementwise ops: unary, binary (NumPy broadcasting), where, cast."""

from __future__ import annotations

import numpy as np
import torch

from host.epilogue.ir import Dim, Value
from host.epilogue.tensors import NP_DTYPE, TORCH_DTYPE, align, int_values
from host.epilogue.ops.spec import ARRAY, HOST, TENSOR, Attr, Variant, define, family, max_bound

F = family("elementwise", "Elementwise (broadcasting; binary ops need equal dtypes):")


def wrap(x: int) -> int:
    """i64 arithmetic on the host wraps as it does on the device."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


# --- unary --------------------------------------------------------------------------------

def _on_arrays(np_fn, args: int | None = None) -> tuple[Variant, ...]:
    """The op on numpy arrays in host memory, for i64 and bool values (the bookkeeping of a round:
    a numpy call costs a fraction of a torch op's right after a model call). args: the operands
    (a ufunc's own count by default)."""
    if np_fn is None:
        return ()

    def fn(ctx, op, *xs):
        r = max(x.ndim for x in xs) - 1  # the result's unbatched rank
        return np_fn(*(align(x, r) for x in xs))
    n = np_fn.nin if args is None else args
    return (Variant((ARRAY,) * n, (ARRAY,), fn, host_memory=True, when=int_values, ctx=False),)


def _unary(name: str, dtypes: tuple[str, ...], fn, host, doc: str, inline: str | None = None, np_fn=None) -> None:
    def infer(t, av, at):
        (x,) = av
        t.need(x, *dtypes)
        return [Value(x.dtype, x.shape, x.ub if name == "abs" else [])]

    define(name, F, args=1, infer=infer, impl=lambda ctx, op, a: [fn(a[0])], host=host, inline=inline, doc=doc,
           variants=_on_arrays(np_fn))


_unary("neg", ("i64", "f32"), torch.neg, lambda a: wrap(-a), "`neg(x)`: -x (i64|f32).")
_unary("abs", ("i64", "f32"), torch.abs, lambda a: wrap(abs(a)), "`abs(x)`: |x| (i64|f32).")
_unary("exp", ("f32",), torch.exp, None, "`exp(x)`: e^x (f32).")
_unary("log", ("f32",), torch.log, None, "`log(x)`: natural log (f32; log 0 = -inf).")
_unary("not", ("bool",), torch.logical_not, lambda a: not a, "`not(x)`: logical not (bool).", "(not {0})",
       np.logical_not)


# --- binary -------------------------------------------------------------------------------

def _safe_int_div(a, b, mode):
    zero = b == 0
    b1 = torch.where(zero, torch.ones_like(b), b)
    out = torch.div(a, b1, rounding_mode="floor") if mode == "floordiv" else torch.remainder(a, b1)
    return out.masked_fill(zero, 0)


def _bound(name: str, a: Value, b: Value) -> list[Dim]:
    """Upper bounds of the result, for proving fold <= W."""
    if name == "add":
        return [x + y.off for x in a.ub for y in b.ub if y.known] + \
            [y + x.off for x in a.ub for y in b.ub if x.known and not y.known]
    if name == "minimum":
        return a.ub + b.ub
    if name == "maximum":
        return max_bound(a.ub, b.ub)
    if name == "sub" and b.const is not None:
        return [x + (-b.const) for x in a.ub]
    return []


def _binary(name: str, dtypes: tuple[str, ...], out: str | None, fn, host, doc: str, inline: str | None = None,
            np_fn=None) -> None:
    def infer(t, av, at):
        a, b = av
        if a.dtype != b.dtype:
            t.fail(f"wrong dtype: {a.dtype} and {b.dtype} differ (cast one)")
        shape = t.broadcast(a, b)
        t.need(a, *dtypes)
        return [Value(out or a.dtype, shape, [] if out else _bound(name, a, b))]

    def impl(ctx, op, a):
        r = len(ctx.values[op.outs[0]].shape)
        return [fn(align(a[0], r), align(a[1], r))]

    define(name, F, args=2, infer=infer, impl=impl, host=host, inline=inline, doc=doc, variants=_on_arrays(np_fn))


NUM, ANY = ("i64", "f32"), ("i64", "f32", "bool")
_binary("add", NUM, None, torch.add, lambda a, b: wrap(a + b), "`add(a, b)`: a + b (i64|f32).", np_fn=np.add)
_binary("sub", NUM, None, torch.sub, lambda a, b: wrap(a - b), "`sub(a, b)`: a - b (i64|f32).", np_fn=np.subtract)
_binary("mul", NUM, None, torch.mul, lambda a, b: wrap(a * b), "`mul(a, b)`: a * b (i64|f32).", np_fn=np.multiply)
_binary("div", ("f32",), None, torch.div, None, "`div(a, b)`: a / b (f32).")
_binary("floordiv", ("i64",), None, lambda a, b: _safe_int_div(a, b, "floordiv"),
        lambda a, b: wrap(a // b) if b else 0, "`floordiv(a, b)`: floor(a / b) (i64); division by zero gives 0.")
_binary("mod", ("i64",), None, lambda a, b: _safe_int_div(a, b, "mod"), lambda a, b: a % b if b else 0,
        "`mod(a, b)`: a - b * floor(a / b) (i64, the sign of b); modulo zero gives 0.")
_binary("minimum", NUM, None, torch.minimum, min, "`minimum(a, b)`: the smaller (i64|f32).", np_fn=np.minimum)
_binary("maximum", NUM, None, torch.maximum, max, "`maximum(a, b)`: the larger (i64|f32).", np_fn=np.maximum)
_binary("eq", ANY, "bool", torch.eq, lambda a, b: a == b, "`eq(a, b)`: a == b (any dtype) -> bool.", "{0} == {1}",
        np_fn=np.equal)
_binary("ne", ANY, "bool", torch.ne, lambda a, b: a != b, "`ne(a, b)`: a != b (any dtype) -> bool.", "{0} != {1}",
        np_fn=np.not_equal)
_binary("lt", NUM, "bool", torch.lt, lambda a, b: a < b, "`lt(a, b)`: a < b (i64|f32) -> bool.", "{0} < {1}",
        np_fn=np.less)
_binary("le", NUM, "bool", torch.le, lambda a, b: a <= b, "`le(a, b)`: a <= b (i64|f32) -> bool.", "{0} <= {1}",
        np_fn=np.less_equal)
_binary("gt", NUM, "bool", torch.gt, lambda a, b: a > b, "`gt(a, b)`: a > b (i64|f32) -> bool.", "{0} > {1}",
        np_fn=np.greater)
_binary("ge", NUM, "bool", torch.ge, lambda a, b: a >= b, "`ge(a, b)`: a >= b (i64|f32) -> bool.", "{0} >= {1}",
        np_fn=np.greater_equal)
_binary("and", ("bool",), "bool", torch.logical_and, lambda a, b: bool(a and b), "`and(a, b)`: logical and (bool).",
        "({0} and {1})", np_fn=np.logical_and)
_binary("or", ("bool",), "bool", torch.logical_or, lambda a, b: bool(a or b), "`or(a, b)`: logical or (bool).",
        "({0} or {1})", np_fn=np.logical_or)
_binary("xor", ("bool",), "bool", torch.logical_xor, lambda a, b: bool(a) != bool(b), "`xor(a, b)`: logical xor (bool).",
        "{0} != {1}", np_fn=np.logical_xor)


# --- where, cast --------------------------------------------------------------------------

def _where_infer(t, av, at):
    c, a, b = av
    t.need(c, "bool")
    if a.dtype != b.dtype:
        t.fail(f"wrong dtype: branches {a.dtype} and {b.dtype} differ")
    s = t.broadcast(Value(a.dtype, t.broadcast(c, a)), b)
    return [Value(a.dtype, s, max_bound(a.ub, b.ub))]


def _where_impl(ctx, op, a):
    r = len(ctx.values[op.outs[0]].shape)
    return [torch.where(*(align(x, r) for x in a))]


def _same_shapes(values, op) -> bool:
    out = values[op.outs[0]].shape
    return values[op.args[1]].shape == out and values[op.args[2]].shape == out


def _where_host_cond(ctx, op, conds: list, a, b):
    """A condition the host knows picks a whole operand: no select over its cells."""
    if all(conds) or not any(conds):
        return a if conds[0] else b
    c = torch.tensor(conds, device=a.device).view(-1, *[1] * (a.dim() - 1))
    return torch.where(c, a, b)


define("where", F, args=3, infer=_where_infer, impl=_where_impl, host=lambda c, a, b: a if c else b,
       inline="({1} if {0} else {2})",
       variants=(Variant((HOST, TENSOR, TENSOR), (TENSOR,), _where_host_cond, when=_same_shapes, ctx=False),
                 *_on_arrays(np.where, 3)),
       doc="`where(cond: bool, a, b)`: a where cond, else b (a and b of one dtype; the three broadcast).")


def _cast_infer(t, av, at):
    (x,) = av
    dt = at["dtype"]
    ub = [Dim.of(1)] if x.dtype == "bool" else (x.ub if dt == "i64" else [])
    return [Value(dt, x.shape, ub)]


def _scalar_int_cast(values, op) -> bool:
    return not values[op.outs[0]].shape and op.attrs["dtype"] in ("i64", "bool") and values[op.args[0]].dtype != "f32"


define("cast", F, args=1, attrs={"dtype": Attr("dtype")}, infer=_cast_infer,
       impl=lambda ctx, op, a: [a[0].to(TORCH_DTYPE[op.attrs["dtype"]])],
       variants=(Variant((HOST,), (HOST,), lambda ctx, op, xs: [(int if op.attrs["dtype"] == "i64" else bool)(x) for x in xs],
                         when=_scalar_int_cast, ctx=False),
                 Variant((ARRAY,), (ARRAY,), lambda ctx, op, x: x.astype(NP_DTYPE[op.attrs["dtype"]]), host_memory=True,
                         when=int_values, ctx=False)),
       doc="`cast(x; dtype)`: x converted (f32 -> i64 truncates toward zero; bool -> 0/1; nonzero -> true).")
