"""compile_program: JSON text -> validated, cached Program that runs on device tensors.

Executing a program never syncs with the host: shapes (host metadata), seeds and
round indices (host ints) are all the host needs; every data-dependent length
stays a device tensor. The caller reads fold/stop/lengths back once per batch.
On the CPU there is no device to wait for, so scalar results move to the host as
they are made and the integer arithmetic after them runs in Python (HOST_READABLE).
There a program whose every op works on host values also has a plan (hostplan.py): the
same program as one generated Python function, which a single pass runs instead of the
op-by-op interpreter below.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from host.epilogue import hostplan, ir, kernels
from host.epilogue.env import ChannelWrite, Env, Result, host_length
from host.epilogue.ir import ProgramError
from host.epilogue.ops import OPS
from host.epilogue.ops.construct import measured
from host.epilogue.ops.layout import slice_len
from host.epilogue.ops.speculative import ngram_lookup_host
from host.epilogue.validate import Budget, Checked, check

_CACHE_SIZE = 256
_CONSTS_MAX = 512  # shape-only values kept per program (history lengths vary)
_CONST_CACHE_BYTES = 64 << 10  # larger shape-only values are made each round, not kept
_SHAPE_ONLY = ("const", "full", "arange")  # size is a host value (see _run_batch)


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


class Program:
    """A validated epilogue. `run(envs)` executes it for several passes at once."""

    def __init__(self, checked: Checked, digest: str, text: str):
        self.checked = checked
        self.digest = digest
        self.text = text
        self._bind_ok: set = set()  # (symbols, their values) whose ops' shapes were checked
        self._binds_seen: set = set()  # values of every symbol, for bindings checked whole
        self._budget = Budget(checked)
        # (op index, device, batch, resolved shape) -> (values, host scalar or None), and cached
        # aranges: shape-only values are made once, not per round
        self._consts: dict = {}
        self.uses = {i.kind for i in checked.inputs}
        names = {o.name for o in checked.ops}
        self.has_fold = "fold" in names
        self.has_stop = "stop" in names
        self.writes = [o.attrs["channel"] for o in checked.ops if o.name in ("put", "set")]
        self.reads = sorted({i.channel for i in checked.inputs if i.channel})
        self._bound = sorted(set(self.reads) | set(self.writes))  # channels an env must bind
        self._tensors = [k for k in ("logits", "hidden", "draft_logits", "window", "history") if k in self.uses]
        self._by_syms: dict[tuple, list] = {}
        for op in checked.ops:
            self._by_syms.setdefault(self._op_syms(op), []).append(op)
        self._syms = tuple(sorted({x for syms in self._by_syms for x in syms}))
        # ops that may run on the host: scalar i64/bool results of simple integer ops
        self._kernel = [OPS[op.name].kernel for op in checked.ops]  # by op index
        self._host_fn = {op.index: OPS[op.name].host for op in checked.ops
                         if OPS[op.name].host is not None and len(op.outs) == 1
                         and not checked.values[op.outs[0]].shape
                         and checked.values[op.outs[0]].dtype in ("i64", "bool")}
        # shape-only ops whose result does not depend on the binding
        self._fixed = {op.index for op in checked.ops if op.name in _SHAPE_ONLY and not self._op_syms(op)}
        self._scalar_ints = {i for i, v in enumerate(checked.values) if not v.shape and v.dtype in ("i64", "bool")}
        # one pass in host memory: the whole program as one Python function, where every op allows
        self._plan = hostplan.build(checked, self._host_fn, self._scalar_ints, self._measured)

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
        for kind in self._tensors:
            if getattr(env, kind) is None:
                raise ProgramError(f"epilogue reads '{kind}' but the pass does not provide it")
        for name in self._bound:
            ch = env.channels.get(name)
            if ch is None:
                raise ProgramError(f"epilogue uses channel {name!r} but it is not bound")
            cap = self.checked.channels[name].capacity
            # a channel that states its capacity (a host int) is trusted to have that buffer
            got = getattr(ch, "capacity", None)
            if got != cap and ch.buf.shape != (cap,):
                raise ProgramError(f"channel {name!r} has capacity {tuple(ch.buf.shape)}; the epilogue declares {cap}")
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
            if self._plan is not None and not keep_values and host_readable(self._device(envs[0])):
                res = self._plan(envs[0], bind)
                if res is not None:
                    return [res]
            return self._run_batch(list(envs), bind, keep_values)
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
            for i, r in zip(idx, self._run_batch([envs[i] for i in idx], binds[idx[0]], keep_values)):
                out[i] = r
        return out  # type: ignore[return-value]

    def _device(self, env: Env) -> torch.device:
        for t in (env.logits, env.window, env.history, env.hidden, env.draft_logits):
            if t is not None:
                return _CPU if isinstance(t, np.ndarray) else t.device
        for ch in env.channels.values():
            return ch.buf.device
        return torch.device("cpu")

    def _run_batch(self, envs: list[Env], bind: dict[str, int], keep: bool) -> list[Result]:
        c = self.checked
        B = len(envs)
        dev = self._device(envs[0])
        ctx = kernels.Ctx(B, dev, bind, [e.seed for e in envs], [e.round for e in envs], c.values)
        # Scalar i64/bool values the host knows (the round, channel lengths, constants, sizes and
        # integer arithmetic on them) are computed in Python, per pass: a tensor is made only when
        # a device op needs one, so a stop test on the round, say, costs no device op at all.
        host: dict[int, list] = {}
        # In host memory a value may be held as a numpy array instead: one pass's float readouts
        # are read as arrays and ops with a numpy kernel (argmax) keep them so; a tensor is made
        # from an array only when a torch kernel needs one (a greedy round then makes none).
        hoist = host_readable(dev)
        arrays: dict[int, np.ndarray] = {}
        vals: list[torch.Tensor | None] = []
        for i, inp in enumerate(c.inputs):
            if inp.kind == "round":
                host[i] = [e.round for e in envs]
            elif inp.kind == "channel_len":
                host[i] = [host_length(e.channels[inp.channel]) for e in envs]
            elif hoist and B == 1 and inp.kind in hostplan.READOUTS:
                a = hostplan.host_array(getattr(envs[0], inp.kind))
                if a is not None:
                    arrays[i] = a[None]
            vals.append(None if i in host or i in arrays else self._input(inp, envs, dev))

        def tensor(i: int) -> torch.Tensor:
            if vals[i] is None:
                a = arrays.get(i)
                vals[i] = torch.from_numpy(a) if a is not None else \
                    torch.tensor(host[i], dtype=kernels.TORCH_DTYPE[c.values[i].dtype], device=dev)
            return vals[i]

        def array(i: int):
            a = arrays.get(i)
            if a is None:
                a = arrays[i] = tensor(i).numpy()
            return a

        fold = stop = None
        writes: dict[str, list] = {}
        blank: set[int] = set()  # values the host knows are all padding (-1)
        host_fn = self._host_fn
        for op in c.ops:
            f = host_fn.get(op.index)
            if f is not None and B == 1:  # the common case first: one pass, operands on the host
                try:
                    host[len(vals)] = [f(*[host[a][0] for a in op.args])]
                    vals.append(None)
                    continue
                except KeyError:  # a device operand: the general path below
                    pass
            if op.name == "fold":
                W = bind["W"]
                fold = [min(max(v, 0), W) for v in host[op.args[0]]] if op.args[0] in host \
                    else tensor(op.args[0]).clamp(0, W)
            elif op.name == "stop":
                stop = host[op.args[0]] if op.args[0] in host else tensor(op.args[0])
            elif op.name in ("put", "set"):
                cnt = op.args[1] if len(op.args) > 1 else None
                src = array(op.args[0]) if hoist else None
                writes[op.attrs["channel"]] = self._write(
                    op, host[cnt] if cnt in host else None if cnt is None else tensor(cnt), envs,
                    src, tensor(op.args[0]) if src is None else None)
            elif op.name == "size":  # i64 []
                # a history length changes every round: keep it on the host, a tensor only on demand
                host[len(vals)] = [self._measured(op, bind)] * B
                vals.append(None)
            elif op.name in _SHAPE_ONLY:  # depends on nothing but the binding: made once per shape
                key = (op.index, dev, B) if op.index in self._fixed else \
                    (op.index, dev, B, self._shape_key(op, bind))
                got = self._consts.get(key)
                if got is None:
                    if len(self._consts) > _CONSTS_MAX:
                        self._consts.clear()
                    got = (self._kernel[op.index](ctx, op, []), self._host_const(op))
                    if got[0][0].untyped_storage().nbytes() <= _CONST_CACHE_BYTES:  # a cached program keeps it
                        self._consts[key] = got
                if got[1] is not None:
                    host[len(vals)] = [got[1]] * B
                vals.extend(got[0])
            elif op.name == "dyn_slice" and op.args[1] in host:
                ln = host.get(op.args[2])
                out, empty = self._dyn_slice(op, tensor(op.args[0]), host[op.args[1]],
                                             ln if ln is not None else tensor(op.args[2]))
                if empty and kernels.fill_of(op, c.values[op.outs[0]].dtype) < 0:
                    blank.add(len(vals))
                vals.append(out)
            elif op.name == "lru_update" and op.args[2] in blank:
                # every token of seq is padding: no leader qualifies, the table is unchanged
                vals.extend([tensor(op.args[0]), tensor(op.args[1])])
            elif op.name == "pack" and op.args[1] in host:
                yl = host.get(op.args[3])
                vals.append(self._pack(op, tensor(op.args[0]), host[op.args[1]], tensor(op.args[2]),
                                       yl if yl is not None else tensor(op.args[3])))
            elif op.name == "ngram_lookup" and hoist and (len(op.args) == 1 or op.args[1] in host):
                at = op.attrs
                toks, counts = ngram_lookup_host(tensor(op.args[0]), host[op.args[1]] if len(op.args) == 2 else None,
                                                 at["ngram_min"], at["ngram_max"], at["k"])
                host[len(vals) + 1] = counts
                vals.extend([toks, None])
            elif op.name == "index" and hoist and op.outs[0] in self._scalar_ints \
                    and (op.args[0] in arrays or vals[op.args[0]] is not None) and array(op.args[0]).ndim == 2:
                x, i = array(op.args[0]), op.attrs["i"]  # a scalar read from host memory: no select, no tolist
                host[len(vals)] = [x.item(b, i) for b in range(B)]
                vals.append(None)
            elif op.name == "argmax" and op.args[0] in arrays:  # numpy's, as kernels.argmax on the CPU
                x = arrays[op.args[0]]
                out = arrays[len(vals)] = kernels.argmax_np(x, op.attrs["axis"] + 1)
                if op.outs[0] in self._scalar_ints:
                    host[len(vals)] = out.tolist()
                vals.append(None)
            elif f is not None and (r := self._on_host(op, host, B)) is not None:
                if r[0] == "host":
                    host[len(vals)] = r[1]
                    vals.append(None)
                else:  # the op is the identity on one device operand (x | False, x & True)
                    vals.append(tensor(r[1]))
            else:
                outs = self._kernel[op.index](ctx, op, [tensor(a) for a in op.args])
                if hoist:
                    for o, t in zip(op.outs, outs):
                        if o in self._scalar_ints:
                            host[o] = t.tolist()
                vals.extend(outs)
        results = []
        for b in range(B):
            r = Result(fold=None if fold is None else fold[b], stop=None if stop is None else stop[b])
            for name, per_env in writes.items():
                length, overflow = per_env[b]
                r.channels[name] = ChannelWrite(envs[b].channels[name].buf, length, overflow)
            if keep:
                r.values = [tensor(i)[b] for i in range(len(vals))]
            results.append(r)
        return results

    # dyn_slice and pack with host-known offsets: copies of contiguous runs, no index tensors
    def _filled(self, op, x: torch.Tensor) -> torch.Tensor:
        fill = kernels.fill_of(op, self.checked.values[op.outs[0]].dtype)
        return torch.full((x.shape[0], op.attrs["size"]), fill, dtype=x.dtype, device=x.device)

    def _dyn_slice(self, op, x: torch.Tensor, starts: list, lengths) -> tuple[torch.Tensor, bool]:
        """Returns the slice and whether it is all fill (the host knows then, whatever the length)."""
        out, n, size = self._filled(op, x), x.shape[1], op.attrs["size"]
        empty = True
        for b, st in enumerate(starts):
            ln = lengths[b] if isinstance(lengths, list) else size
            j0, j1 = max(0, -st), min(size, ln, n - st)
            if j1 <= j0:
                continue
            empty = False
            if isinstance(lengths, list):
                out[b, j0:j1] = x[b, st + j0:st + j1]
            else:  # a device length: cells past it keep the fill
                keep = self._arange(size, x.device)[j0:j1] < lengths[b]
                out[b, j0:j1] = torch.where(keep, x[b, st + j0:st + j1], out[b, j0:j1])
        return out, empty

    def _pack(self, op, x: torch.Tensor, xl: list, y: torch.Tensor, yl) -> torch.Tensor:
        out, size = self._filled(op, x), op.attrs["size"]
        for b, la in enumerate(xl):
            a = min(max(la, 0), x.shape[1], size)
            out[b, :a] = x[b, :a]
            m = min(y.shape[1], size - a)
            if isinstance(yl, list):
                m = min(m, max(yl[b], 0))
                out[b, a:a + m] = y[b, :m]
            elif m > 0:  # a device length: cells past it keep the fill
                keep = self._arange(m, y.device) < yl[b]
                out[b, a:a + m] = torch.where(keep, y[b, :m], out[b, a:a + m])
        return out

    def _host_const(self, op):
        """The host value of a scalar i64/bool const, else None."""
        v = self.checked.values[op.outs[0]]
        if v.shape or v.dtype not in ("i64", "bool"):
            return None
        return op.attrs["value"] if op.name == "const" else None

    def _on_host(self, op, host: dict, B: int):
        """("host", per-pass values) when a scalar integer op's operands are all on the host;
        ("same", arg) when the op passes one device operand through unchanged; else None."""
        f = self._host_fn[op.index]
        known = [a in host for a in op.args]
        if all(known):
            return "host", [f(*xs) for xs in zip(*(host[a] for a in op.args))]
        if op.name in ("or", "and") and any(known):
            k, d = (op.args[0], op.args[1]) if known[0] else (op.args[1], op.args[0])
            vals = host[k]
            if not self.checked.values[d].shape and all(v == vals[0] for v in vals):
                if bool(vals[0]) == (op.name == "or"):
                    return "host", [bool(vals[0])] * B  # x | True, x & False
                return "same", d
        return None

    def _shape_key(self, op, bind: dict[str, int]) -> tuple:
        """What a shape-only op's result depends on: its resolved output shape."""
        return tuple(d.resolve(bind) for d in self.checked.values[op.outs[0]].shape)

    def _measured(self, op, bind: dict[str, int]) -> int:
        return measured(self.checked.values, op, bind)

    def _input(self, inp, envs: list[Env], dev) -> torch.Tensor:
        k = inp.kind  # round and channel_len are host values (see _run_batch)
        if k == "channel":
            dt = kernels.TORCH_DTYPE[self.checked.channels[inp.channel].dtype]
            bufs = [e.channels[inp.channel].buf for e in envs]
            if len(bufs) > 1:
                return torch.stack(bufs).to(dt)  # stack copies
            t = bufs[0].unsqueeze(0).to(dt)
            # the program writes this channel in place later on: read a copy of the old cells
            return t.clone() if inp.channel in self.writes and t.data_ptr() == bufs[0].data_ptr() else t
        ts = [getattr(e, k) for e in envs]
        ts = [torch.from_numpy(t) if isinstance(t, np.ndarray) else t for t in ts]  # readouts may be arrays
        t = torch.stack(ts) if len(ts) > 1 else ts[0].unsqueeze(0)
        want = torch.int64 if k in ("window", "history") else torch.float32
        return t if t.dtype == want else t.to(want)

    def _write(self, op, cnt, envs: list[Env], src: np.ndarray | None, vals: torch.Tensor | None) -> list[tuple]:
        """Write each env's channel in place; returns per env (length, overflow).
        The cells are src, a numpy array in host memory, or else vals, a tensor.

        Where a cell goes depends only on the channel's length at the start of the round, a
        host int, so a write without a count, or with a count the host knows (a list), is one
        copy and its new length is a host int; with a device count the cells past it keep their
        old contents (a select) and the new length stays on the device until the batch's readback."""
        M = (src if src is not None else vals).shape[1]
        name = op.attrs["channel"]
        C = self.checked.channels[name].capacity  # each env's buffer has it (_check_env)
        out = []
        for b, env in enumerate(envs):
            ch = env.channels[name]
            if src is not None and (cnt is None or isinstance(cnt, list)):  # host memory, host count
                out.append(hostplan.write_host(ch, op.name == "put", src[b], None if cnt is None else cnt[b], C))
                continue
            start = host_length(ch) if op.name == "put" else 0
            m = max(min(M, C - start), 0)  # cells that fit
            if cnt is None or isinstance(cnt, list):
                n = M if cnt is None else min(max(cnt[b], 0), M)
                k = min(n, m)
                if k:  # narrow/select: a few us cheaper each than tensor indexing
                    ch.buf.narrow(0, start, k).copy_(vals.select(0, b).narrow(0, 0, k))  # converts dtype
                out.append((start + k, n > m))
                continue
            vals = torch.from_numpy(src) if vals is None else vals
            dst = ch.buf[start:start + m]
            n = cnt[b].clamp(0, M)
            if m:
                keep = self._arange(m, ch.buf.device) < n
                dst.copy_(torch.where(keep, vals[b, :m].to(dst.dtype), dst))
            out.append((start + torch.clamp(n, max=m), n > m))
        return out

    def _arange(self, n: int, dev) -> torch.Tensor:
        key = ("arange", n, str(dev))
        t = self._consts.get(key)
        if t is None:
            t = self._consts[key] = torch.arange(n, device=dev)
        return t


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
