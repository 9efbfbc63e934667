"""compile_program: JSON text -> validated, cached Program that runs on device tensors.

Executing a program never syncs with the host: shapes (host metadata), seeds and
round indices (host ints) are all the host needs; every data-dependent length
stays a device tensor. The caller reads fold/stop/lengths back once per batch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import torch

from host.epilogue import ir, kernels
from host.epilogue.env import ChannelWrite, Env, Result
from host.epilogue.ir import ProgramError
from host.epilogue.validate import Checked, _slice_len, check

_CACHE_SIZE = 256


class Program:
    """A validated epilogue. `run(envs)` executes it for several passes at once."""

    def __init__(self, checked: Checked, digest: str, text: str):
        self.checked = checked
        self.digest = digest
        self.text = text
        self._bind_ok: set = set()
        self._consts: dict = {}  # (op index, device, batch) -> tensor: constants are made once, not per round
        self.uses = {i.kind for i in checked.inputs}
        names = {o.name for o in checked.ops}
        self.has_fold = "fold" in names
        self.has_stop = "stop" in names
        self.writes = [o.attrs["channel"] for o in checked.ops if o.name in ("put", "set")]
        self.reads = sorted({i.channel for i in checked.inputs if i.channel})

    # --- binding -------------------------------------------------------------
    def _bind(self, env: Env) -> dict[str, int]:
        b: dict[str, int] = {}
        if env.logits is not None:
            b["R"], b["V"] = env.logits.shape
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
        need = {"logits": env.logits, "hidden": env.hidden, "draft_logits": env.draft_logits,
                "window": env.window, "history": env.history}
        for kind, t in need.items():
            if kind in self.uses and t is None:
                raise ProgramError(f"epilogue reads '{kind}' but the pass does not provide it")
        for name in set(self.reads) | set(self.writes):
            ch = env.channels.get(name)
            if ch is None:
                raise ProgramError(f"epilogue uses channel {name!r} but it is not bound")
            cap = self.checked.channels[name].capacity
            if ch.buf.dim() != 1 or ch.buf.shape[0] != cap:
                raise ProgramError(f"channel {name!r} has capacity {tuple(ch.buf.shape)}; the epilogue declares {cap}")
        key = tuple(sorted(bind.items()))
        if key in self._bind_ok:
            return
        # Resolve every static shape under this binding (host ints only).
        for op in self.checked.ops:
            for o in op.outs:
                for d in self.checked.values[o].shape:
                    if d.sym is not None and d.sym not in bind:
                        raise ProgramError(f"op {op.index} ({op.name}): dim {d.sym} is unknown for this pass")
                    if d.resolve(bind) < 0:
                        raise ProgramError(f"op {op.index} ({op.name}): dim {d} is negative for this pass")
            if op.name in ("slice", "index"):
                x = self.checked.values[op.args[0]]
                ax = op.attrs.get("axis", 0) % len(x.shape)
                n = x.shape[ax].resolve(bind)
                if op.name == "index" and not -n <= op.attrs["i"] < n:
                    raise ProgramError(f"op {op.index} (index): index {op.attrs['i']} out of range {n}")
                if op.name == "slice":
                    got = _slice_len("", ir.Dim.of(n), op.attrs.get("start"), op.attrs.get("stop")).off
                    want = self.checked.values[op.outs[0]].shape[ax].resolve(bind)
                    if got != want:
                        raise ProgramError(f"op {op.index} (slice): window of {n} is too short for this slice")
        if self.has_fold and "W" not in bind:
            raise ProgramError("epilogue sets fold but the pass gives no window length")
        self._bind_ok.add(key)

    # --- execution -----------------------------------------------------------
    def run(self, envs: Sequence[Env], keep_values: bool = False) -> list[Result]:
        """Run for each env; envs whose shapes agree run as one batched call.
        keep_values: also return every SSA value (Result.values; tests and debugging)."""
        groups: dict[tuple, list[int]] = {}
        binds = []
        for i, env in enumerate(envs):
            bind = self._bind(env)
            self._check_env(env, bind)
            binds.append(bind)
            dev = self._device(env)
            dts = tuple(str(env.channels[n].buf.dtype) for n in sorted(set(self.reads) | set(self.writes)))
            groups.setdefault((str(dev), tuple(sorted(bind.items())), dts), []).append(i)
        out: list[Result | None] = [None] * len(envs)
        for idx in groups.values():
            for i, r in zip(idx, self._run_batch([envs[i] for i in idx], binds[idx[0]], keep_values)):
                out[i] = r
        return out  # type: ignore[return-value]

    def _device(self, env: Env) -> torch.device:
        for t in (env.logits, env.window, env.history, env.hidden, env.draft_logits):
            if t is not None:
                return t.device
        for ch in env.channels.values():
            return ch.buf.device
        return torch.device("cpu")

    def _run_batch(self, envs: list[Env], bind: dict[str, int], keep: bool) -> list[Result]:
        c = self.checked
        B = len(envs)
        dev = self._device(envs[0])
        ctx = kernels.Ctx(B, dev, bind, [e.seed for e in envs], [e.round for e in envs], c.values)
        vals: list[torch.Tensor] = []
        for inp in c.inputs:
            vals.append(self._input(inp, envs, dev))
        result_fold = result_stop = None
        writes: dict[str, tuple] = {}
        for op in c.ops:
            args = [vals[a] for a in op.args]
            if op.name == "fold":
                result_fold = args[0].clamp(0, bind["W"])  # also proven <= W at validation; clamp is cheap
            elif op.name == "stop":
                result_stop = args[0]
            elif op.name in ("put", "set"):
                writes[op.attrs["channel"]] = self._write(op, args, envs, dev)
            elif op.name == "const":
                key = (op.index, str(dev), B)
                if key not in self._consts:
                    self._consts[key] = kernels.run_op(ctx, op, args)
                vals.extend(self._consts[key])
            else:
                vals.extend(kernels.run_op(ctx, op, args))
        results = []
        for b in range(B):
            r = Result(fold=None if result_fold is None else result_fold[b],
                       stop=None if result_stop is None else result_stop[b])
            for name, (buf, ln, ov) in writes.items():
                r.channels[name] = ChannelWrite(buf[b], ln[b], ov[b])
            if keep:
                r.values = [v[b] for v in vals]
            results.append(r)
        return results

    def _input(self, inp, envs: list[Env], dev) -> torch.Tensor:
        k = inp.kind
        if k == "round":
            return torch.tensor([e.round for e in envs], dtype=torch.int64, device=dev)
        if k == "channel":
            dt = kernels.TORCH_DTYPE[self.checked.channels[inp.channel].dtype]
            return torch.stack([e.channels[inp.channel].buf for e in envs]).to(dt)
        if k == "channel_len":
            return torch.stack([e.channels[inp.channel].length.reshape(()) for e in envs]).to(torch.int64)
        t = torch.stack([getattr(e, k) for e in envs])
        return t.to(torch.int64) if k in ("window", "history") else t.to(torch.float32)

    def _write(self, op, args, envs: list[Env], dev):
        name = op.attrs["channel"]
        chans = [e.channels[name] for e in envs]
        old = torch.stack([ch.buf for ch in chans])
        old_len = torch.stack([ch.length.reshape(()) for ch in chans]).to(torch.int64)
        vals = args[0].to(old.dtype)
        B, C = old.shape
        M = vals.shape[1]
        cnt = torch.full((B,), M, dtype=torch.int64, device=dev) if len(args) == 1 else args[1].clamp(0, M)
        j = torch.arange(C, device=dev).unsqueeze(0)
        src = j - old_len.unsqueeze(1) if op.name == "put" else j.expand(B, C)
        take = (src >= 0) & (src < cnt.unsqueeze(1))
        if M:
            new = torch.where(take, vals.gather(1, src.clamp(0, M - 1)), old)
        else:
            new = old.clone()
        total = old_len + cnt if op.name == "put" else cnt
        return new, total.clamp(max=C), total > C


_cache: "OrderedDict[str, Program]" = OrderedDict()
_lock = threading.Lock()


def compile_program(text: str) -> Program:
    """Validate epilogue JSON text and return its Program (cached by sha256 of canonical JSON).

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
    prog = Program(check(obj), digest, ir.canonical(obj))
    with _lock:
        _cache[digest] = prog
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return prog
