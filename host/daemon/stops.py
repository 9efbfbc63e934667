"""Stop strings: text is passed on only once it cannot be the start of a stop string."""

from __future__ import annotations


class StopCutter:
    """`push(text)` -> (text safe to send, whether a stop string was reached); the text is cut
    before the first stop string. `flush()` returns what was held back when the run ended.
    `end`: once a stop string is reached, the characters of generated text up to its end."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self._sent = 0  # characters passed on
        self.end: int | None = None

    def push(self, text: str) -> tuple[str, bool]:
        held = self._held + text
        if not self.stops:
            return held, False
        hits = [(i, -len(s)) for s, i in ((s, held.find(s)) for s in self.stops) if i >= 0]
        if hits:
            at, minus_len = min(hits)  # the first, and of those starting there the longest
            self._held = ""
            self.end = self._sent + at - minus_len
            return held[:at], True
        keep = self._partial(held)
        self._held = held[len(held) - keep:]
        self._sent += len(held) - keep
        return held[:len(held) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        for n in range(min(len(text), max(map(len, self.stops)) - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stops):
                return n
        return 0
