"""An instance's output: free text and generated token ids, their byte budget, the text
streamed to the client as the ids are decoded, and, when the run asked for them, the ids'
logprobs (host/engine/logprobs.py)."""

from __future__ import annotations

import threading
from typing import Callable

from ...engine.logprobs import RowScores, TokenLogprob
from ..detok import Detokenizer
from ..errors import BudgetExceeded
from ..limits import flag


class Output:
    def __init__(self, engine, limit_bytes: int, on_text: Callable[[str], None] | None,
                 logprobs: int | None = None, on_logprobs: Callable[[list[TokenLogprob]], None] | None = None):
        """logprobs: report each emitted id's logprob with this many top alternatives (None: none);
        on_logprobs: called with each emission's logprobs, before its text reaches on_text."""
        self.engine = engine
        self.on_text = on_text
        self.logprobs = logprobs
        self.on_logprobs = on_logprobs
        self.token_logprobs: list[TokenLogprob] = []  # one per id of token_ids, when logprobs is set
        self.scored = None  # the working set whose rows score the emitted ids: that of the latest pass
        self.output = 0  # bytes of output text and token ids
        self.output_limit = limit_bytes  # Limits.output_bytes
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self._detok = Detokenizer(engine.tokenizer)
        self._held: list[int] = []  # ids not yet detokenised: with no on_text, nobody reads text mid-run
        self._out_lock = threading.Lock()

    def _charge_output(self, n: int, what: str) -> None:
        """Refuse output past Limits.output_bytes (decoded text is counted after the fact)."""
        if self.output + n > self.output_limit:
            raise BudgetExceeded(f"{what} would take the run's output past its limit of "
                                 f"{self.output_limit} bytes ({flag('output_bytes')})")

    def _stream(self, text: str) -> None:
        if text:
            self.output += len(text.encode("utf-8", "replace"))
            self.text_parts.append(text)
            if self.on_text is not None:
                self.on_text(text)

    def send(self, text: str) -> None:
        """Append free text to the output, after the ids emitted so far."""
        with self._out_lock:
            self._charge_output(len(text.encode("utf-8", "replace")), "send")
            self._release_held()  # text keeps its place among the emitted tokens
            self._stream(text)

    def emit(self, ids: list[int]) -> None:
        """Record generated ids (checked against the vocabulary) and stream their text."""
        self.engine.check_ids(ids)
        scored = self._score(ids)  # before the lock: it runs on the compute thread, whose sink may wait for it
        with self._out_lock:
            if scored is not None:
                self.token_logprobs.extend(scored)
                if self.on_logprobs is not None:
                    self.on_logprobs(scored)
            self._emit_ids(ids)

    def new_scores(self) -> RowScores | None:
        """What a new working set of this run keeps for its logprobs (None: the run reports none)."""
        return None if self.logprobs is None else RowScores(self.logprobs)

    def _score(self, ids: list[int]) -> list[TokenLogprob] | None:
        if self.logprobs is None:
            return None
        ws = self.scored
        if ws is None or ws.scores is None:
            return [TokenLogprob(t, None) for t in ids]
        return ws.scores.take(ids, ws.next_position)

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

    def finish_output(self) -> None:
        with self._out_lock:
            self._release_held()
            self._stream(self._detok.finish())

    @property
    def text(self) -> str:
        with self._out_lock:
            self._release_held()
            return "".join(self.text_parts)
