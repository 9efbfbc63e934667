"""compile_program: JSON text -> validated, cached CompiledProgram that runs on device tensors.

Executing a program never syncs with the host: shapes (host metadata), seeds and
round indices (host ints) are all the host needs; every data-dependent length
stays a device tensor. The caller reads fold/stop/lengths back once per batch.
On the CPU there is no device to wait for, so scalar results move to the host as
they are made and the integer arithmetic after them runs in Python (HOST_READABLE).

A program runs as a plan (plan.py): one generated Python function per situation (host memory
or a device, the batch size), made on first use and kept, which decides once where each value
lives and which implementation of each op runs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from host.epilogue import ir, plan, tensors
from host.epilogue.env import Env, Result
from host.epilogue.ir import ProgramError
from host.epilogue.ops import OPS
from host.epilogue.ops.layout import slice_len
from host.epilogue.validate import Budget, Checked, check

_CACHE_SIZE = 256
_CONSTS_MAX = 512  # shape-only values kept per program (history lengths vary)
_CONST_CACHE_BYTES = 64 << 10  # larger shape-only values are made each round, not kept
_PLANS_MAX = 64  # plans kept per program (one per device kind, batch size and keep_values)


# Devices whose memory the host reads directly: reading a value there is a copy of a few bytes,
# not a wait for queued work, so scalar results of device ops move to the host at once and the
# integer arithmetic after them runs in Python (~0.2 us an op, against ~5 us for a torch op on
# a one-element tensor). Elsewhere (CUDA) they stay on the device until the batch's readback.
HOST_READABLE = ("cpu",)


_CPU = torch.device("cpu")  # the device of an Env's numpy arrays


def host_readable(device: torch.device | str) -> bool:
    """Whether the host reads `device`'s memory directly (looked up per call: tests switch it off).
    device: a torch.device or its type's name (reading a torch.device's type is a torch call)."""
    return (device if isinstance(device, str) else "cpu" if device is _CPU else device.type) in HOST_READABLE


class CompiledProgram:
    """A validated epilogue. `run(envs)` executes it for several passes at once."""

    def __init__(self, checked: Checked, digest: str, text: str):
        self.checked = checked
        self.digest = digest
        self.text = text
        self._bind_ok: set = set()  # (symbols, their values) whose ops' shapes were checked
        self._binds_seen: set = set()  # values of every symbol, for bindings checked whole
        self._budget = Budget(checked)
        # (op index, device, batch, resolved shape) -> the value: shape-only values are made once
        self._consts: dict = {}
        self._plans: dict[tuple, object] = {}  # (host memory?, batch size, keep_values) -> plan.build's function
        self.uses = {i.kind for i in checked.inputs}
        names = {o.name for o in checked.ops}
        self.has_fold = "fold" in names
        self.reads_logits = "logits" in self.uses  # else a pass running it needs no lm_head
        # scratch rows past the window a pass of this program needs: a draft head's chain of k
        # drafts writes k - 1 rows past the rows the round commits (ops/drafter.py)
        self.spare = max((op.attrs["k"] - 1 for op in checked.ops if "drafter" in op.attrs and "k" in op.attrs), default=0)
        self.has_stop = "stop" in names
        self.uses_suffix = "suffix_draft" in names  # a pass running it is bound its namespace's suffix index
        self.writes = [o.attrs["channel"] for o in checked.ops if o.name in ("put", "set")]
        self.reads = sorted({i.channel for i in checked.inputs if i.channel})
        self._bound = sorted(set(self.reads) | set(self.writes))  # channels an env must bind
        self._tensors = [k for k in ("logits", "hidden", "draft_logits", "window", "history") if k in self.uses]
        self._by_syms: dict[tuple, list] = {}
        for op in checked.ops:
            self._by_syms.setdefault(self._op_syms(op), []).append(op)
        self._syms = tuple(sorted({x for syms in self._by_syms for x in syms}))
        self._impl = [OPS[op.name].impl for op in checked.ops]  # by op index

    # --- binding -------------------------------------------------------------
    def _bind(self, env: Env) -> dict[str, int]:
        b: dict[str, int] = {}
        if env.logits is not None:
            b["R"], b["V"] = env.logits.shape
        else:
            if env.hidden is not None:
                b["R"] = env.hidden.shape[0]
            if env.vocab is not None:
                b["V"] = env.vocab
        if env.window is not None:
            b["W"] = env.window.shape[0]
        elif env.window_len is not None:
            b["W"] = env.window_len
        if env.history is not None:
            b["N"] = env.history.shape[0]
        if env.hidden is not None:
            b["H"] = env.hidden.shape[-1]
        if env.draft_logits is not None:
            b["K"] = env.draft_logits.shape[1]
        for k, v in self.checked.dims.items():
            if k in b and b[k] != v:
                raise ProgramError(f"epilogue declares {k}={v} but the pass has {k}={b[k]}")
            b[k] = v
        for k, v in self.checked.alias.items():
            if k in b and v in b and b[k] != b[v]:
                raise ProgramError(f"epilogue declares {k}={v} but the pass has {k}={b[k]} and {v}={b[v]}")
            if k in b or v in b:
                b[k] = b[v] = b.get(k, b.get(v))
        return b

    def _check_env(self, env: Env, bind: dict[str, int]) -> None:
        for kind in self._tensors:
            if getattr(env, kind) is None:
                raise ProgramError(f"epilogue reads '{kind}' but the pass does not provide it")
        for name in self.checked.matchers:
            if name not in env.matchers:
                raise ProgramError(f"epilogue uses matcher {name!r} but it is not bound")
        for name in self.checked.drafters:
            if name not in env.drafters:
                raise ProgramError(f"epilogue uses drafter {name!r} but the pass has none of that name")
        for name in self._bound:
            ch = env.channels.get(name)
            if ch is None:
                raise ProgramError(f"epilogue uses channel {name!r} but it is not bound")
            cap = self.checked.channels[name].capacity
            if ch.capacity != cap:  # every DeviceChannel states it as a host int
                raise ProgramError(f"channel {name!r} has capacity {ch.capacity}; the epilogue declares {cap}")
        # Resolve every static shape under this binding (host ints only), once per distinct value
        # of the symbols each op's shapes use: a history length that grows every round re-checks
        # only the ops that depend on N.
        if len(self._bind_ok) > _CONSTS_MAX:
            self._bind_ok.clear()
            self._binds_seen.clear()
        whole = tuple(map(bind.get, self._syms))  # a binding seen before: nothing to re-check
        if whole in self._binds_seen:
            return self._check_fold(bind)
        for syms, ops in self._by_syms.items():
            key = (syms, tuple(bind.get(x) for x in syms))
            if key not in self._bind_ok:
                for op in ops:
                    self._check_op(op, bind)
                self._bind_ok.add(key)
        self._budget.check(bind)
        self._binds_seen.add(whole)
        self._check_fold(bind)

    def _check_fold(self, bind: dict[str, int]) -> None:
        if self.has_fold and "W" not in bind:
            raise ProgramError("epilogue sets fold but the pass gives no window length")

    def _op_syms(self, op) -> tuple[str, ...]:
        dims = [d for o in op.outs for d in self.checked.values[o].shape]
        if op.name in ("slice", "index"):
            x = self.checked.values[op.args[0]]
            dims.append(x.shape[op.attrs["axis"]])
        return tuple(sorted({d.sym for d in dims if d.sym is not None}))

    def _check_op(self, op, bind: dict[str, int]) -> None:
        for o in op.outs:
            for d in self.checked.values[o].shape:
                if d.sym is not None and d.sym not in bind:
                    raise ProgramError(f"op {op.index} ({op.name}): dim {d.sym} is unknown for this pass")
                if d.resolve(bind) < 0:
                    raise ProgramError(f"op {op.index} ({op.name}): dim {d} is negative for this pass")
        if op.name in ("slice", "index"):
            x = self.checked.values[op.args[0]]
            ax = op.attrs["axis"]
            n = x.shape[ax].resolve(bind)
            if op.name == "index" and not -n <= op.attrs["i"] < n:
                raise ProgramError(f"op {op.index} (index): index {op.attrs['i']} out of range {n}")
            if op.name == "slice":
                got = slice_len(ir.Dim.of(n), op.attrs["start"], op.attrs["stop"]).off
                want = self.checked.values[op.outs[0]].shape[ax].resolve(bind)
                if got != want:
                    raise ProgramError(f"op {op.index} (slice): window of {n} is too short for this slice")

    # --- execution -----------------------------------------------------------
    def run(self, envs: Sequence[Env], keep_values: bool = False) -> list[Result]:
        """Run for each env; envs whose shapes agree run as one batched call.
        keep_values: also return every SSA value (Result.values; tests and debugging)."""
        if len(envs) == 1:  # the common case: nothing to group
            bind = self._bind(envs[0])
            self._check_env(envs[0], bind)
            dev = self._device(envs[0])
            fn = self._plans.get((host_readable(dev), 1, keep_values))
            return fn(envs, bind, dev) if fn is not None else self._run(envs, bind, keep_values)
        groups: dict[tuple, list[int]] = {}
        binds = []
        for i, env in enumerate(envs):
            bind = self._bind(env)
            self._check_env(env, bind)
            binds.append(bind)
            dev = self._device(env)
            dts = tuple(env.channels[n].buf.dtype for n in self._bound)
            groups.setdefault((dev, tuple(sorted(bind.items())), dts), []).append(i)
        out: list[Result | None] = [None] * len(envs)
        for idx in groups.values():
            for i, r in zip(idx, self._run([envs[i] for i in idx], binds[idx[0]], keep_values)):
                out[i] = r
        return out  # type: ignore[return-value]

    def _run(self, envs: Sequence[Env], bind: dict[str, int], keep: bool) -> list[Result]:
        dev = self._device(envs[0])
        key = (host_readable(dev), len(envs), keep)
        fn = self._plans.get(key)
        if fn is None:
            if len(self._plans) >= _PLANS_MAX:
                self._plans.clear()
            fn = self._plans[key] = plan.build(self.checked, key[0], key[1], keep, self._shaped)
        return fn(envs, bind, dev)

    def _shaped(self, op, bind: dict[str, int], B: int, dev) -> torch.Tensor:
        """A shape-only op's value (const, full, arange): made once per shape and kept, when small."""
        out = self.checked.values[op.outs[0]]
        key = (op.index, dev, B, tuple(d.resolve(bind) for d in out.shape))
        got = self._consts.get(key)
        if got is None:
            ctx = tensors.Ctx(B, dev, bind, [0] * B, [0] * B, self.checked.values)
            got = self._impl[op.index](ctx, op, [])[0]
            if got.untyped_storage().nbytes() <= _CONST_CACHE_BYTES:  # a cached program keeps it
                if len(self._consts) > _CONSTS_MAX:
                    self._consts.clear()
                self._consts[key] = got
        return got

    def _device(self, env: Env) -> torch.device:
        for t in (env.logits, env.window, env.history, env.hidden, env.draft_logits):
            if t is not None:
                return _CPU if isinstance(t, np.ndarray) else t.device
        for ch in env.channels.values():
            return ch.buf.device
        return torch.device("cpu")


_cache: "OrderedDict[str, CompiledProgram]" = OrderedDict()
_lock = threading.Lock()


def compile_program(text: str) -> CompiledProgram:
    """Validate epilogue JSON text and return its CompiledProgram (cached by sha256 of canonical JSON).

    Raises ProgramError (an InvalidArgument) naming the op index and op name at fault."""
    obj = ir.parse(text)
    try:
        digest = ir.content_hash(obj)
    except ValueError as e:  # NaN/Infinity constants
        raise ProgramError(f"epilogue program has a non-finite number: {e}") from None
    with _lock:
        prog = _cache.get(digest)
        if prog is not None:
            _cache.move_to_end(digest)
            return prog
    prog = CompiledProgram(check(obj), digest, ir.canonical(obj))
    with _lock:
        _cache[digest] = prog
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return prog
