"""Binds every WIT import of the pie:inferlet world to the engine, for one inferlet instance.

Handles are integers into this instance's table; they are never reused, so a released
handle answers `bad-handle`. Host functions return WIT result errors for PieErrors. Any
other exception is a host bug: it is kept in `fatal` and re-raised as a WasmtimeError, which
traps only this instance (raising a plain Python exception would go through wasmtime-py's
module-global LAST_EXCEPTION and could surface in another instance).
"""

from __future__ import annotations

import math
import threading
import time
import traceback
from typing import Callable

import wasmtime
from wasmtime import _ffi as ffi
from wasmtime.component import Linker, Record, Variant

from ..engine import Engine, Pass, WorkingSet
from ..errors import InvalidArgument, BadHandle, PieError
from .channels import Channel
from .errors import Unsupported
from .sampling import Sampler, argmax

PACKAGE = "pie:inferlet/{}@0.1.0"
WIT_ERROR_CODES = {"invalid-argument", "bad-handle", "out-of-pages", "context-overflow", "channel-full",
                   "channel-closed", "unsupported", "internal"}


def _record(**fields) -> Record:
    rec = Record()
    for name, value in fields.items():
        setattr(rec, name.replace("_", "-"), value)
    return rec


def error_record(e: PieError) -> Record:
    code = e.code if e.code in WIT_ERROR_CODES else "internal"
    return _record(code=code, message=str(e))


class InstanceHost:
    """The host side of one running inferlet: its handle table, output and counters."""

    def __init__(self, engine: Engine, scheduler, args: list[str], cpu_time_s: float, epoch_tick_s: float,
                 on_text: Callable[[str], None] | None = None):
        self.engine = engine
        self.scheduler = scheduler
        self.args = list(args)
        self.on_text = on_text
        self.cpu_time_s = cpu_time_s
        self.epoch_tick_s = epoch_tick_s
        self.handles: dict[int, object] = {}
        self._next_handle = 1
        self.fatal: BaseException | None = None
        self.fatal_trace = ""
        # output
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        # incremental detokenization (as in vLLM): text of token_ids[_prefix:_read] is already
        # streamed; decoding from _prefix keeps a merge across the boundary (spaces, UTF-8) right
        self._prefix = 0
        self._read = 0
        self._out_lock = threading.Lock()
        # counters (the host's, not the guest's)
        self.guest_calls = 0
        self.passes = 0
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.guest_time_s = 0.0
        self._last_exit = time.perf_counter()

    # ---- handles ---------------------------------------------------------------------
    def _add(self, obj) -> int:
        h = self._next_handle
        self._next_handle += 1
        self.handles[h] = obj
        return h

    def _get(self, h: int, kind: type, what: str):
        obj = self.handles.get(h)
        if not isinstance(obj, kind):
            raise BadHandle(f"{what} handle {h} is unknown or was released")
        return obj

    def release_all(self) -> None:
        """Free everything the instance still holds: KV pages, channel buffers, samplers."""
        for obj in self.handles.values():
            if isinstance(obj, WorkingSet):
                self.engine.release(obj)
            elif isinstance(obj, Channel):
                obj.close()
        self.handles.clear()

    # ---- the call wrapper ----------------------------------------------------------------
    def _host(self, fn: Callable, tagged: bool = False) -> Callable:
        """Wrap `fn` as a host function: count the call, map errors, keep the CPU-time budget.

        tagged: the WIT result's ok and err payloads lower to the same Python class (both
        records), so wasmtime-py needs an explicit Variant('ok'|'err', ...).
        """
        tick = self.epoch_tick_s

        def host(store, *args):
            enter = time.perf_counter()
            self.guest_time_s += enter - self._last_exit
            self.guest_calls += 1
            try:
                value = fn(*args)
                return Variant("ok", value) if tagged else value
            except PieError as e:
                return Variant("err", error_record(e)) if tagged else error_record(e)
            except Exception as e:  # a host bug: end this instance only
                self.fatal = e
                self.fatal_trace = traceback.format_exc()
                raise wasmtime.WasmtimeError(f"host error: {type(e).__name__}: {e}") from None
            finally:
                self._last_exit = time.perf_counter()
                # the CPU-time budget counts guest execution only, not time blocked in the host
                left = self.cpu_time_s - self.guest_time_s
                ffi.wasmtime_context_set_epoch_deadline(store._context(), max(0, math.ceil(left / tick)))

        return host

    def link(self, linker: Linker) -> None:
        h = self._host
        with linker.root() as root:
            with root.add_instance(PACKAGE.format("runtime")) as i:
                i.add_func("get-arguments", h(lambda: list(self.args)))
                i.add_func("get-model-info", h(self.model_info))
                i.add_func("send", h(self.send))
                i.add_func("emit", h(self.emit))
            with root.add_instance(PACKAGE.format("tokenizer")) as i:
                i.add_func("encode", h(self.encode))
                i.add_func("decode", h(self.decode))
                i.add_func("apply-chat-template", h(self.apply_chat_template))
            with root.add_instance(PACKAGE.format("working-sets")) as i:
                i.add_func("create", h(lambda: self._add(self.engine.new_working_set())))
                i.add_func("frozen-length", h(lambda ws: self._ws(ws).frozen))
                i.add_func("tokens", h(lambda ws: list(self._ws(ws).tokens)))
                i.add_func("fork", h(lambda ws: self._add(self.engine.fork(self._ws(ws)))))
                i.add_func("truncate", h(lambda ws, n: self.engine.truncate(self._ws(ws), n)))
                i.add_func("evict", h(lambda ws, s, e: self.engine.evict(self._ws(ws), s, e)))
                i.add_func("release", h(self.release_ws))
            with root.add_instance(PACKAGE.format("channels")) as i:
                i.add_func("create", h(lambda el, cap: self._add(Channel(el, cap, self.engine.device))))
                i.add_func("put", h(lambda ch, cells: self._put(ch, cells)))
                i.add_func("read", h(lambda ch, s, n: self._cells(self._ch(ch), self._ch(ch).read(s, n))))
                i.add_func("take", h(lambda ch: self._cells(self._ch(ch), self._ch(ch).take())))
                i.add_func("len", h(lambda ch: len(self._ch(ch))))
                i.add_func("close", h(lambda ch: self._ch(ch).close()))
                i.add_func("release", h(self.release_channel))
            with root.add_instance(PACKAGE.format("forward")) as i:
                i.add_func("create-sampler", h(lambda t, p, seed: self._add(Sampler(t, p, seed))))
                i.add_func("release-sampler", h(self.release_sampler))
                i.add_func("execute", h(self.execute, tagged=True))
                i.add_func("register-epilogue", h(self.register_epilogue))
                i.add_func("release-epilogue", h(self.release_epilogue))
                i.add_func("run-loop", h(self.run_loop))

    # ---- runtime -----------------------------------------------------------------------
    def model_info(self) -> Record:
        info = self.engine.info
        return _record(name=info.name, vocab_size=info.vocab_size, eos_ids=list(info.eos_ids),
                       context_length=info.context_len, drafters=list(info.drafters))

    def _stream(self, text: str) -> None:
        if text:
            self.text_parts.append(text)
            if self.on_text is not None:
                self.on_text(text)

    def send(self, text: str) -> None:
        with self._out_lock:
            self._stream(text)

    def emit(self, tokens: list[int]) -> None:
        self._check_ids(tokens)
        with self._out_lock:
            self.token_ids.extend(tokens)
            self._stream_tokens(final=False)

    def _stream_tokens(self, final: bool) -> None:
        decode = self.engine.tokenizer.decode
        seen = decode(self.token_ids[self._prefix:self._read], skip_special_tokens=True)
        text = decode(self.token_ids[self._prefix:], skip_special_tokens=True)
        if len(text) > len(seen) and (final or not text.endswith("\ufffd")):  # else: an incomplete UTF-8 sequence
            self._stream(text[len(seen):])
            self._prefix, self._read = self._read, len(self.token_ids)

    def finish_output(self) -> None:
        with self._out_lock:
            if self.token_ids:
                self._stream_tokens(final=True)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    # ---- tokenizer ----------------------------------------------------------------------
    def _check_ids(self, tokens: list[int]) -> None:
        v = self.engine.info.vocab_size
        bad = [t for t in tokens if t >= v]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary [0, {v})")

    def encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, tokens: list[int]) -> str:
        self._check_ids(tokens)
        return self.engine.tokenizer.decode(tokens, skip_special_tokens=False)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool) -> str:
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise Unsupported(f"model {self.engine.info.name} has no chat template")
        msgs = [{"role": getattr(m, "role"), "content": getattr(m, "content")} for m in messages]
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

    def _put(self, h: int, cells: Variant) -> None:
        ch = self._ch(h)
        if cells.tag != ch.element:
            raise InvalidArgument(f"cells of type {cells.tag} put into a {ch.element} channel")
        ch.put(cells.payload)

    @staticmethod
    def _cells(ch: Channel, values: list) -> Variant:
        return Variant(ch.element, values)

    def release_channel(self, h: int) -> None:
        self._ch(h).close()
        del self.handles[h]

    def release_sampler(self, h: int) -> None:
        self._get(h, Sampler, "sampler")
        del self.handles[h]

    # ---- forward passes ------------------------------------------------------------------
    def _pass(self, p: Record) -> tuple[Pass, Variant]:
        ws = self._ws(getattr(p, "ws"))
        embed = getattr(p, "embed")
        geometry = getattr(p, "geometry")
        readout = getattr(p, "readout")
        epilogue = getattr(p, "epilogue")
        fold = getattr(geometry, "fold")
        kind = getattr(readout, "kind")
        # embed's cases lower to different classes (list / int), so wasmtime-py gives the payload
        if not isinstance(embed, list):
            self._ch(embed)
            raise Unsupported("embed from a channel needs the device loop, which this host version lacks")
        if fold.tag == "from-channel":
            self._ch(fold.payload)
            raise Unsupported("fold from a channel needs the device loop, which this host version lacks")
        if kind.tag == "sample":
            self._get(kind.payload, Sampler, "sampler")
        if epilogue is not None:
            self.release_epilogue(getattr(epilogue, "program"))  # answers bad-handle: none can exist yet
        if fold.tag == "from-epilogue":
            raise InvalidArgument("fold from-epilogue needs the pass to name an epilogue")
        window = getattr(geometry, "window")
        if window != len(embed):
            raise InvalidArgument(f"geometry window {window} differs from the {len(embed)} embedded tokens")
        self._check_ids(embed)
        n = None if fold.tag == "all" else fold.payload
        return Pass(ws, embed, list(getattr(readout, "rows")), fold=n), kind

    def execute(self, p: Record) -> Record:
        ps, kind = self._pass(p)
        out = self.scheduler.forward(ps)
        self.passes += 1
        tokens: list[int] = []
        logits: list[float] = []
        if kind.tag == "argmax":
            tokens = argmax(out.logits)
        elif kind.tag == "sample":
            tokens = self.handles[kind.payload].sample(out.logits)
        elif kind.tag == "logits":
            logits = out.logits.flatten().tolist()
        return _record(tokens=tokens, logits=logits, frozen=ps.ws.frozen)

    def register_epilogue(self, program: str, channels: list) -> int:
        for b in channels:
            self._ch(getattr(b, "channel"))
        raise Unsupported("epilogue programs are not available in this host version")

    def release_epilogue(self, h: int) -> None:
        raise BadHandle(f"epilogue handle {h} is unknown (no epilogue was registered)")

    def run_loop(self, p: Record, rounds: int) -> None:
        raise Unsupported("the device loop is not available in this host version")
