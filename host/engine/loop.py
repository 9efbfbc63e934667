"""The device loop: a pass fired round after round, its epilogue run on the device after each.

Each round embeds its window from a channel that the previous round's epilogue filled,
runs in the scheduler's shared model call, then runs its epilogue (compare, sample, set the
fold, write the next window). The host reads back, once per batch for every loop in it,
the fold counts, stop flags, channel lengths and window tokens: the page bookkeeping needs
them, and nothing else leaves the device. The guest is not called between rounds.
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..epilogue import DeviceChannel, DraftBinding, Env, GrammarMatcher, CompiledProgram, Result, SuffixSource, host_readable
from ..errors import InvalidArgument, detached, unexpected
from .engine import Fold, Pass, PassOutput, check_shape
from .working_set import WorkingSet


@dataclass
class LoopStats:
    rounds: int = 0
    drafted: int = 0  # window rows past the first (the last committed token)
    accepted: int = 0  # of those, rows that were frozen
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)  # [j]: rounds that accepted exactly j of their drafts

    _pending: int = 0  # drafts of a pass whose fold the guest will commit later

    def record(self, drafts: int, fold: int) -> None:
        """A loop round that verified `drafts` window rows and froze `fold` rows."""
        self.rounds += 1
        self._add(drafts, fold)

    def drafted_window(self, window: int) -> None:
        """A pass that leaves its window unfolded: the guest verifies and commits later."""
        self._pending = max(window - 1, 0)

    def accepted_rows(self, rows: int) -> None:
        if self._pending:
            self._add(self._pending, rows)
            self._pending = 0

    def _add(self, drafts: int, fold: int) -> None:
        acc = min(max(fold - 1, 0), drafts)
        self.drafted += drafts
        self.accepted += acc
        if drafts:
            self.histogram += [0] * (drafts + 1 - len(self.histogram))
            self.histogram[acc] += 1
        for pos in range(drafts):
            if pos >= len(self.drafted_by_position):
                self.drafted_by_position.append(0)
                self.accepted_by_position.append(0)
            self.drafted_by_position[pos] += 1
            self.accepted_by_position[pos] += pos < acc

    def acceptance_by_position(self) -> list[float]:
        return [round(a / d, 4) for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @staticmethod
    def summary(stats: list["LoopStats"]) -> dict:
        """Runs' speculation together, in vLLM's per-request `speculative_decoding` fields (a spec
        step: a round that verified at least one draft) and acceptance by draft position."""
        steps = sum(s.drafted_by_position[0] for s in stats if s.drafted_by_position)
        drafted = sum(s.drafted for s in stats)
        accepted = sum(s.accepted for s in stats)
        width = max((len(s.histogram) for s in stats), default=0)
        hist = [sum(s.histogram[j] for s in stats if j < len(s.histogram)) for j in range(width)]
        by_pos = [(sum(s.accepted_by_position[i] for s in stats if i < len(s.accepted_by_position)),
                   sum(s.drafted_by_position[i] for s in stats if i < len(s.drafted_by_position)))
                  for i in range(max(width - 1, 0))]
        return {"mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
                "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
                "acceptance_histogram": hist, "num_spec_steps": steps, "num_accepted_draft_tokens": accepted,
                "num_draft_tokens": drafted, "num_spec_tokens": max(width - 1, 0),
                "acceptance_by_position": [round(a / d, 4) for a, d in by_pos]}


@dataclass
class RoundReadback:
    """What the host learns of one loop's round, once the epilogue has run: host values only."""

    fold: int  # rows of the window that become committed state
    stop: bool  # the epilogue raised its stop flag
    lengths: dict[str, int]  # every channel's length after the round
    tokens: list[int]  # the window's ids (the fold records the folded ones)
    streamed: dict[str, list[int]]  # a channel with a sink: the cells the round appended


@dataclass
class DeviceLoop:
    """State of one looping pass. Its channels implement DeviceChannel (host/epilogue/env.py),
    whose docstring also gives the lock order."""

    ws: WorkingSet
    program: CompiledProgram | None  # None: the fold is a constant, the whole window, or a channel's
    channels: dict[str, DeviceChannel]  # name in the program -> channel
    embed: DeviceChannel  # the channel whose cells are each round's window
    max_window: int
    rounds: int
    readout: list[int] | None = None  # None: every row of the window
    fold: int | Fold = Fold.EPILOGUE  # a constant, Fold.ALL, Fold.EPILOGUE or Fold.CHANNEL
    fold_channel: DeviceChannel | None = None  # with Fold.CHANNEL: cell 0, read after the epilogue
    seed: int = 0
    hidden: bool = False
    matchers: dict[str, GrammarMatcher] = field(default_factory=dict)  # name in the program -> matcher
    drafters: dict[str, DraftBinding] = field(default_factory=dict)  # name in the program -> head bound to ws
    suffix: SuffixSource | None = None  # ws's namespace's suffix index, for suffix_draft
    spare: int = field(init=False)  # rows past the window each pass prepares (CompiledProgram.spare: a draft head's chain)
    logits: bool = field(init=False)  # False: the program reads no logits, and the pass computes none
    round: int = 0
    stats: LoopStats = field(default_factory=LoopStats)
    done: Future = field(default_factory=Future)
    finished: bool = False  # done is resolved (a plain flag: the scheduler reads it twice a round)
    on_round: Callable | None = None  # callback(loop, window, fold, cost_s) after each round's bookkeeping;
    # cost_s: the round's share of its batched step's time (the scheduler's rule, by rows)
    _locks: list | None = None

    def __post_init__(self):
        self.spare = self.program.spare if self.program is not None else 0
        self.logits = self.program is None or self.program.reads_logits
        # the pass's rules, checked before the first round (each round's pass is checked again
        # by the engine with the window the round reads)
        check_shape(self.max_window, self.readout, self.fold)
        if (self.fold is Fold.CHANNEL) != (self.fold_channel is not None):
            raise InvalidArgument("a fold from a channel needs the channel, and only it does")
        if self.fold is Fold.EPILOGUE and self.program is None:
            raise InvalidArgument("fold from-epilogue needs the pass to name an epilogue")
        if self.fold is Fold.EPILOGUE and not self.program.has_fold:
            raise InvalidArgument("fold from-epilogue, but the epilogue has no fold effect")

    def drafts(self, window: int) -> int:
        """Rows a round of `window` rows verifies: those past the first (the last committed token)
        when the epilogue or a channel decides the fold; a fixed fold verifies nothing."""
        return max(window - 1, 0) if self.fold in (Fold.EPILOGUE, Fold.CHANNEL) else 0

    def next_pass(self) -> Pass | None:
        n = self.embed.length
        if n == 0:
            return None
        if n > self.max_window:
            raise InvalidArgument(f"the window channel holds {n} cells, more than the pass's window of {self.max_window}")
        # rows past this round's window are skipped: a variable window reads out what it has
        rows = list(range(n)) if self.readout is None else [r for r in self.readout if r < n]
        # A copy: the epilogue overwrites the channel with the next window before readback.
        # In host memory the copy is a list (the engine validates and indexes it without a
        # torch op, and applying the fold needs it as one); on a device it stays there.
        host = self.embed.host
        tokens = self.embed.buf[:n].clone() if host is None else host[:n].tolist()
        return Pass(self.ws, tokens, rows, fold=0, hidden=self.hidden, logits=self.logits, spare=self.spare)

    def locks(self) -> list:
        if self._locks is None:  # the channels are fixed for the loop's life
            locks = {id(c.lock): c.lock for c in [*self.channels.values(), self.embed, self.fold_channel] if c is not None}
            self._locks = [locks[k] for k in sorted(locks)]  # one order for every taker: no deadlock
        return self._locks

    def finish(self, error: BaseException | None = None) -> None:
        """End the loop; the first of the compute thread and a canceller to finish it wins."""
        if self.finished:
            return
        self.finished = True
        try:
            if error is None:
                self.done.set_result(self.stats)
            else:
                self.done.set_exception(detached(error))
        except InvalidStateError:  # another thread resolved it between the test and here
            pass


def run_epilogues(loops: list[DeviceLoop], passes: list[Pass], outs: list[PassOutput], firsts: list[int],
                  device, device_type: str, vocab: int | None = None) -> list:
    """Run each loop's epilogue on its pass's outputs; channels are written in place on the device.
    Returns per loop the epilogue's Result (fold, stop and channel lengths: host ints or device
    values), or the PieError that ends that loop alone."""
    results: list = [Result()] * len(loops)
    envs: list = [None] * len(loops)
    host = host_readable(device_type)  # logits in host memory reach the executor as numpy arrays
    # One run per program and pass shape, as the executor batches them anyway: a run that raises
    # then wrote no other shape's channels, and its passes are retried one by one.
    groups: dict[tuple, list[int]] = {}
    for i, (loop, ps, out, first) in enumerate(zip(loops, passes, outs, firsts)):
        if loop.program is None:
            continue
        hist = None
        if "history" in loop.program.uses:
            hist = torch.tensor(loop.ws.tokens, dtype=torch.int64, device=device)  # host->device, no sync
        window, window_len = ps.tokens, None
        if isinstance(window, list):  # host tokens: a tensor only for a program that reads them
            if "window" in loop.program.uses:
                window = torch.tensor(window, dtype=torch.int64, device=device)
            else:
                window, window_len = None, ps.window
        logits = out.logits.numpy() if host and out.logits is not None else out.logits
        envs[i] = Env(logits=logits, vocab=vocab, window=window, history=hist, hidden=out.hidden, channels=loop.channels,
                      matchers=loop.matchers, drafters=loop.drafters, suffix=loop.suffix, seed=loop.seed, round=loop.round, window_len=window_len, position=first,
                      draw_position=ps.draw_position(first))
        key = (id(loop.program), len(ps.readout), ps.window, None if hist is None else hist.shape[0],
               out.hidden is None)
        groups.setdefault(key, []).append(i)
    for idx in groups.values():
        prog = loops[idx[0]].program
        try:
            got = prog.run([envs[i] for i in idx])
        except Exception as e:
            got = [unexpected("the epilogue", e)] if len(idx) == 1 else [_run_alone(prog, envs[i]) for i in idx]
        for i, res in zip(idx, got):
            results[i] = res
    return results


def _run_alone(prog, env: Env):
    try:
        return prog.run([env])[0]
    except Exception as e:
        return unexpected("the epilogue", e)


def readback(loops: list[DeviceLoop], passes: list[Pass], results: list) -> list:
    """`_readback` for every loop at once, else (one loop's values cannot be read) loop by loop:
    per loop its values, or the PieError that ends that loop alone. Reading changes nothing."""
    try:
        return _readback(loops, passes, results)
    except Exception as e:
        if len(loops) == 1:
            return [unexpected("reading back the loop's round", e)]
    out = []
    for one in zip(loops, passes, results):
        try:
            out += _readback(*([x] for x in one))
        except Exception as e:
            out.append(unexpected("reading back the loop's round", e))
    return out


def _readback(loops: list[DeviceLoop], passes: list[Pass], results: list) -> list[RoundReadback]:
    """The one host transfer per batch: the folds, stops and channel lengths that the epilogues left
    on the device, window tokens, and the new cells of channels that stream to the client (a
    channel with a `sink`). Values the host already knows (a constant fold, the length after a
    write without a device count) are not transferred. On the CPU there is nothing to transfer:
    each value is read from host memory where it is met."""
    parts: list[torch.Tensor] = []

    def later(x, many: bool = False):
        """x itself if the host knows it, its value if it is in host memory, else a slot in the transfer."""
        if x is None or isinstance(x, (int, bool, list)):
            return x
        x = x if x.dim() == 1 else x.reshape(-1)
        if host_readable(x.device):  # reading host memory is a copy: nothing to batch
            v = x.tolist()
            return v if many else v[0]
        parts.append(x if x.dtype == torch.int64 else x.to(torch.int64))
        return _Slot(len(parts) - 1, many)

    plans = []
    for loop, ps, res in zip(loops, passes, results):
        if loop.fold is Fold.CHANNEL:
            fold = later(loop.fold_channel.buf[:1])  # read after the epilogue wrote it
        elif loop.fold is Fold.EPILOGUE:
            fold = later(res.fold)
        else:
            fold = ps.window if loop.fold is Fold.ALL else loop.fold
        stop = later(res.stop) if res.stop is not None else False
        lengths = {name: later(res.channels[name].length) if name in res.channels else ch.length
                   for name, ch in loop.channels.items()}
        streamed = {}
        for name, ch in loop.channels.items():
            if ch.sink is None:
                continue
            n = lengths[name]
            if isinstance(n, int) and ch.host is not None:  # host memory, known length
                streamed[name] = ch.host[ch.length:n].tolist()
                continue
            # a device length: read a bounded span now (a round appends at most a window's worth
            # in practice) and the rest, if any, separately below
            end = n if isinstance(n, int) else min(ch.capacity, ch.length + 2 * loop.max_window + 8)
            streamed[name] = later(ch.buf[ch.length:end], many=True)
        plans.append((fold, stop, lengths, later(ps.tokens, many=True), streamed))
    # the sync: page bookkeeping needs folds and lengths on the host
    flat = _transfer(parts)
    out = []
    for loop, (fold, stop, lengths, tokens, streamed) in zip(loops, plans):
        if parts:  # else every value is known already
            lengths = {k: _get(flat, v) for k, v in lengths.items()}
            fold, stop, tokens = _get(flat, fold), _get(flat, stop), _get(flat, tokens)
            streamed = {name: _get(flat, slot) for name, slot in streamed.items()}
        for name, got in streamed.items():
            ch, n = loop.channels[name], lengths[name]
            got = got[:max(n - ch.length, 0)]
            if ch.length + len(got) < n:
                got += ch.buf[ch.length + len(got):n].tolist()
            streamed[name] = got
        out.append(RoundReadback(fold, bool(stop), lengths, tokens, streamed))
    return out


class _Slot:
    __slots__ = ("i", "many")

    def __init__(self, i: int, many: bool):
        self.i, self.many = i, many


def _transfer(parts: list[torch.Tensor]) -> list[list[int]]:
    if not parts:
        return []
    flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
    out, i = [], 0
    for p in parts:
        out.append(flat[i:i + p.shape[0]])
        i += p.shape[0]
    return out


def _get(flat: list[list[int]], x):
    if isinstance(x, _Slot):
        return flat[x.i] if x.many else flat[x.i][0]
    return x
