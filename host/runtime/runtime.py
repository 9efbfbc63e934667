"""The runtime: one wasmtime engine, a compiled-component cache, and one thread + store per inferlet.

Each instance gets its own Store (memory limit), a WASI context with no preopened
directories, no network, no environment and captured stdout/stderr, and a CPU-time budget
enforced by epoch interruption (a ticker thread advances the engine's epoch). Passes of all
instances go through one Scheduler, which batches them into shared model calls.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import wasmtime
from wasmtime.component import Linker

from ..engine import Engine
from ..engine.logprobs import TokenLogprob
from ..engine.loop import LoopStats
from ..engine.pages import Quota
from ..engine.scheduler import Scheduler
from ..errors import PieError
from . import imports
from .component_binary import import_names
from .imports import PACKAGE as WIT_PACKAGE, VERSION as WIT_VERSION
from .bindings import InstanceHost
from .cache import MAX_LOADED, ComponentCache, check_header
from .errors import GuestError, InferletError
from .limits import Limits, flag


@dataclass
class RunResult:
    inferlet: str
    model: str
    ok: bool
    error: str | None
    text: str
    token_ids: list[int]
    stats: dict
    log: str = ""  # the guest's captured stdout and stderr
    returned: bool = False  # `error` is the one the inferlet's `run` returned (its own words), not the host's
    # a failed run that had reached one of its limits (host/runtime/limits.py, the KV quota): that
    # limit's message. Its output so far is sound: `pie serve` answers it with finish_reason "length"
    limit: str | None = None
    # one per token id when the run was started with `logprobs` (host/engine/logprobs.py), else None
    logprobs: list[TokenLogprob] | None = None

    def to_json(self) -> dict:
        out = {"inferlet": self.inferlet, "model": self.model, "text": self.text, "token_ids": self.token_ids,
               "stats": self.stats}
        if self.logprobs is not None:
            out["logprobs"] = [t.to_json() for t in self.logprobs]
        if not self.ok:
            out["error"] = self.error
        if self.limit is not None:
            out["limit"] = self.limit
        return out


class RunHandle:
    """A running inferlet; `result()` waits for it."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self._result: RunResult | None = None
        self._cancel: Callable[[str], None] | None = None  # cleared when the run ends: it reaches the instance
        # the instance's draft counts, by position (read after the run: `pie serve`'s speculative metrics)
        self.draft_stats: LoopStats | None = None

    def cancel(self, reason: str = "the run was cancelled") -> None:
        """End the run: its loops stop, its pages are freed, it fails with `cancelled: reason`."""
        cancel = self._cancel
        if cancel is not None:
            cancel(reason)

    def result(self, timeout: float | None = None) -> RunResult:
        self.thread.join(timeout)
        if self._result is None:
            raise TimeoutError("the inferlet is still running")
        return self._result


REFUSALS_KEPT = 1024  # verdicts on refused components remembered (LRU)


class Runtime:
    def __init__(self, engine: Engine, *, limits: Limits | None = None, cache_dir: str | Path | None = None,
                 scheduler: Scheduler | None = None, epoch_tick_s: float = 0.01, max_loaded: int = MAX_LOADED):
        self.engine = engine
        self.limits = limits or Limits()
        cfg = wasmtime.Config()
        cfg.epoch_interruption = True
        self.wasm_engine = wasmtime.Engine(cfg)
        self.cache = ComponentCache(self.wasm_engine, Path(cache_dir) if cache_dir else None, max_loaded)
        self._cache_lock = threading.Lock()
        # cache key -> set when the load compiling it is done (one compile per content): then the
        # component is loaded, or its refusal is in _refused
        self._compiling: dict[str, threading.Event] = {}
        # cache key -> why it was refused: only the message is kept (a compiled component is tens
        # of MB); without it each launch of a refused upload compiled it again, for seconds
        self._refused: OrderedDict[str, str] = OrderedDict()
        self._own_scheduler = scheduler is None
        self.scheduler = scheduler or Scheduler(engine)
        self.epoch_tick_s = epoch_tick_s
        self._stop = threading.Event()
        self._live: dict[int, tuple] = {}  # id(host) -> (host, wall deadline, log path, limits): the watchdog's
        self._live_lock = threading.Lock()
        self._ticker = threading.Thread(target=self._tick, name="pie-epoch", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.epoch_tick_s):
            self.wasm_engine.increment_epoch()
            try:
                self._watch()
            except Exception:  # the ticker must keep ticking: every store's CPU-time check needs it
                pass

    def _watch(self) -> None:
        """Cancel the instances past their wall time or writing past their log limit."""
        with self._live_lock:
            live = list(self._live.values())
        now = time.perf_counter()
        for host, deadline, log_path, limits in live:
            if now > deadline:
                host.cancel(host.reached(f"the inferlet exceeded its wall-time limit of {limits.wall_time_s:g} s "
                                         f"({flag('wall_time_s')})"))
            elif log_path is not None and _size(log_path) > limits.log_bytes:
                host.cancel(host.reached(f"the inferlet wrote more than {limits.log_bytes} bytes to stdout/stderr "
                                         f"({flag('log_bytes')})"))

    def cancel(self, handle: "RunHandle", reason: str = "the run was cancelled") -> None:
        """End a running instance (see RunHandle.cancel); a finished one is left as it is."""
        handle.cancel(reason)

    def close(self) -> None:
        self._stop.set()
        self._ticker.join()
        if self._own_scheduler:
            self.scheduler.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- loading ----------------------------------------------------------------------
    def load(self, wasm: bytes | str | Path):
        """The compiled component for a .wasm path or its bytes (cached by content hash)."""
        if not isinstance(wasm, (bytes, bytearray)):
            try:
                wasm = Path(wasm).read_bytes()
            except OSError as e:
                raise InferletError(f"cannot read {wasm}: {e.strerror}") from None
        wasm = bytes(wasm)
        check_header(wasm)
        key = self.cache.key(wasm)
        while True:
            with self._cache_lock:  # held only to look up and to keep: never while compiling
                component = self.cache.get(key)
                if component is not None:
                    return component
                refused = self._refused.get(key)
                if refused is not None:  # the same verdict, without compiling it again
                    self._refused.move_to_end(key)
                    raise InferletError(refused)
                pending = self._compiling.get(key)
                mine = pending is None
                if mine:
                    pending = self._compiling[key] = threading.Event()
            if not mine:  # the same bytes are compiling on another thread: wait for that compile
                pending.wait()
                continue
            try:
                names = import_names(wasm)
                if names is not None:  # another world or version: refused before seconds of compiling
                    imports.check_names(names)
                component, compiled = self.cache.compile(wasm, key)
                imports.check(component, self.wasm_engine)  # refused before it runs or is kept
                if compiled:
                    self.cache.store(key, component)
                with self._cache_lock:
                    self.cache.put(key, component)
                return component
            except InferletError as e:
                with self._cache_lock:  # the message, not `e`: its traceback would hold the component
                    self._refused[key] = str(e)
                    while len(self._refused) > REFUSALS_KEPT:
                        self._refused.popitem(last=False)
                raise
            finally:
                with self._cache_lock:
                    self._compiling.pop(key, None)
                pending.set()

    # ---- running ----------------------------------------------------------------------
    def start(self, wasm: bytes | str | Path, args: list[str] = (), *, name: str | None = None,
              on_text: Callable[[str], None] | None = None, limits: Limits | None = None,
              kv_parent: Quota | None = None, logprobs: int | None = None,
              on_logprobs: Callable[[list[TokenLogprob]], None] | None = None, namespace: str = "",
              prefix_caching: bool = True) -> RunHandle:
        """Run an inferlet in its own thread; load errors also arrive as a failed RunResult.
        kv_parent: a quota the instance's own KV quota counts against too (pie serve: its key's).
        logprobs: report each emitted token's logprob with this many top alternatives (0..20;
        None: none); on_logprobs gets each emission's, before its text reaches on_text.
        namespace: where its working sets' blocks are cached and found (pie serve: its API key's);
        prefix_caching: False to neither reuse nor list them (the engine's own setting comes first)."""
        name = name or (Path(wasm).stem if isinstance(wasm, (str, Path)) else "inferlet")
        limits = limits or self.limits
        host = InstanceHost(self.engine, self.scheduler, list(args), limits.cpu_time_s, self.epoch_tick_s, on_text,
                            kv_quota=self.engine.pool.quota(limits.kv_share, kv_parent), limits=limits,
                            logprobs=logprobs, on_logprobs=on_logprobs, namespace=namespace,
                            prefix_caching=prefix_caching)
        handle = RunHandle()
        handle._cancel = host.cancel
        handle.draft_stats = host.draft_stats

        def target() -> None:
            try:
                handle._result = self._run(wasm, name, host, limits)
            except Exception as e:  # a host bug: this run fails, the caller is not left waiting
                handle._result = RunResult(name, self.engine.info.name, False,
                                           f"internal error: {type(e).__name__}: {e}", "", [], {})
            finally:
                handle._cancel = None

        handle.thread = threading.Thread(target=target, name=f"inferlet-{name}", daemon=True)
        handle.thread.start()
        return handle

    def run(self, wasm, args: list[str] = (), **kw) -> RunResult:
        return self.start(wasm, args, **kw).result()

    def _run(self, wasm, name: str, host: InstanceHost, limits: Limits) -> RunResult:
        t0 = time.perf_counter()
        error, returned = None, False
        with tempfile.TemporaryDirectory(prefix="pie-run-") as tmp:
            log_path = Path(tmp) / "log"
            log_path.touch()
            with self._live_lock:
                self._live[id(host)] = (host, t0 + limits.wall_time_s, log_path, limits)
            try:
                component = self.load(wasm)
                self._instantiate_and_run(component, host, limits, log_path)
                if host.fatal is not None:  # cancelled, or past a budget, and then returned
                    error = host.fatal
            except InferletError as e:
                error, returned = str(e), isinstance(e, GuestError)
            except PieError as e:
                error = f"{e.code}: {e}"
            except wasmtime.WasmtimeError as e:
                error = self._explain_trap(e, host, limits, _tail(log_path, limits.log_bytes))
            except Exception as e:  # a host bug: report it as this run's failure, never hang the caller
                error = f"internal error: {type(e).__name__}: {e}"
                host.fatal_trace = host.fatal_trace or traceback.format_exc()
            finally:
                with self._live_lock:
                    self._live.pop(id(host), None)
                host.release_all()
            log = _tail(log_path, limits.log_bytes)  # never the whole file: the guest chose its size
            if host.fatal_trace:  # a host bug: where it happened, for whoever reads the run's log
                log += f"\n[host traceback]\n{host.fatal_trace}"
        try:
            host.finish_output()
            text = host.text
        except Exception as e:  # a failure here is this run's, never the process's
            error = error or f"internal error: finishing the output: {type(e).__name__}: {e}"
            text = ""
        wall = time.perf_counter() - t0
        return RunResult(
            inferlet=name, model=self.engine.info.name, ok=error is None, error=error, text=text,
            token_ids=list(host.token_ids), stats=self._stats(host, wall), log=log, returned=returned,
            limit=host.limit_hit if error is not None else None,
            logprobs=list(host.token_logprobs) if host.logprobs is not None else None)

    def _instantiate_and_run(self, component, host: InstanceHost, limits: Limits, log_path: Path) -> None:
        store = wasmtime.Store(self.wasm_engine)
        store.set_limits(**limits.store_limits())
        wasi = wasmtime.WasiConfig()  # no preopens, no env, no network, no inherited stdio
        wasi.argv = ["inferlet"]
        # stdio goes to a file written by wasmtime itself: a Python callback could be called from
        # wasmtime's I/O thread after the interpreter has begun shutting down, which aborts
        wasi.stdout_file = str(log_path)
        wasi.stderr_file = str(log_path)
        store.set_wasi(wasi)
        host.watch_epochs(store)  # the CPU-time budget and cancellation, checked as the guest runs
        linker = Linker(self.wasm_engine)
        linker.add_wasip2()
        host.link(linker)
        try:
            instance = linker.instantiate(store, component)
        except wasmtime.WasmtimeError as e:
            msg = str(e).strip().splitlines()[0]
            if "matching implementation was not found" in msg or "type mismatch" in msg or "expected" in msg:
                raise InferletError(f"the component was not built against the {WIT_PACKAGE}@{WIT_VERSION} world: {msg}") from None
            raise
        run = instance.get_func(store, "run")
        if run is None:
            raise InferletError("the component exports no `run` function; is it built for the pie:inferlet world?")
        host.start_guest_clock()
        result = run(store)
        if result is not None:
            raise GuestError(str(result))

    def _explain_trap(self, e: wasmtime.WasmtimeError, host: InstanceHost, limits: Limits, guest_log: str) -> str:
        text = str(e)
        if host.fatal is not None:
            return host.fatal
        if "interrupt" in text:
            return host.reached(f"the inferlet exceeded its CPU-time limit of {limits.cpu_time_s:g} s and was stopped")
        if "MemoryError" in guest_log or "memory" in text.lower() and "out of bounds" not in text:
            return host.reached(f"the inferlet exceeded its memory limit of {limits.memory_bytes >> 20} MiB and was "
                                "stopped")
        if "resource limit exceeded" in text:  # a store limit: too many tables, elements, instances
            return host.reached(f"the inferlet exceeded a store limit and was stopped: "
                                f"{text.strip().splitlines()[0]}")
        return f"the inferlet trapped: {_trap_detail(guest_log, text)}"

    def _stats(self, host: InstanceHost, wall: float) -> dict:
        generated = len(host.token_ids)
        return {
            "passes": host.passes,
            "generated_tokens": generated,
            "drafted_tokens": host.draft_stats.drafted,
            "accepted_tokens": host.draft_stats.accepted,
            "acceptance_by_position": host.draft_stats.acceptance_by_position(),
            # committed output tokens per target forward pass (1.0 for plain autoregressive decoding)
            "mean_accepted_per_pass": round(generated / host.passes, 4) if host.passes else 0.0,
            # "stop": the output ends with an end-of-sequence token; "length": it was cut short (OpenAI's names)
            "finish": "stop" if host.token_ids and host.token_ids[-1] in host.engine.info.eos_ids else "length",
            "guest_calls": host.guest_calls,
            # prompt rows taken from the prefix cache instead of computed (OpenAI's cached_tokens)
            "cached_tokens": sum(ws.cached_tokens for ws in host.working_sets),
            "wall_s": round(wall, 4),
            "tokens_per_s": round(generated / wall, 3) if wall > 0 else 0.0,
        }


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _tail(path: Path, limit: int) -> str:
    """The last `limit` bytes of the guest's log, marked as cut when it is longer."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - limit))
        data = f.read(limit)
    text = data.decode("utf-8", "replace")
    return text if size <= limit else f"[{size - limit} bytes of guest output left out]\n{text}"


_PY_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")


def _trap_detail(guest_log: str, trap: str) -> str:
    """The most telling line: the guest's Python exception, else wasmtime's trap reason."""
    lines = [ln.strip() for ln in guest_log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _PY_EXCEPTION.match(ln):
            return ln
    for ln in reversed(lines):
        if "Err` value" in ln or "panicked" in ln:
            return ln
    trap_lines = [ln.strip() for ln in trap.strip().splitlines() if ln.strip()]
    return trap_lines[-1] if trap_lines else "unknown trap"
