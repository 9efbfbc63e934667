"""Binds every WIT import of the pie:inferlet world to the engine, for one inferlet instance.

Handles are integers into this instance's table; they are never reused, so a released
handle answers `bad-handle`. Host functions return WIT result errors for PieErrors. Any
other exception is a host bug: it is described in `fatal` and re-raised as a WasmtimeError,
which traps only this instance (raising a plain Python exception would go through wasmtime-py's
module-global LAST_EXCEPTION and could surface in another instance).

wasmtime-py keeps every host function in a module-global table until the store that uses
it is dropped, so nothing the functions reach may reach the store: they reach the instance
through a `_Link` that `release_all` cuts, and kept errors carry no traceback (whose frames
would hold the store).
"""

from __future__ import annotations

import ctypes
import itertools
import math
import threading
import time
import traceback
from concurrent.futures import InvalidStateError
from typing import Callable

import wasmtime
from wasmtime import _bindings, _ffi as ffi
from wasmtime.component import Linker, Record, Variant

from ..engine import Engine, Fold, Pass, WorkingSet
from ..engine.loop import DeviceLoop, LoopStats
from ..engine.pages import Quota
from ..errors import InvalidArgument, BadHandle, Internal, PieError, detached
from .channels import Channel
from .detok import Detokenizer
from .errors import BudgetExceeded, Cancelled, ChannelClosed, Unsupported
from .grammars import GrammarCalls
from ..grammar import Matcher
from .imports import PACKAGE as WIT_PACKAGE, VERSION, declared, error_codes
from .limits import Limits, flag
from .sampling import Sampler, greedy
from .wasmtime_threads import install as _install_per_thread_lowering

# The guest's CPU-time budget reads its own thread's CPU clock: the guest runs on the instance's
# thread, so time it sleeps (WASI clocks) or waits for a core under load is not charged
_guest_clock = time.thread_time

_install_per_thread_lowering()

PACKAGE = f"{WIT_PACKAGE}/{{}}@{VERSION}"
_RESULTS = {f"{i}.{n}": r for i, funcs in declared().items() for n, (_, r) in funcs.items()}
# host functions whose WIT type has no result<_, error>: a PieError there ends the instance
NO_ERROR_RESULT = {n for n, r in _RESULTS.items() if r is None or r[0] != "result"}
# results whose ok and err payloads are both records: wasmtime-py lowers them to one Python
# class, so it needs an explicit Variant('ok'|'err', ...)
TAGGED = {n for n, r in _RESULTS.items() if r and r[0] == "result" and all(isinstance(x, tuple) and x[0] == "record"
                                                                             for x in r[1:])}
WIT_ERROR_CODES = set(error_codes())  # what a guest may be told; any other code reads "internal"


def _record(**fields) -> Record:
    rec = Record()
    for name, value in fields.items():
        setattr(rec, name.replace("_", "-"), value)
    return rec


def error_record(e: PieError) -> Record:
    code = e.code if e.code in WIT_ERROR_CODES else "internal"
    return _record(code=code, message=str(e))


# Argument checks. wasmtime-py lowers arguments by the types the component declared, which
# it does not compare with ours: a host function sees whatever Python values they give.
def _int(v, what: str, bits: int) -> int:
    if type(v) is not int or not 0 <= v < 1 << bits:
        raise InvalidArgument(f"{what} must be a u{bits}, not {_show(v)}")
    return v


def _u32(v, what: str) -> int:
    return _int(v, what, 32)


def _u64(v, what: str) -> int:
    return _int(v, what, 64)


def _str(v, what: str) -> str:
    if type(v) is not str:
        raise InvalidArgument(f"{what} must be a string, not {_show(v)}")
    return v


def _list(v, what: str, check: Callable) -> list:
    if type(v) is not list:
        raise InvalidArgument(f"{what} must be a list, not {_show(v)}")
    for x in v:
        check(x, f"an element of {what}")
    return v


def _field(rec, name: str, what: str):
    if not isinstance(rec, Record) or not hasattr(rec, name):
        raise InvalidArgument(f"{what} must be a record with field {name!r}, not {_show(rec)}")
    return getattr(rec, name)


def _case(v, what: str, cases: tuple) -> Variant:
    if not isinstance(v, Variant) or v.tag not in cases:
        raise InvalidArgument(f"{what} must be one of the cases {', '.join(cases)}, not {_show(v)}")
    return v


def _show(v) -> str:
    return f"{type(v).__name__} {v!r}"[:80]


# a channel's element type -> the Python type of its cells, as wasmtime-py lifts them
CELL_TYPES = {"uint32": int, "int32": int, "float32": float, "boolean": bool}


class InstanceHost:
    """The host side of one running inferlet: its handle table, output and counters."""

    def __init__(self, engine: Engine, scheduler, args: list[str], cpu_time_s: float, epoch_tick_s: float,
                 on_text: Callable[[str], None] | None = None, kv_quota: Quota | None = None,
                 limits: Limits | None = None):
        self.engine = engine
        self.limits = limits or Limits()
        self.cells = 0  # of the live channels
        self.output = 0  # bytes of output text and token ids (Limits.output_bytes)
        self.scheduler = scheduler
        self.args = list(args)
        self.on_text = on_text
        self.kv_quota = kv_quota  # the pages this instance's working sets may hold; None: the whole pool
        self.cpu_time_s = cpu_time_s
        self.epoch_tick_s = epoch_tick_s
        self.handles: dict[int, object] = {}
        self._next_handle = 1
        self.fatal: str | None = None  # why the host ended the instance: "code: message"
        self.fatal_trace = ""  # the traceback of a host bug, added to the run's log
        self._link = _Link()
        # output
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self._detok = Detokenizer(engine.tokenizer)
        self._held: list[int] = []  # ids not yet detokenised: with no on_text, nobody reads text mid-run
        self._out_lock = threading.Lock()
        # counters (the host's, not the guest's)
        self.guest_calls = 0
        self.passes = 0
        self.draft_stats = LoopStats()
        self.loops: list[DeviceLoop] = []
        self.guest_time_s = 0.0
        self.loop_time_s = 0.0  # running time of the device loops, charged to the CPU-time budget
        self._last_exit = 0.0  # the guest's thread clock, set on its thread (watch_epochs)
        self._epoch_key = None

    # ---- handles ---------------------------------------------------------------------
    def _add(self, obj) -> int:
        h = self._next_handle
        self._next_handle += 1
        self.handles[h] = obj
        return h

    def _new(self, make: Callable[[], object]) -> int:
        """A handle for make()'s object, made only if the handle budget has room."""
        if len(self.handles) >= self.limits.handles:
            raise BudgetExceeded(f"the inferlet holds {len(self.handles)} handles, its limit "
                                 f"({flag('handles')}); release some first")
        return self._add(make())

    def _get(self, h: int, kind: type, what: str):
        obj = self.handles.get(h) if type(h) is int else None
        if not isinstance(obj, kind):
            raise BadHandle(f"{what} handle {h} is unknown or was released")
        return obj

    def release_all(self) -> None:
        """Free everything the instance still holds: loops, KV pages, channel buffers, samplers,
        and the host functions' way to it (see `_Link`)."""
        self._link.fns.clear()
        _EPOCH_LINKS.pop(self._epoch_key, None)
        self.stop_loops()
        for obj in self.handles.values():
            if isinstance(obj, WorkingSet):
                self.engine.release(obj)
            elif isinstance(obj, Channel):
                obj.close()
                obj.sink = None
        self.handles.clear()
        self.loops.clear()
        self.cells = 0

    # ---- time: the CPU-time budget and cancellation -----------------------------------------
    def cpu_used(self) -> float:
        return self.guest_time_s + self.loop_time_s

    def _over_cpu(self) -> bool:
        """Past the CPU-time budget: the instance is marked to end (fatal)."""
        if self.fatal is None and self.cpu_used() >= self.cpu_time_s:
            self.fatal = f"the inferlet exceeded its CPU-time limit of {self.cpu_time_s:g} s and was stopped"
        return self.fatal is not None

    def cancel(self, reason: str) -> None:
        """End the instance from any thread: its loops stop now, the guest at its next host call
        or epoch check; its pages are freed when its run returns (release_all)."""
        if self.fatal is None:
            self.fatal = f"{Cancelled.code}: {reason}"
        self.stop_loops(lambda: Cancelled(reason))

    def watch_epochs(self, store: wasmtime.Store) -> None:
        """Check the CPU-time budget and cancellation every EPOCH_SLICE ticks of guest execution."""
        self._epoch_key = next(_EPOCH_KEYS)
        _EPOCH_LINKS[self._epoch_key] = self._link
        self._link.fns["epoch"] = self._on_epoch
        # no finalizer: release_all forgets the key (a C callback at store drop could run at shutdown)
        ffi.wasmtime_store_epoch_deadline_callback(store.ptr(), _on_deadline, self._epoch_key, _NO_FINALIZER)
        store.set_epoch_deadline(1)
        self.start_guest_clock()  # guest time starts here, not when the component was compiled

    def start_guest_clock(self) -> None:
        """Called on the instance's thread right before the guest's `run`: guest time counts from here."""
        self._last_exit = _guest_clock()

    def _on_epoch(self) -> int | str:
        """Ticks until the next check, or why the guest must stop (wasmtime traps with it)."""
        now = _guest_clock()
        self.guest_time_s += now - self._last_exit
        self._last_exit = now
        if self._over_cpu():
            return self.fatal
        return self._ticks_left()

    def _ticks_left(self) -> int:
        if self.fatal is not None:
            return 0
        left = math.ceil((self.cpu_time_s - self.cpu_used()) / self.epoch_tick_s)
        return max(0, min(EPOCH_SLICE, left))

    # ---- the call wrapper ----------------------------------------------------------------
    def _host(self, name: str, fn: Callable, tagged: bool = False) -> Callable:
        """Wrap `fn` as the host function `name`: count the call, map errors, keep the CPU-time budget.
        tagged: see TAGGED."""
        def host(store, *args):
            enter = _guest_clock()
            self.guest_time_s += enter - self._last_exit
            self.guest_calls += 1
            try:
                if self._over_cpu():  # cancelled, or past its CPU time (its loops charge it)
                    raise wasmtime.WasmtimeError(self.fatal)
                value = fn(*args)
                return Variant("ok", value) if tagged else value
            except PieError as e:
                rec = error_record(e)
                detached(e)  # it may be kept (a loop's error): its frames hold the store
                if tagged:
                    return Variant("err", rec)
                if name in NO_ERROR_RESULT:  # the WIT gives it no error to report: the instance ends
                    self.fatal = f"{e.code}: {name}: {e}"
                    raise wasmtime.WasmtimeError(self.fatal) from None
                return rec
            except wasmtime.WasmtimeError:
                raise
            except Exception as e:  # a host bug: end this instance only
                self.fatal = f"{Internal.code}: host function {name!r} failed: {type(e).__name__}: {e}"
                self.fatal_trace = traceback.format_exc()
                raise wasmtime.WasmtimeError(self.fatal) from None
            finally:
                self._last_exit = _guest_clock()
                # the CPU-time budget counts guest execution (and loops), not time blocked in the host
                ffi.wasmtime_context_set_epoch_deadline(store._context(), self._ticks_left())

        return self._link.add(name, host)

    def link(self, linker: Linker) -> None:
        with linker.root() as root:
            for iface, funcs in self.functions().items():
                with root.add_instance(PACKAGE.format(iface)) as i:
                    for name, fn in funcs.items():
                        i.add_func(name, self._host(f"{iface}.{name}", fn, tagged=f"{iface}.{name}" in TAGGED))

    def functions(self) -> dict[str, dict[str, Callable]]:
        """The WIT imports this host implements, by interface and name."""
        return {
            "runtime": {
                "get-arguments": lambda: list(self.args),
                "get-model-info": self.model_info,
                "send": self.send,
                "emit": self.emit,
                "emit-channel": self.emit_channel,
            },
            "tokenizer": {
                "encode": self.encode,
                "decode": self.decode,
                "apply-chat-template": self.apply_chat_template,
            },
            "working-sets": {
                "create": lambda: self._new(lambda: self.engine.new_working_set(self.kv_quota)),
                "frozen-length": lambda ws: self._ws(ws).frozen,
                "tokens": lambda ws: list(self._ws(ws).tokens),
                "fork": lambda ws: self._new(lambda: self.engine.fork(self._ws(ws))),
                "truncate": lambda ws, n: self.engine.truncate(self._ws(ws), _u32(n, "length")),
                "evict": lambda ws, s, e: self.engine.evict(self._ws(ws), _u32(s, "start"), _u32(e, "end")),
                "commit": self.commit,
                "release": self.release_ws,
            },
            "channels": {
                "create": self.create_channel,
                "put": self._put,
                "read": lambda ch, s, n: self._cells(self._ch(ch), self._ch(ch).read(_u32(s, "start"), _u32(n, "count"))),
                "take": lambda ch: self._cells(self._ch(ch), self._ch(ch).take()),
                "len": lambda ch: len(self._ch(ch)),
                "close": lambda ch: self._ch(ch).close(),
                "release": self.release_channel,
            },
            "forward": {
                "create-sampler": self.create_sampler,
                "release-sampler": self.release_sampler,
                "execute": self.execute,
                "register-epilogue": self.register_epilogue,
                "release-epilogue": self.release_epilogue,
                "run-loop": self.run_loop,
            },
            "grammars": GrammarCalls(self, _Registered).functions(),
        }

    # ---- runtime -----------------------------------------------------------------------
    def model_info(self) -> Record:
        info = self.engine.info
        return _record(name=info.name, vocab_size=info.vocab_size, eos_ids=list(info.eos_ids),
                       context_length=info.context_len, drafters=list(info.drafters))

    def _charge_output(self, n: int, what: str) -> None:
        """Refuse output past Limits.output_bytes (decoded text is counted after the fact)."""
        if self.output + n > self.limits.output_bytes:
            raise BudgetExceeded(f"{what} would take the run's output past its limit of "
                                 f"{self.limits.output_bytes} bytes ({flag('output_bytes')})")

    def _stream(self, text: str) -> None:
        if text:
            self.output += len(text.encode("utf-8", "replace"))
            self.text_parts.append(text)
            if self.on_text is not None:
                self.on_text(text)

    def send(self, text: str) -> None:
        _str(text, "text")
        with self._out_lock:
            self._charge_output(len(text.encode("utf-8", "replace")), "send")
            self._release_held()  # text keeps its place among the emitted tokens
            self._stream(text)

    def _emit_ids(self, ids: list[int]) -> None:
        """Record committed ids (call with _out_lock held). Their text is decoded at once for a
        streaming client, else when it is next needed: one round of a device loop then costs a
        list extend instead of a detokeniser step on the compute thread."""
        self._charge_output(4 * len(ids), f"{len(ids)} token ids")
        self.output += 4 * len(ids)
        self.token_ids.extend(ids)
        if self.on_text is None:
            self._held.extend(ids)
        else:
            self._stream(self._detok.push(ids))

    def _release_held(self) -> None:
        if self._held:
            held, self._held = self._held, []
            self._stream(self._detok.push(held))

    def emit(self, tokens: list[int]) -> None:
        self.engine.check_ids(_list(tokens, "tokens", _u32))
        with self._out_lock:
            self._emit_ids(tokens)

    def emit_channel(self, h: int) -> None:
        ch = self._ch(h)
        if ch.element not in ("uint32", "int32"):
            raise InvalidArgument(f"only a u32 or i32 channel holds token ids, not {ch.element}")

        def sink(cells: list[int]) -> None:  # called by the compute thread after each round
            self.engine.check_ids(cells)  # the epilogue wrote them: a bad id ends the loop, unrecorded
            with self._out_lock:
                self._emit_ids(cells)
        ch.sink = sink

    def finish_output(self) -> None:
        with self._out_lock:
            self._release_held()
            self._stream(self._detok.finish())

    @property
    def text(self) -> str:
        with self._out_lock:
            self._release_held()
            return "".join(self.text_parts)

    # ---- tokenizer ----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        _str(text, "text")
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, tokens: list[int]) -> str:
        self.engine.check_ids(_list(tokens, "tokens", _u32))
        return self.engine.tokenizer.decode(tokens, skip_special_tokens=False)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool) -> str:
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise Unsupported(f"model {self.engine.info.name} has no chat template")
        if type(add_generation_prompt) is not bool:
            raise InvalidArgument(f"add-generation-prompt must be a bool, not {_show(add_generation_prompt)}")
        msgs = [{"role": _str(_field(m, "role", "a message"), "a message's role"),
                 "content": _str(_field(m, "content", "a message"), "a message's content")}
                for m in _list(messages, "messages", lambda m, what: m)]
        try:
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja raises its own exceptions for messages it rejects
            raise InvalidArgument(f"the chat template rejected the messages: {e}") from None

    # ---- working sets, channels, samplers -------------------------------------------------------
    def _ws(self, h: int) -> WorkingSet:
        return self._get(h, WorkingSet, "working-set")

    def release_ws(self, h: int) -> None:
        self.engine.release(self._ws(h))
        del self.handles[h]

    def _ch(self, h: int) -> Channel:
        return self._get(h, Channel, "channel")

    def create_channel(self, element: str, capacity: int) -> int:
        _str(element, "element")
        if self.cells + _u32(capacity, "capacity") > self.limits.channel_cells:
            raise BudgetExceeded(f"a channel of {capacity} cells does not fit: the inferlet's channels hold "
                                 f"{self.cells} of its {self.limits.channel_cells} cells ({flag('channel_cells')}); "
                                 f"release one first")
        h = self._new(lambda: Channel(element, capacity, self.engine.device))
        self.cells += capacity
        return h

    def _put(self, h: int, cells: Variant) -> None:
        ch = self._ch(h)
        _case(cells, "cells", tuple(CELL_TYPES))
        if cells.tag != ch.element:
            raise InvalidArgument(f"cells of type {cells.tag} put into a {ch.element} channel")
        cell = CELL_TYPES[ch.element]

        def check(v, what):
            if type(v) is not cell:
                raise InvalidArgument(f"{what} must be a {cell.__name__}, not {_show(v)}")
        ch.put(_list(cells.payload, "cells", check))

    @staticmethod
    def _cells(ch: Channel, values: list) -> Variant:
        return Variant(ch.element, values)

    def release_channel(self, h: int) -> None:
        ch = self._ch(h)
        ch.close()
        del self.handles[h]
        self.cells -= ch.capacity

    def create_sampler(self, temperature: float, top_p: float, seed: int) -> int:
        for v, what in ((temperature, "temperature"), (top_p, "top-p")):
            if type(v) is not float:
                raise InvalidArgument(f"{what} must be an f32, not {_show(v)}")
        _u64(seed, "seed")
        return self._new(lambda: Sampler(temperature, top_p, seed))

    def release_sampler(self, h: int) -> None:
        self._get(h, Sampler, "sampler")
        del self.handles[h]

    # ---- forward passes ------------------------------------------------------------------
    def _pass(self, p: Record, rounds: int | None) -> tuple[Pass | DeviceLoop, Variant]:
        """A plain Pass, or a DeviceLoop when the pass reads a channel or names an epilogue."""
        ws = self._ws(_field(p, "ws", "the pass"))
        embed = _field(p, "embed", "the pass")
        geometry = _field(p, "geometry", "the pass")
        readout = _field(p, "readout", "the pass")
        call = _field(p, "epilogue", "the pass")
        fold = _case(_field(geometry, "fold", "geometry"), "fold", ("all", "constant", "from-channel", "from-epilogue"))
        kind = _case(_field(readout, "kind", "readout"), "readout kind", ("none", "argmax", "sample", "logits"))
        window = _u32(_field(geometry, "window", "geometry"), "geometry window")
        rows = list(_list(_field(readout, "rows", "readout"), "readout rows", _u32))
        if fold.tag == "constant":
            _u32(fold.payload, "fold constant")
        if kind.tag == "sample":
            self._get(kind.payload, Sampler, "sampler")
        if fold.tag == "from-epilogue" and call is None:
            raise InvalidArgument("fold from-epilogue needs the pass to name an epilogue")
        # embed's cases lower to different classes (list / int), so wasmtime-py gives the payload
        from_channel = not isinstance(embed, list)
        if not from_channel:
            _list(embed, "embed tokens", _u32)
            if window != len(embed):
                raise InvalidArgument(f"geometry window {window} differs from the {len(embed)} embedded tokens")
            # the engine validates the ids (once) when it takes the pass
        if rounds is None and not from_channel and fold.tag != "from-channel" and call is None:
            self._check_readout_rows(rows)
            return Pass(ws, embed, rows, fold=Fold.ALL if fold.tag == "all" else fold.payload), kind
        if kind.tag != "none":
            raise InvalidArgument("a pass that runs an epilogue or reads a channel takes readout kind `none`; "
                                  "its epilogue consumes the outputs")
        if window < 1:
            raise InvalidArgument("a pass needs a window of at least one row")
        bad = [r for r in rows if r >= window]
        if bad:
            raise InvalidArgument(f"readout row {bad[0]} is outside the window of {window} rows")
        if from_channel:
            src = self._ch(embed)
            if src.element not in ("uint32", "int32"):
                raise InvalidArgument(f"a window is embedded from a u32 or i32 channel, not {src.element}")
        else:  # literal tokens feed the first round through a private channel
            src = Channel("uint32", window, self.engine.device)
            src.put(embed)
        program, channels, matchers, seed = None, {}, {}, 0
        if call is not None:
            program, channels, matchers = self._get(_field(call, "program", "epilogue call"), _Registered, "epilogue").bound()
            seed = _u64(_field(call, "seed", "epilogue call"), "seed")
        # each readout row costs a logits row, unless the pass's epilogue reads no logits (a draft
        # head's prompt pass reads hidden states only: a row of the hidden size)
        if program is None or program.reads_logits:
            self._check_readout_rows(rows)
        fold_channel = None
        if fold.tag == "from-channel":
            fold_channel = self._ch(fold.payload)
            if fold_channel.element not in ("uint32", "int32"):
                raise InvalidArgument(f"a fold is read from a u32 or i32 channel, not {fold_channel.element}")
        elif fold.tag == "constant" and fold.payload > window:
            raise InvalidArgument(f"fold {fold.payload} is outside 0..{window} (the window length)")
        elif fold.tag == "from-epilogue" and not program.has_fold:
            raise InvalidArgument("fold from-epilogue, but the epilogue has no fold effect")
        # the loop records its rounds straight into the inferlet's draft statistics
        rule = {"all": Fold.ALL, "from-channel": Fold.CHANNEL, "from-epilogue": Fold.EPILOGUE}.get(fold.tag, fold.payload)
        drafters = self.engine.bind_drafters(program.checked.drafters, ws) if program is not None else {}
        loop = DeviceLoop(ws, program, channels, src, matchers=matchers, drafters=drafters, max_window=window, rounds=rounds or 1, readout=rows,
                          fold=rule, fold_channel=fold_channel, seed=seed, stats=self.draft_stats,
                          on_round=self._count_round, hidden=program is not None and "hidden" in program.uses)
        return loop, kind

    def _check_readout_rows(self, rows: list) -> None:
        if len(rows) > self.limits.readout_rows:
            raise BudgetExceeded(f"{len(rows)} readout rows in one pass, more than its limit of "
                                 f"{self.limits.readout_rows} ({flag('readout_rows')})")

    def _count_round(self, loop: DeviceLoop, window: int, fold: int, cost_s: float) -> None:
        """After each round, on the compute thread: the round's share of its step is charged to the
        CPU-time budget; past it, or cancelled, the loop ends."""
        self.passes += 1
        self.loop_time_s += cost_s
        if self._over_cpu():
            raise Cancelled(self.fatal)

    def execute(self, p: Record) -> Record:
        ps, kind = self._pass(p, None)
        if isinstance(ps, DeviceLoop):
            self._wait_loop(ps)
            return _record(tokens=[], logits=[], frozen=ps.ws.frozen)
        # tokens are chosen on the compute thread right after the model call (on this inferlet
        # thread a reduction over the vocabulary would also start a second OpenMP pool)
        if kind.tag == "argmax":
            ps.choose = greedy
        elif kind.tag == "sample":
            ps.choose = self.handles[kind.payload].sample
        out = self.scheduler.forward(ps)
        self.passes += 1
        if ps.fold is not Fold.ALL and ps.fold < ps.window:  # the guest decides the fold later (commit)
            self.draft_stats.drafted_window(ps.window)
        logits = out.logits.flatten().tolist() if kind.tag == "logits" else []
        return _record(tokens=out.tokens or [], logits=logits, frozen=ps.ws.frozen)

    def commit(self, h: int, rows: int) -> None:
        self.engine.freeze_scratch(self._ws(h), _u32(rows, "rows"))
        self.draft_stats.accepted_rows(rows)

    def _start(self, loop: DeviceLoop) -> None:
        chans = {id(c): c for c in loop.channels.values()}
        for ch in chans.values():
            ch.attach_producer()

        def ended(fut) -> None:
            err = fut.exception()
            for ch in chans.values():
                ch.detach_producer(err)
        loop.done.add_done_callback(ended)
        self.loops.append(loop)
        self.scheduler.start_loop(loop)

    def _wait_loop(self, loop: DeviceLoop) -> None:
        self._start(loop)
        loop.done.result()  # raises the pass's PieError

    def register_epilogue(self, program: str, bindings: list) -> int:
        from ..epilogue import compile_program

        chans = {}
        for b in _list(bindings, "channels", lambda b, what: b):
            name = _str(_field(b, "name", "a channel binding"), "a channel binding's name")
            if name in chans:
                raise InvalidArgument(f"channel {name!r} is bound twice")
            chans[name] = _field(b, "channel", "a channel binding")
            self._ch(chans[name])
        prog = compile_program(_str(program, "program"))
        for name, spec in prog.checked.channels.items():
            if name not in chans:
                raise InvalidArgument(f"the epilogue declares channel {name!r}, but no channel is bound to it")
            ch = self._ch(chans[name])
            if ch.capacity != spec.capacity:
                raise InvalidArgument(f"channel {name!r} has capacity {ch.capacity}; the epilogue declares {spec.capacity}")
            if (spec.dtype == "f32") != (ch.element == "float32") or (spec.dtype == "bool") != (ch.element == "boolean"):
                raise InvalidArgument(f"channel {name!r} holds {ch.element}; the epilogue declares {spec.dtype}")
        extra = set(chans) - set(prog.checked.channels)
        if extra:
            raise InvalidArgument(f"channel {sorted(extra)[0]!r} is bound but the epilogue does not declare it")
        missing = [d for d in prog.checked.drafters if d not in self.engine.heads]
        if missing:
            have = ", ".join(self.engine.heads) or "none is attached"
            raise InvalidArgument(f"the epilogue uses drafter {missing[0]!r}, which the model does not have ({have}; "
                                  "attach one with `pie model import MODEL --drafter NAME`)")
        return self._new(lambda: _Registered(self, prog, chans))

    def release_epilogue(self, h: int) -> None:
        self._get(h, _Registered, "epilogue")
        del self.handles[h]

    def run_loop(self, p: Record, rounds: int) -> None:
        if _u32(rounds, "rounds") < 1:
            raise InvalidArgument("run-loop needs at least one round")
        loop, _ = self._pass(p, rounds)
        self._start(loop)

    def stop_loops(self, error: Callable[[], PieError] | None = None) -> None:
        """End this instance's loops (the instance is finishing, or cancelled); the scheduler drops them."""
        for loop in list(self.loops):  # cancel may come from another thread
            try:
                loop.finish(error() if error else ChannelClosed("the inferlet ended while its loop was running"))
            except InvalidStateError:  # the compute thread finished it meanwhile
                pass


# ---- the epoch callback: one C function for all stores, finding its instance by key -----------
EPOCH_SLICE = 10  # epoch ticks of guest execution between checks of the budget and cancellation
_EPOCH_KEYS = itertools.count(1)
_EPOCH_LINKS: dict[int, "_Link"] = {}  # popped when the instance is released
_DeadlineFn, _FinalizerFn = _bindings._wasmtime_store_epoch_deadline_callback.argtypes[1::2]
_NO_FINALIZER = _FinalizerFn()  # a NULL function pointer


@_DeadlineFn
def _on_deadline(ctx, data, delta, kind):
    try:
        link = _EPOCH_LINKS.get(data)
        check = link.fns.get("epoch") if link is not None else None
        out = check() if check is not None else "the instance has ended"
    except Exception as e:  # never raise through C
        out = f"{Internal.code}: the epoch check failed: {type(e).__name__}: {e}"
    if isinstance(out, str):  # trap with this message
        return ctypes.cast(ffi.wasmtime_error_new(out.encode("utf-8")), ctypes.c_void_p).value
    delta[0] = out
    kind[0] = 0  # WASMTIME_UPDATE_DEADLINE_CONTINUE
    return 0


class _Link:
    """The instance as wasmtime-py's global function table sees it: its host functions by
    name, looked up per call, and cleared when the instance ends."""

    def __init__(self):
        self.fns: dict[str, Callable] = {}

    def add(self, name: str, fn: Callable) -> Callable:
        fns = self.fns
        fns[name] = fn

        def call(store, *args):
            f = fns.get(name)
            if f is None:
                raise wasmtime.WasmtimeError(f"{name}: the instance has ended")
            return f(store, *args)
        return call


class _Registered:
    """A registered epilogue: the compiled program, its channel handles and its matcher handles
    (grammars.bind-matcher)."""

    def __init__(self, host: InstanceHost, program, channels: dict[str, int]):
        self.host = host
        self.program = program
        self.channels = channels
        self.matchers: dict[str, int] = {}

    def bound(self):
        missing = [m for m in self.program.checked.matchers if m not in self.matchers]
        if missing:
            raise InvalidArgument(f"the epilogue declares matcher {missing[0]!r}, but no matcher is bound to it "
                                  f"(grammars.bind-matcher)")
        matchers = {name: self.host._get(h, Matcher, "matcher") for name, h in self.matchers.items()}
        return self.program, {name: self.host._ch(h) for name, h in self.channels.items()}, matchers
