"""A program planned for one situation (host memory or a device, a batch size) and generated as
one straight-line Python function: where each value lives is decided here, once, not per round.

A value takes one or more forms (ops/spec.py): HOST, one Python scalar per pass (an i64 or bool
scalar the host knows: the round, channel lengths, constants, sizes, and integer arithmetic on
them); ARRAY, a numpy array [B, ...] (host memory only: the readouts, numpy's argmax); TENSOR, a
torch tensor [B, ...]. Each op runs the first implementation whose operands can be had in the
forms it takes: its host function (HOST in, HOST out), one of its variants, else its torch
implementation (TENSOR in, TENSOR out). A form is made from another where an op first needs it, and only
where that is cheap: a TENSOR from HOST values or an ARRAY anywhere, HOST or ARRAY from a TENSOR
only in host memory, where reading a value is a copy of a few bytes rather than a wait for
queued work (a device's values reach the host once per batch, in the loop's readback).

With B = 1 a HOST value is a plain scalar in a local variable; with more passes, a list of B.
The generated source is kept on the function (`.source`) for debugging.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from host.epilogue.env import ChannelWrite, Result, host_length
from host.epilogue.tensors import NP_DTYPE, TORCH_DTYPE, Ctx
from host.epilogue.ops import OPS
from host.epilogue.ops.effects import write_cells
from host.epilogue.ops.spec import ARRAY, HOST, TENSOR
from host.epilogue.validate import Checked

READOUTS = ("logits", "hidden", "draft_logits")  # float32 inputs a pass's readout provides
SHAPE_ONLY = ("const", "full", "arange")  # values that depend on nothing but the binding


def readout_array(x) -> np.ndarray:
    """A readout (tensor or array) in host memory as a float32 numpy array."""
    if isinstance(x, np.ndarray):
        return x if x.dtype == np.float32 else x.astype(np.float32)
    x = x.detach()
    return (x if x.dtype == torch.float32 else x.float()).numpy()


def readout_tensor(xs: list, dev) -> torch.Tensor:
    ts = [torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x in xs]
    t = torch.stack(ts) if len(ts) > 1 else ts[0].unsqueeze(0)
    return (t if t.dtype == torch.float32 else t.float()).to(dev)


def int_input(xs: list, dev) -> torch.Tensor:
    t = torch.stack(xs) if len(xs) > 1 else xs[0].unsqueeze(0)
    return t if t.dtype == torch.int64 else t.to(torch.int64)


def int_array(xs: list) -> np.ndarray:
    """Token inputs (window, history) in host memory as an int64 numpy array [B, n]."""
    a = np.stack([x.numpy() for x in xs]) if len(xs) > 1 else xs[0].numpy()[None]
    return a if a.dtype == np.int64 else a.astype(np.int64)


def channel_array(bufs: list, dtype: np.dtype, copy: bool) -> np.ndarray:
    """channel_input in host memory, as a numpy array."""
    a = np.stack([b.numpy() for b in bufs]) if len(bufs) > 1 else bufs[0].numpy()[None]
    return a.astype(dtype) if copy or a.dtype != dtype else a


def channel_input(bufs: list, dtype: torch.dtype, copy: bool) -> torch.Tensor:
    """A channel's cells [B, capacity] as the program's dtype. copy: the program writes the
    channel later on, in place, so a read must see a copy of the old cells."""
    if len(bufs) > 1:
        return torch.stack(bufs).to(dtype)  # stack copies
    t = bufs[0].unsqueeze(0).to(dtype)
    return t.clone() if copy and t.data_ptr() == bufs[0].data_ptr() else t


@functools.lru_cache(maxsize=1024)
def scalar_tensor(value, dtype: torch.dtype, B: int, dev) -> torch.Tensor:
    """A constant scalar as a [B] tensor on `dev` (implementations never write their operands)."""
    return torch.full((B,), value, dtype=dtype, device=dev)


def build(checked: Checked, host: bool, B: int, keep: bool, consts: Callable) -> Callable:
    """The program as `run(envs, bind, dev) -> list[Result]` for B passes. host: the device's
    memory is the host's. keep: also return every value as a tensor (Result.values).
    consts(op, bind, B, dev) -> a shape-only op's results, made once per shape by the caller."""
    return _Builder(checked, host, B, keep, consts).function()


class _Builder:
    def __init__(self, checked: Checked, host: bool, B: int, keep: bool, consts: Callable):
        self.c, self.host, self.B, self.keep = checked, host, B, keep
        self.lines: list[str] = []
        self.scope: dict[str, object] = {
            "Result": Result, "ChannelWrite": ChannelWrite, "write_cells": write_cells, "host_length": host_length,
            "readout_array": readout_array, "readout_tensor": readout_tensor, "int_input": int_input,
            "channel_input": channel_input, "scalar_tensor": scalar_tensor, "torch": torch, "np": np, "Ctx": Ctx, "consts": consts,
            "int_array": int_array, "channel_array": channel_array, "NP_DTYPE": NP_DTYPE,
            "values": checked.values}
        self.forms: dict[int, set[str]] = {}  # value index -> the forms made so far
        self.known: dict[int, object] = {}  # value index -> its constant host value, where static
        self.uses_ctx = False
        self.written = {o.attrs["channel"] for o in checked.ops if o.name in ("put", "set")}

    # --- forms -------------------------------------------------------------------------------
    def scalar_int(self, i: int) -> bool:
        v = self.c.values[i]
        return not v.shape and v.dtype in ("i64", "bool")

    def can(self, i: int, form: str) -> bool:
        """Whether value i can be had in `form` (made now, or cheaply from a form it has)."""
        have = self.forms[i]
        if form in have or form == TENSOR:
            return True
        if form == HOST:
            return self.scalar_int(i) and self.host  # in host memory a scalar is read at once
        return form == ARRAY and self.host

    def get(self, i: int, form: str) -> str:
        """The variable holding value i in `form`, made here from another form if need be."""
        have = self.forms[i]
        name = f"{form}{i}"
        if form in have:
            return name
        if form == TENSOR:
            dt = f"torch.{str(TORCH_DTYPE[self.c.values[i].dtype]).split('.')[-1]}"
            if i in self.known:  # a constant: one tensor per device, made once
                self.emit(f"t{i} = scalar_tensor({self.known[i]!r}, {dt}, {self.B}, dev)")
            elif ARRAY in have or self.host:  # in host memory a tensor views an array (cheaper to make)
                self.emit(f"t{i} = torch.from_numpy({self.get(i, ARRAY)})")
            else:
                src = f"[h{i}]" if self.B == 1 else f"h{i}"
                self.emit(f"t{i} = torch.tensor({src}, dtype={dt}, device=dev)")
        elif form == HOST:
            src = f"a{i}" if ARRAY in have else f"t{i}"
            self.emit(f"h{i} = {src}.item()" if self.B == 1 else f"h{i} = {src}.tolist()")
        elif HOST in have:  # ARRAY from host scalars
            src = f"[h{i}]" if self.B == 1 else f"h{i}"
            self.emit(f"a{i} = np.array({src}, dtype=NP_DTYPE[{self.c.values[i].dtype!r}])")
        else:  # ARRAY from a tensor, in host memory
            self.emit(f"a{i} = {self.get(i, TENSOR)}.numpy()")
        have.add(form)
        return name

    def hosts(self, i: int) -> str:
        """Value i's HOST form as a list of B (what variants take)."""
        h = self.get(i, HOST)
        return f"[{h}]" if self.B == 1 else h

    def emit(self, line: str) -> None:
        self.lines.append(line)

    def made(self, i: int, form: str) -> None:
        self.forms[i] = {form}

    # --- the function --------------------------------------------------------------------------
    def function(self) -> Callable:
        for i, inp in enumerate(self.c.inputs):
            self.input(i, inp)
        effects: dict[str, object] = {}
        writes: dict[str, str] = {}
        for op in self.c.ops:
            if op.name in ("put", "set"):
                writes[op.attrs["channel"]] = self.write(op)
            elif op.name == "fold":
                effects["fold"] = self.fold(op)
            elif op.name == "stop":
                effects["stop"] = self.stop(op)
            else:
                self.compute(op)
        self.result(effects, writes)
        head = ["env0 = envs[0]", "chs = env0.channels"] if self.B == 1 else []
        if self.uses_ctx:
            head.append("ctx = Ctx(%d, dev, bind, [e.seed for e in envs], [e.position for e in envs], values, "
                        "[e.matchers for e in envs], [e.drafters for e in envs], [e.suffix for e in envs], "
                        "[e.draw_position for e in envs])" % self.B)
        src = "def run(envs, bind, dev):\n" + "".join(f"    {line}\n" for line in head + self.lines)
        exec(compile(src, "<epilogue plan>", "exec"), self.scope)
        fn = self.scope["run"]
        fn.source = src
        return fn

    def input(self, i: int, inp) -> None:
        k = inp.kind
        if k == "round":
            self.emit(f"h{i} = env0.round" if self.B == 1 else f"h{i} = [e.round for e in envs]")
            self.made(i, HOST)
        elif k == "channel_len":
            self.emit(f"h{i} = host_length(chs[{inp.channel!r}])" if self.B == 1
                      else f"h{i} = [host_length(e.channels[{inp.channel!r}]) for e in envs]")
            self.made(i, HOST)
        elif k in READOUTS and self.host:
            self.emit(f"a{i} = readout_array(env0.{k})[None]" if self.B == 1
                      else f"a{i} = np.stack([readout_array(e.{k}) for e in envs])")
            self.made(i, ARRAY)
        elif k in READOUTS:
            self.emit(f"t{i} = readout_tensor([e.{k} for e in envs], dev)")
            self.made(i, TENSOR)
        elif k in ("window", "history") and self.host:
            self.emit(f"a{i} = int_array([e.{k} for e in envs])")
            self.made(i, ARRAY)
        elif k in ("window", "history"):
            self.emit(f"t{i} = int_input([e.{k} for e in envs], dev)")
            self.made(i, TENSOR)
        elif self.host:  # a channel's cells, as an array
            name = inp.channel
            self.scope[f"dt{i}"] = NP_DTYPE[self.c.channels[name].dtype]
            self.emit(f"a{i} = channel_array([e.channels[{name!r}].buf for e in envs], dt{i}, {name in self.written})")
            self.made(i, ARRAY)
        else:  # a channel's cells
            name = inp.channel
            self.scope[f"dt{i}"] = TORCH_DTYPE[self.c.channels[name].dtype]
            self.emit(f"t{i} = channel_input([e.channels[{name!r}].buf for e in envs], dt{i}, {name in self.written})")
            self.made(i, TENSOR)

    def compute(self, op) -> None:
        spec = OPS[op.name]
        outs = op.outs
        if op.name == "const" and self.scalar_int(outs[0]):
            self.known[outs[0]] = op.attrs["value"]
            self.constant(outs[0], op.attrs["value"])
            return
        if op.name == "size":
            d = self.c.values[op.args[0]].shape[op.attrs["axis"]]
            expr = str(d.off) if d.sym is None else f"bind[{d.sym!r}] + {d.off}" if d.off else f"bind[{d.sym!r}]"
            self.emit(f"h{outs[0]} = {expr}" if self.B == 1 else f"h{outs[0]} = [{expr}] * {self.B}")
            self.made(outs[0], HOST)
            return
        if spec.host is not None and self.scalar_int(outs[0]) and all(
                self.scalar_int(a) and self.can(a, HOST) for a in op.args):
            self.host_op(op, spec)
            return
        if op.name in SHAPE_ONLY:
            self.scope[f"op{op.index}"] = op
            self.emit(f"t{outs[0]} = consts(op{op.index}, bind, {self.B}, dev)")
            self.made(outs[0], TENSOR)
            return
        for j, var in enumerate(spec.variants):
            if (var.host_memory and not self.host) or len(var.takes) != len(op.args):
                continue
            if var.when is not None and not var.when(self.c.values, op):
                continue
            if all(self.can(a, f) for a, f in zip(op.args, var.takes)):
                if var.inline is not None and self.B == 1 and len(op.outs) == 1:
                    expr = var.inline(op).format(*(self.get(a, f) for a, f in zip(op.args, var.takes)))
                    self.emit(f"{var.gives[0]}{outs[0]} = {expr}  # {op.name}{op.index}_v{j}")
                    self.made(outs[0], var.gives[0])
                    return
                args = [self.hosts(a) if f == HOST else self.get(a, f) for a, f in zip(op.args, var.takes)]
                self.call(op, var.fn, args, var.gives, f"{op.name}{op.index}_v{j}", var.ctx, impl=False)
                return
        self.call(op, spec.impl, ["[" + ", ".join(self.get(a, TENSOR) for a in op.args) + "]"],
                  (TENSOR,) * len(outs), f"k_{op.name}{op.index}", True, impl=True)

    def constant(self, i: int, value) -> None:
        self.emit(f"h{i} = {value!r}" if self.B == 1 else f"h{i} = [{value!r}] * {self.B}")
        self.made(i, HOST)

    def host_op(self, op, spec) -> None:
        out, args = op.outs[0], op.args
        known = [self.known.get(a) for a in args]
        if all(a in self.known for a in args):  # all constants: fold at plan time
            self.known[out] = spec.host(*known)
            self.constant(out, self.known[out])
            return
        if op.name in ("or", "and") and any(a in self.known for a in args):
            k, other = (args[0], args[1]) if args[0] in self.known else (args[1], args[0])
            if bool(self.known[k]) == (op.name == "or"):  # x | True, x & False
                self.known[out] = op.name == "or"
                self.constant(out, self.known[out])
            else:  # x | False, x & True: x itself
                self.emit(f"h{out} = {self.get(other, HOST)}")
                self.made(out, HOST)
            return
        names = [self.get(a, HOST) for a in args]
        fn = f"{op.name}{op.index}"
        self.scope[fn] = spec.host
        if self.B == 1:
            expr = spec.inline.format(*names) if spec.inline else f"{fn}({', '.join(names)})"
            self.emit(f"h{out} = {expr}")
        else:
            xs = [f"x{j}" for j in range(len(names))]
            expr = spec.inline.format(*xs) if spec.inline else f"{fn}({', '.join(xs)})"
            over = names[0] if len(names) == 1 else f"zip({', '.join(names)})"
            self.emit(f"h{out} = [{expr} for {', '.join(xs)} in {over}]")
        self.made(out, HOST)

    def call(self, op, fn, args: list[str], gives: tuple[str, ...], name: str, ctx: bool, impl: bool) -> None:
        """Emit a call of an implementation (it returns a list) or a variant (its result, or a tuple)."""
        self.uses_ctx |= ctx
        self.scope[name] = fn
        self.scope[f"op{op.index}"] = op
        call = f"{name}({'ctx' if ctx else 'None'}, op{op.index}, {', '.join(args)})"
        if len(op.outs) == 1 and not impl:
            results = [call]
        else:
            self.emit(f"r = {call}")
            results = [f"r[{j}]" for j in range(len(op.outs))]
        for o, form, res in zip(op.outs, gives, results):
            if form == HOST:
                self.emit(f"h{o} = {res}[0]" if self.B == 1 else f"h{o} = {res}")
            else:
                self.emit(f"{form}{o} = {res}")
            self.made(o, form)

    # --- effects -----------------------------------------------------------------------------
    def per_pass(self, var: str) -> str:
        """A per-pass value inside the results' loop over b (a plain variable when B is 1)."""
        return var if self.B == 1 else f"{var}[b]"

    def fold(self, op) -> str:
        a = op.args[0]
        if self.can(a, HOST):
            return f"min(max({self.per_pass(self.get(a, HOST))}, 0), W)"
        self.emit(f"fold_t = {self.get(a, TENSOR)}.clamp(0, bind['W'])")
        return "fold_t[b]" if self.B > 1 else "fold_t[0]"

    def stop(self, op) -> str:
        a = op.args[0]
        if self.can(a, HOST):
            return self.per_pass(self.get(a, HOST))
        return f"{self.get(a, TENSOR)}[{'b' if self.B > 1 else 0}]"

    def write(self, op) -> str:
        """Emit the write of each pass's cells; returns the variable of its (length, overflow),
        a list of them when B > 1."""
        name = op.attrs["channel"]
        vals = op.args[0]
        cap = self.c.channels[name].capacity
        b = "0" if self.B == 1 else "b"
        if len(op.args) > 1 and self.can(op.args[1], HOST):
            cnt = self.get(op.args[1], HOST) + ("" if self.B == 1 else "[b]")
        elif len(op.args) > 1:
            cnt = f"{self.get(op.args[1], TENSOR)}[{b}]"
        else:
            cnt = "None"
        if self.host:  # a few cells as a list: the common one-cell write then needs no slice
            n = self.c.values[vals].shape[0]
            src = f"{self.get(vals, ARRAY)}[{b}]" + (".tolist()" if n.known and n.off <= 4 else "")
        else:
            src = f"{self.get(vals, TENSOR)}[{b}]"
        w, put = f"w{op.index}", op.name == "put"
        if self.B == 1:
            self.emit(f"{w} = write_cells(chs[{name!r}], {put}, {src}, {cnt}, {cap})")
        else:
            self.emit(f"{w} = [write_cells(envs[b].channels[{name!r}], {put}, {src}, {cnt}, {cap}) "
                      f"for b in range({self.B})]")
        return w

    def result(self, effects: dict, writes: dict[str, str]) -> None:
        fold, stop = effects.get("fold", "None"), effects.get("stop", "None")
        if "W" in fold:
            self.emit("W = bind['W']")
        if self.keep:
            self.emit("vals = [" + ", ".join(self.get(i, TENSOR) for i in range(len(self.c.values))) + "]")
        body = [f"res = Result(fold={fold}, stop={stop})"]
        for name, w in writes.items():
            env = "env0" if self.B == 1 else "envs[b]"
            body.append(f"res.channels[{name!r}] = ChannelWrite({env}.channels[{name!r}].buf, *{self.per_pass(w)})")
        if self.keep:
            body.append("res.values = [v[b] for v in vals]")
        if self.B == 1:
            self.emit("b = 0")
            self.lines += body
            self.emit("return [res]")
        else:
            self.emit("out = []")
            self.emit(f"for b in range({self.B}):")
            self.lines += [f"    {line}" for line in body + ["out.append(res)"]]
            self.emit("return out")


__all__ = ["build", "readout_array", "READOUTS"]
