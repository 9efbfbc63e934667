"""Stop strings: text is passed on only once it cannot be the start of a stop string."""

from __future__ import annotations


class StopCutter:
    """`push(text)` -> (text safe to send, whether a stop string was reached); the text is cut
    before the first stop string. `flush()` returns what was held back when the run ended."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        held = self._held + text
        if not self.stops:
            return held, False
        hits = [i for i in (held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return held[:min(hits)], True
        keep = self._partial(held)
        self._held = held[len(held) - keep:]
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
