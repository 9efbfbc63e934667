"""Batches the passes of every running inferlet, and every device loop, into shared model calls.

Inferlet threads call `submit` and block on the returned future; device loops are started
with `start_loop` and stay in every batch until they stop. Each step is a task on the compute
thread (see compute.py): schedule (take what is pending), run (one model call), postprocess
(commit folds, run epilogues, resolve futures). While work remains, a step runs the next one
at once if no other compute task is queued, else queues it behind them, so other compute
tasks interleave between steps. A pass's result never depends on which
others shared its batch.
"""

from __future__ import annotations

import numbers
import threading
import time

import torch
from concurrent.futures import Future

from ..errors import InvalidArgument, PieError, detached, unexpected
from .compute import compute
from .engine import Engine, Pass
from .loop import DeviceLoop, RoundReadback, readback, run_epilogues


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int = 64):
        self.engine = engine
        self.max_batch = max_batch
        self._pending: list[tuple[Pass, Future]] = []
        self._loops: list[DeviceLoop] = []
        self._lock = threading.Lock()
        self._closed = False
        self._compute = compute()
        self._queued = False  # a step is queued on the compute thread

    def submit(self, ps: Pass) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(PieError("the engine is shut down"))
                return fut
            self._pending.append((ps, fut))
            self._wake()
        return fut

    def forward(self, ps: Pass):
        """Submit and wait: returns the PassOutput or raises the pass's PieError."""
        return self.submit(ps).result()

    def start_loop(self, loop: DeviceLoop) -> Future:
        """Run `loop` until its stop flag, its round limit, an empty window or an error."""
        with self._lock:
            if self._closed:
                loop.finish(PieError("the engine is shut down"))
            else:
                self._loops.append(loop)
                self._wake()
        return loop.done

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake()
        self._compute.call(lambda: None)  # the queue is FIFO: the closing step has run

    # ---- the steps ----------------------------------------------------------------------
    def _wake(self) -> None:
        """Queue a step unless one is queued already (call with self._lock held)."""
        if not self._queued:
            self._queued = True
            self._compute.submit(self._tick)

    @torch.inference_mode()  # no autograd bookkeeping on the small epilogue and index ops
    def _tick(self) -> None:
        while True:
            with self._lock:
                self._queued = False
                if self._closed:
                    for _, fut in self._pending:
                        fut.set_exception(PieError("the engine is shut down"))
                    for loop in self._loops:
                        loop.finish(PieError("the engine is shut down"))
                    self._pending, self._loops = [], []
                    return
                room = max(self.max_batch - len(self._loops), 1)
                work, self._pending = self._pending[:room], self._pending[room:]
                loops = [lp for lp in self._loops if not lp.finished]
            try:
                self._step(work, loops)
            except Exception as e:  # an engine bug must not hang every inferlet
                detached(e)
                for _, fut in work:
                    if not fut.done():
                        fut.set_exception(e)
                for lp in loops:
                    lp.finish(e)
            with self._lock:
                self._loops = [lp for lp in self._loops if not lp.finished]
                if not (self._pending or self._loops or self._closed):
                    return
                if self._compute.busy():  # other compute tasks wait: queue the next step behind them
                    self._wake()
                    return
                # nothing else is queued: run the next step at once (a device loop's next round);
                # a submit meanwhile finds a step pending and need not queue one
                self._queued = True

    def _step(self, work: list[tuple[Pass, Future]], loops: list[DeviceLoop]) -> None:
        eng = self.engine
        # the compute thread's CPU clock: a step that waits for a core on a loaded machine is not
        # charged for the wait, so a healthy loop does not end early under load (issue 40)
        started = time.thread_time()
        live, loop_passes = [], []
        for lp in loops:
            try:
                if lp.round >= lp.rounds:
                    lp.finish()
                    continue
                ps = lp.next_pass()
            except Exception as e:
                lp.finish(unexpected("the loop's window", e))
                continue
            if ps is None:  # the epilogue left no window: nothing more to run
                lp.finish()
                continue
            live.append(lp)
            loop_passes.append(ps)
        passes = [ps for ps, _ in work] + loop_passes
        errors: list = [None] * len(passes)
        with eng.lock:
            batch, ok = eng.prepare(passes, errors)
            outs = eng.run(batch) if batch is not None else []
            by_index = dict(zip(ok, zip(batch.first_positions, outs))) if batch is not None else {}
            for i, (ps, fut) in enumerate(work):
                if i in by_index:
                    first, out = by_index[i]
                    eng.apply_known_fold(ps, first)
                    if ps.choose is not None:  # here, where the logits are: no second hop for it
                        try:
                            out.tokens = ps.choose(out.logits, ps.draw_position(first))
                        except Exception as e:
                            fut.set_exception(detached(unexpected("choosing the pass's tokens", e)))
                            continue
                    fut.set_result(out)
                else:
                    fut.set_exception(errors[i])
            ran = []
            for j, lp in enumerate(live):
                i = len(work) + j
                if i in by_index:
                    ran.append((lp, loop_passes[j], *by_index[i]))
                else:
                    lp.finish(errors[i])
            if ran:
                rows = sum(passes[i].window for i in by_index)
                self._postprocess_loops(ran, started, rows)

    def _postprocess_loops(self, ran: list, started: float, rows: int) -> None:
        """Epilogues, readback and bookkeeping of the loops that ran: a failure in any of them
        ends its own loop only (one instance's program must not stop another's). Each loop's
        round costs the step's CPU time so far times its share of the batch's rows (`on_round`):
        a loop batched with seven others is not charged the whole step."""
        loops = [r[0] for r in ran]
        locks = loops[0].locks() if len(loops) == 1 else \
            [lk for _, lk in sorted({id(lk): lk for lp in loops for lk in lp.locks()}.items())]
        for lk in locks:
            lk.acquire()
        try:
            results = run_epilogues(loops, [r[1] for r in ran], [r[3] for r in ran], [r[2] for r in ran],
                                    self.engine.device, self.engine.device_type, self.engine.info.vocab_size)
            alive = []
            for r, res in zip(ran, results):
                if isinstance(res, PieError):
                    r[0].finish(res)
                else:
                    alive.append((r, res))
            backs = readback([r[0] for r, _ in alive], [r[1] for r, _ in alive], [res for _, res in alive])
            per_row = (time.thread_time() - started) / max(rows, 1)
            for ((lp, ps, first, _), _), back in zip(alive, backs):
                if isinstance(back, PieError):
                    lp.finish(back)
                    continue
                try:
                    self._commit_round(lp, ps, first, back, per_row * ps.window)
                except Exception as e:
                    lp.finish(unexpected("the loop's round", e))
        finally:
            for lk in reversed(locks):
                lk.release()

    def _commit_round(self, lp: DeviceLoop, ps: Pass, first: int, back: RoundReadback, cost_s: float) -> None:
        eng = self.engine
        fold = back.fold
        if isinstance(fold, bool) or not isinstance(fold, numbers.Integral) or not 0 <= fold <= ps.window:
            raise InvalidArgument(f"the epilogue set fold {fold!r}, not an integer in 0..{ps.window} (the window)")
        fold = int(fold)
        if not isinstance(ps.tokens, list):  # device ids, clamped for the pass (Engine._build)
            eng.check_ids(back.tokens)  # nothing of the round is committed
        eng.apply_fold(ps, first, fold, back.tokens)
        for name, n in back.lengths.items():
            ch = lp.channels[name]
            if name in back.streamed:
                ch.stream(back.streamed[name])
            else:
                ch.set_length(n)
        lp.stats.record(lp.drafts(ps.window), fold)
        lp.round += 1
        if lp.on_round is not None:
            lp.on_round(lp, ps.window, fold, cost_s)
        if back.stop or lp.round >= lp.rounds:
            lp.finish()  # the producers detach: waiting takes wake up
