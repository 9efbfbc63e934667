"""The host side of one inferlet instance, under every interface: its handle table, budgets,
CPU clock and epoch checks, output (output.py), and how a host function's errors reach the guest.

Handles are integers into the instance's table; they are never reused, so a released handle
answers `bad-handle`. Host functions return WIT result errors for PieErrors. Any other
exception is a host bug: it is described in `fatal` and re-raised as a WasmtimeError, which
traps only this instance (raising a plain Python exception would go through wasmtime-py's
module-global LAST_EXCEPTION and could surface in another instance).

wasmtime-py keeps every host function in a module-global table until the store that uses
it is dropped, so nothing the functions reach may reach the store: they reach the instance
through a `_Link` that `release_all` cuts, and kept errors carry no traceback (whose frames
would hold the store).
"""

from __future__ import annotations

import math
import time
import traceback
from concurrent.futures import InvalidStateError
from typing import Callable

import wasmtime
from wasmtime.component import Variant

from ...engine import Engine, WorkingSet
from ...engine.loop import DeviceLoop, LoopStats
from ...engine.pages import Quota
from ...errors import BadHandle, Internal, PieError, detached
from .. import wasmtime_internals
from ..channels import Channel
from ..errors import BudgetExceeded, Cancelled, ChannelClosed
from ..limits import Limits, flag
from .output import Output
from .wit import NO_ERROR_RESULT, error_record

# The guest's CPU-time budget reads its own thread's CPU clock: the guest runs on the instance's
# thread, so time it sleeps (WASI clocks) or waits for a core under load is not charged
_guest_clock = time.thread_time

EPOCH_SLICE = 10  # epoch ticks of guest execution between checks of the budget and cancellation

wasmtime_internals.install_per_thread_lowering()


class Instance(Output):
    """One running inferlet as every interface sees it (its output: Output)."""

    def __init__(self, engine: Engine, scheduler, args: list[str], cpu_time_s: float, epoch_tick_s: float,
                 on_text: Callable[[str], None] | None = None, kv_quota: Quota | None = None,
                 limits: Limits | None = None, logprobs: int | None = None,
                 on_logprobs: Callable[[list], None] | None = None, namespace: str = "",
                 prefix_caching: bool = True):
        self.engine = engine
        self.namespace, self.prefix_caching = namespace, prefix_caching  # its working sets' (prefix_cache.py)
        self.working_sets: list = []  # every one it made, for its stats
        self.limits = limits or Limits()
        self.cells = 0  # of the live channels
        self.scheduler = scheduler
        self.args = list(args)
        self.kv_quota = kv_quota  # the pages this instance's working sets may hold; None: the whole pool
        self.cpu_time_s = cpu_time_s
        self.epoch_tick_s = epoch_tick_s
        self.handles: dict[int, object] = {}
        self._next_handle = 1
        self.fatal: str | None = None  # why the host ended the instance: "code: message"
        self.limit_hit: str | None = None  # the first of its limits it reached (RunResult.limit)
        self.fatal_trace = ""  # the traceback of a host bug, added to the run's log
        self._link = _Link()
        super().__init__(engine, self.limits.output_bytes, on_text, logprobs, on_logprobs)
        # counters (the host's, not the guest's)
        self.guest_calls = 0
        self.passes = 0
        self.draft_stats = LoopStats()
        self.loops: list[DeviceLoop] = []
        self.guest_time_s = 0.0
        self.loop_time_s = 0.0  # model time of the device loops, charged to the compute-time budget
        # the guest's thread clock, set again on its thread (start_guest_clock); from the constructing
        # thread's clock until then, so host functions called directly (tests) do not charge the
        # thread's whole past CPU time to the first call
        self._last_exit = _guest_clock()
        self._epoch_key = None

    # ---- handles ---------------------------------------------------------------------
    def _add(self, obj) -> int:
        h = self._next_handle
        self._next_handle += 1
        self.handles[h] = obj
        return h

    def new_working_set(self, cached: bool = True):
        """A working set of this instance: its KV quota, logprobs and prefix-cache namespace
        (cached False: outside the prefix cache)."""
        ws = self.engine.new_working_set(self.kv_quota, self.new_scores(), self.namespace,
                                         self.prefix_caching and cached)
        self.working_sets.append(ws)
        return ws

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

    def _release(self, h: int, kind: type, what: str) -> None:
        """Forget handle h of the given kind (an object that holds nothing to free)."""
        self._get(h, kind, what)
        del self.handles[h]

    def _ws(self, h: int) -> WorkingSet:
        return self._get(h, WorkingSet, "working-set")

    def _ch(self, h: int) -> Channel:
        return self._get(h, Channel, "channel")

    def release_all(self) -> None:
        """Free everything the instance still holds: loops, KV pages, channel buffers, samplers,
        and the host functions' way to it (see `_Link`)."""
        self._link.fns.clear()
        self.scored = None
        wasmtime_internals.forget_epoch_deadline(self._epoch_key)
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

    # ---- budgets (host/runtime/limits.py) ----------------------------------------------------
    def check_cells(self, n: int) -> None:
        """Refuse a new channel of n cells past the instance's cell budget."""
        if self.cells + n > self.limits.channel_cells:
            raise BudgetExceeded(f"a channel of {n} cells does not fit: the inferlet's channels hold "
                                 f"{self.cells} of its {self.limits.channel_cells} cells ({flag('channel_cells')}); "
                                 f"release one first")

    def check_readout_rows(self, rows: list) -> None:
        if len(rows) > self.limits.readout_rows:
            raise BudgetExceeded(f"{len(rows)} readout rows in one pass, more than its limit of "
                                 f"{self.limits.readout_rows} ({flag('readout_rows')})")

    # ---- time: the CPU-time and compute-time budgets, and cancellation ------------------------
    # Two budgets, since they bound different things: CPU time a guest that spins (its own code),
    # compute time a loop that never ends (the model's work). A long generation is all model time:
    # charged to the guest's CPU time, it was killed as a runaway guest.
    def _over_cpu(self) -> bool:
        """Past a time budget, or cancelled: the instance is marked to end (fatal)."""
        if self.fatal is None and self.guest_time_s >= self.cpu_time_s:
            self.fatal = self.reached(f"the inferlet exceeded its CPU-time limit of {self.cpu_time_s:g} s and was "
                                      "stopped")
        if self.fatal is None and self.loop_time_s >= self.limits.compute_time_s:
            self.fatal = self.reached(f"the inferlet exceeded its compute-time limit of "
                                      f"{self.limits.compute_time_s:g} s ({flag('compute_time_s')}) and was stopped")
        return self.fatal is not None

    def reached(self, message: str) -> str:
        """Note that a limit was reached (the first one is the run's `limit`); returns the message."""
        if self.limit_hit is None:
            self.limit_hit = message
        return message

    def cancel(self, reason: str) -> None:
        """End the instance from any thread: its loops stop now, the guest at its next host call
        or epoch check; its pages are freed when its run returns (release_all)."""
        if self.fatal is None:
            self.fatal = f"{Cancelled.code}: {reason}"
        self.stop_loops(lambda: Cancelled(reason))

    def watch_epochs(self, store: wasmtime.Store) -> None:
        """Check the CPU-time budget and cancellation every EPOCH_SLICE ticks of guest execution."""
        self._link.fns["epoch"] = self._on_epoch
        self._epoch_key = wasmtime_internals.on_epoch_deadline(store, self._link.epoch_check())
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
        left = math.ceil((self.cpu_time_s - self.guest_time_s) / self.epoch_tick_s)
        return max(0, min(EPOCH_SLICE, left))

    def count_round(self, loop: DeviceLoop, window: int, fold: int, cost_s: float) -> None:
        """After each round of a loop, on the compute thread: the round's share of its step is
        charged to the compute-time budget; past it, or cancelled, the loop ends."""
        self.passes += 1
        self.loop_time_s += cost_s
        if self._over_cpu():
            raise Cancelled(self.fatal)

    def stop_loops(self, error: Callable[[], PieError] | None = None) -> None:
        """End this instance's loops (the instance is finishing, or cancelled); the scheduler drops them."""
        for loop in list(self.loops):  # cancel may come from another thread
            try:
                loop.finish(error() if error else ChannelClosed("the inferlet ended while its loop was running"))
            except InvalidStateError:  # the compute thread finished it meanwhile
                pass

    # ---- the call wrapper ----------------------------------------------------------------
    def _host(self, name: str, fn: Callable, tagged: bool = False) -> Callable:
        """Wrap `fn` as the host function `name`: count the call, map errors, keep the CPU-time budget.
        tagged: see wit.TAGGED."""
        def host(store, *args):
            enter = _guest_clock()
            self.guest_time_s += enter - self._last_exit
            self.guest_calls += 1
            try:
                if self._over_cpu():  # cancelled, or past a time budget
                    raise wasmtime.WasmtimeError(self.fatal)
                value = fn(*args)
                return Variant("ok", value) if tagged else value
            except PieError as e:
                if e.limit:
                    self.reached(str(e))
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
                # the CPU-time budget counts guest execution, not time blocked in the host
                wasmtime_internals.set_epoch_deadline(store, self._ticks_left())

        return self._link.add(name, host)


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

    def epoch_check(self) -> Callable[[], int | str]:
        """The instance's epoch check ("epoch"), looked up per deadline."""
        fns = self.fns

        def check():
            f = fns.get("epoch")
            return f() if f is not None else "the instance has ended"
        return check
