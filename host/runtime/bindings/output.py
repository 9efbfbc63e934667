"""An instance's output: free text and generated token ids, their byte budget, and the text
streamed to the client as the ids are decoded."""

from __future__ import annotations

import threading
from typing import Callable

from ..detok import Detokenizer
from ..errors import BudgetExceeded
from ..limits import flag


class Output:
    def __init__(self, engine, limit_bytes: int, on_text: Callable[[str], None] | None):
        self.engine = engine
        self.on_text = on_text
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
        with self._out_lock:
            self._emit_ids(ids)

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
