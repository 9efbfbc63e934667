"""A program as one straight-line Python function, for a single pass in host memory.

The executor (compile.py) interprets a program op by op, deciding per op and per round where
each value lives. For one pass on the CPU those decisions come out the same every round, and
the interpretation costs more than the work: right after a model call, whose weights evict the
host's code and data from the caches, each op's trip through the interpreter runs several times
slower than it would warm. A program whose every op runs on host values (integer scalars, the
float readouts as numpy arrays, argmax, scalar reads, channel writes, fold and stop) is
therefore also generated as Python source: one function, its values in local variables, the
same host functions the interpreter calls. Other programs have no plan and are interpreted.

The generated function returns the same Result as the interpreter, or None (before any side
effect) when a readout is not a float32 array in host memory; the caller then interprets.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from host.epilogue.env import ChannelWrite, Env, Result, host_length
from host.epilogue.kernels import argmax_np
from host.epilogue.ops import OPS
from host.epilogue.validate import Checked

READOUTS = ("logits", "hidden", "draft_logits")  # float32 inputs a pass's readout provides


def host_array(t) -> np.ndarray | None:
    """A float32 readout as a numpy array in host memory, or None where it is not one."""
    if isinstance(t, np.ndarray):
        return t if t.dtype == np.float32 else None
    if t.dtype == torch.float32 and not t.requires_grad and t.device.type == "cpu":
        return t.numpy()
    return None


def write_host(ch, put: bool, src, count: int | None, capacity: int) -> tuple[int, bool]:
    """Write the cells of src (a list, or a 1-D array in host memory) to a channel: appended (put)
    or from cell 0 (set), the first `count` of them if given, as many as fit.
    Returns (new length, overflow)."""
    start = host_length(ch) if put else 0
    size = len(src)
    room = max(min(size, capacity - start), 0)
    n = size if count is None else min(max(count, 0), size)
    k = min(n, room)
    if k:  # numpy's assignment converts the dtype as torch's copy_ does, at about half its cost
        dst = ch.buf.numpy() if getattr(ch, "host", None) is None else ch.host
        if k == 1:  # one cell (a decode step's token): no slices
            dst[start] = src[0]
        else:
            dst[start:start + k] = src[:k]
    return start + k, n > room


def build(checked: Checked, host_ops: dict[int, Callable], scalar_ints: set[int],
          measured: Callable) -> Callable[[Env, dict], Result | None] | None:
    """The plan of a checked program, or None if an op needs a tensor.
    host_ops: op index -> the interpreter's host function for scalar integer ops;
    scalar_ints: value indices of i64/bool scalars; measured(op, bind): a size op's value."""
    head, body, tail = [], [], []  # lines of the function: readout checks, ops, the Result
    scope: dict[str, object] = {"Result": Result, "ChannelWrite": ChannelWrite, "write_host": write_host,
                                "host_array": host_array}
    # value index -> "s" (a Python scalar, v<i>) or "a" (a numpy array, v<i>: the pass's value,
    # no batch dim; its cells as a list too, l<i>, once an op reads them)
    kind: dict[int, str] = {}
    listed: set[int] = set()

    def cells(i: int) -> str:
        if i not in listed:
            listed.add(i)
            body.append(f"l{i} = v{i}.tolist()")
        return f"l{i}"

    for i, inp in enumerate(checked.inputs):
        if inp.kind == "round":
            body.append(f"v{i} = env.round")
            kind[i] = "s"
        elif inp.kind == "channel_len":
            scope["host_length"] = host_length
            body.append(f"v{i} = host_length(chs[{inp.channel!r}])")
            kind[i] = "s"
        elif inp.kind in READOUTS:
            head.append(f"v{i} = host_array(env.{inp.kind})")
            head.append(f"if v{i} is None:\n        return None")
            kind[i] = "a"
        else:
            return None  # windows, histories, channel cells: i64 tensors for torch kernels
    written: dict[str, str] = {}
    fold = stop = None
    for op in checked.ops:
        args = op.args
        ak = [kind.get(a) for a in args]
        out = op.outs[0] if op.outs else None
        if op.name == "const" and out in scalar_ints:
            body.append(f"v{out} = {op.attrs['value']!r}")
        elif op.name == "size":
            scope[f"op{op.index}"] = op
            scope["measured"] = measured
            body.append(f"v{out} = measured(op{op.index}, bind)")
        elif op.index in host_ops and all(k == "s" for k in ak):
            pyop = OPS[op.name].pyop  # a Python operator that means the same as the host function
            if pyop is not None:
                body.append(f"v{out} = v{args[0]} {pyop} v{args[1]}")
            else:
                scope[f"f{op.index}"] = host_ops[op.index]
                body.append(f"v{out} = f{op.index}({', '.join(f'v{a}' for a in args)})")
        elif op.name == "argmax" and ak == ["a"] and out not in scalar_ints:
            scope["argmax_np"] = argmax_np
            body.append(f"v{out} = argmax_np(v{args[0]}, {op.attrs['axis']})")
            kind[out] = "a"
            continue
        elif op.name == "index" and ak == ["a"] and out in scalar_ints and len(checked.values[args[0]].shape) == 1:
            body.append(f"v{out} = {cells(args[0])}[{op.attrs['i']}]")
        elif op.name in ("put", "set") and ak[0] == "a" and len(checked.values[args[0]].shape) == 1 \
                and all(k == "s" for k in ak[1:]):
            name = op.attrs["channel"]
            cnt = f"v{args[1]}" if len(args) > 1 else "None"
            cap = checked.channels[name].capacity
            body.append(f"w{op.index} = write_host(chs[{name!r}], {op.name == 'put'}, {cells(args[0])}, {cnt}, {cap})")
            written[name] = f"w{op.index}"  # a later write to the channel is the one reported
            continue
        elif op.name == "fold" and ak == ["s"]:
            fold = f"min(max(v{args[0]}, 0), bind['W'])"
            continue
        elif op.name == "stop" and ak == ["s"]:
            stop = f"v{args[0]}"
            continue
        else:
            return None
        kind[out] = "s"  # the branches that do not `continue` make a scalar
    tail.append(f"res = Result(fold={fold}, stop={stop})")
    for name, w in written.items():
        tail.append(f"res.channels[{name!r}] = ChannelWrite(chs[{name!r}].buf, *{w})")
    tail.append("return res")
    src = "def plan(env, bind):\n    chs = env.channels\n" + "".join(f"    {line}\n" for line in head + body + tail)
    exec(compile(src, "<epilogue plan>", "exec"), scope)
    plan = scope["plan"]
    plan.source = src  # for debugging: the generated code
    return plan
