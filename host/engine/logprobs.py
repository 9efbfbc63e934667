"""Logprobs of the tokens a run emits, read from the target's own logits rows.

The logprob of a token is the raw log-softmax (float32) of the row that predicted it: the row
one position before it, in whichever pass computed that row. A row's arithmetic does not depend
on the rows beside it (a decode, a verify window, a device loop's round), so an accepted draft's
logprob is the very value plain decoding gives it, whatever proposed the draft. Sampling filters
and biases are not applied: these are the model's probabilities, as vLLM's default
(`raw_logprobs`) reports them.

A working set whose instance asked for logprobs keeps the logits rows of its latest passes by
position (RowScores.record, from Engine.run); the instance's emitted tokens are matched to the
positions they continue (RowScores.take).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidArgument
from .compute import on_compute_thread

MAX_TOP = 20  # top alternatives a token may carry (OpenAI's bound for chat's top_logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's logprob and its `top` alternatives (id, logprob), most likely first
    (ties: lower id first). logprob None: no row of the target predicted the token (the inferlet
    emitted it without a pass that scored its position)."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()

    def to_json(self) -> dict:
        return {"token": self.token, "logprob": self.logprob, "top": [list(t) for t in self.top]}


class RowScores:
    """A working set's logits rows by position, and where its instance's next emitted token goes.

    Rows are copied out of the pass's logits (an epilogue never sees them aliased, and a batch's
    logits are not kept alive by one run). A later pass over the same positions replaces them
    (rejected drafts' rows are overwritten as their KV is); rows more than KEEP positions behind
    the latest pass's last row are dropped (an emission follows the pass that scored it)."""

    KEEP = 32

    def __init__(self, top: int):
        if not 0 <= top <= MAX_TOP:
            raise InvalidArgument(f"top logprobs {top} outside 0..{MAX_TOP}")
        self.top = top
        self._rows: dict[int, torch.Tensor] = {}
        self.next: int | None = None  # the position of the next emitted token, once one was emitted

    def fork(self) -> "RowScores":
        """A fork's: the same rows (never written in place), its own emission cursor."""
        out = RowScores(self.top)
        out._rows = dict(self._rows)
        out.next = self.next
        return out

    def record(self, first: int, readout: list[int], logits: torch.Tensor) -> None:
        """A pass whose window starts at position `first` computed `logits` for its `readout` rows."""
        if not readout:
            return
        last = first + max(readout)
        stale = [p for p in self._rows if p >= first or p < last - self.KEEP]
        for p in stale:
            del self._rows[p]
        keep = [i for i, r in enumerate(readout) if first + r >= last - self.KEEP]  # a prompt's rows: its last
        rows = logits[keep].detach().clone() if len(keep) < len(readout) else logits.detach().clone()
        for j, i in enumerate(keep):
            self._rows[first + readout[i]] = rows[j]

    @on_compute_thread  # a reduction over the vocabulary: torch work belongs on the compute thread
    def take(self, tokens: list[int], next_position: int) -> list[TokenLogprob]:
        """The logprobs of `tokens`, emitted now, continuing the emitted ones before them; the
        first emission ends at the working set's next position (the token its last frozen row
        predicted: a prompt pass's first token, or a verify round's bonus)."""
        start = self.next if self.next is not None else next_position - len(tokens) + 1
        self.next = start + len(tokens)
        return [self._score(start + j - 1, t) for j, t in enumerate(tokens)]

    def _score(self, row_position: int, token: int) -> TokenLogprob:
        row = self._rows.get(row_position)
        return TokenLogprob(token, None) if row is None else token_logprob(row, token, self.top)


def token_logprob(row: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s logprob under one logits row, and the row's `top` most likely ids."""
    lp = torch.log_softmax(row, -1)
    alts = ()
    if top:
        vals, ids = torch.topk(lp, min(top, lp.shape[0]))
        alts = tuple(sorted(zip(ids.tolist(), vals.tolist()), key=lambda t: (-t[1], t[0])))
    return TokenLogprob(token, float(lp[token]), alts)


SCORE_ROWS = 256  # rows per pass when scoring a sequence: a pass's logits are rows x vocabulary floats


def score_tokens(engine, scheduler, ids: list[int], top: int, quota=None,
                 namespace: str = "") -> list[TokenLogprob | None]:
    """The logprob of each of `ids` given the ids before it (None for the first, which nothing
    predicts): the prompt logprobs of `echo`. Passes of SCORE_ROWS rows through `scheduler` (batched
    with every other run's), each row read out; rows are computed alone, so the values are those a
    run's own passes over the same ids give. Call it off the compute thread; its working set's
    pages (counted against `quota`) are freed before it returns; its blocks stay in the prefix cache
    under `namespace`, for the completion after it."""
    from .engine import Fold, Pass
    from .compute import compute

    engine.check_ids(ids)
    if not 0 <= top <= MAX_TOP:
        raise InvalidArgument(f"top logprobs {top} outside 0..{MAX_TOP}")
    out: list[TokenLogprob | None] = [None]
    ws = engine.new_working_set(quota, namespace=namespace)
    try:
        for a in range(0, len(ids) - 1, SCORE_ROWS):
            window = ids[a:a + SCORE_ROWS]
            follow = ids[a + 1:a + 1 + len(window)]  # the ids the window's rows predict
            logits = scheduler.forward(Pass(ws, window, list(range(len(follow))), fold=Fold.ALL)).logits
            out += compute().call(lambda: [token_logprob(logits[j], t, top) for j, t in enumerate(follow)])
    finally:
        engine.release(ws)
    return out
