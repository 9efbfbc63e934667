"""Token logprobs as OpenAI's two endpoints answer them, and each token's text and bytes.

The values are the run's (host/engine/logprobs.py: the raw log-softmax of the target's row that
predicted the token). A streamed choice sends each token's logprob in the chunk whose text
completes the token (`Released`), so a client that joins the chunks' tokens gets the text.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from ..engine.logprobs import TokenLogprob
from ..runtime.detok import Detokenizer


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): the character that stands for each byte in a token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """A token id's text (its decode alone, as vLLM reports it) and its exact bytes: a byte-level
    token's own bytes (part of a UTF-8 sequence, maybe), else its text's UTF-8."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        got = self._cache.get(token)
        if got is None:
            text = self.tok.decode([token])
            piece = self.tok.convert_ids_to_tokens(token)
            table = _byte_of_char()
            if isinstance(piece, str) and piece and all(c in table for c in piece):
                raw = [table[c] for c in piece]
            else:
                raw = list(text.encode("utf-8"))
            got = self._cache[token] = (text, raw)
        return got


class Released:
    """One choice's logprobs, each given out once the text that completes its token has been
    sent: `add` as the run emits them, `take(sent)` with the characters of text sent so far,
    `rest(most)` at the end (the tokens that were given to the client, `most` in all).
    Each comes with the character offset where its token's text begins."""

    def __init__(self, tokenizer):
        self._detok = Detokenizer(tokenizer)
        self._chars = 0
        self._waiting: deque[tuple[int, int, TokenLogprob]] = deque()  # (start, end, logprob)
        self.given = 0

    def add(self, logprobs: list[TokenLogprob]) -> None:
        for lp in logprobs:
            start = self._chars
            self._chars += len(self._detok.push([lp.token]))
            self._waiting.append((start, self._chars, lp))

    def take(self, sent: int) -> list[tuple[int, TokenLogprob]]:
        out = []
        while self._waiting and self._waiting[0][1] <= sent:
            start, _, lp = self._waiting.popleft()
            out.append((start, lp))
        self.given += len(out)
        return out

    def rest(self, most: int) -> list[tuple[int, TokenLogprob]]:
        out = [(start, lp) for start, _, lp in self._waiting][:max(most - self.given, 0)]
        self._waiting.clear()
        self.given += len(out)
        return out


def chat_logprobs(entries: list[tuple[int, TokenLogprob]], top: int, texts: TokenTexts) -> dict:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    def one(token: int, value: float | None) -> dict:
        text, raw = texts(token)
        return {"token": text, "logprob": value, "bytes": raw}
    return {"content": [one(lp.token, lp.logprob) | {"top_logprobs": [one(t, v) for t, v in lp.top[:top]]}
                        for _, lp in entries], "refusal": None}


def completion_logprobs(entries: list[tuple[int, TokenLogprob]], top: int, texts: TokenTexts,
                        offset: int = 0) -> dict:
    """The legacy completions' `logprobs`: tokens, token_logprobs, top_logprobs (the `top` most
    likely and the chosen token, as vLLM gives them) and text_offset (`offset`: where the choice's
    text begins in what the client is sent)."""
    tops = []
    for _, lp in entries:
        if lp.logprob is None and not lp.top:  # an echoed prompt's first token: nothing predicts it
            tops.append(None)
            continue
        alts = {texts(t)[0]: v for t, v in lp.top[:top]}
        alts.setdefault(texts(lp.token)[0], lp.logprob)
        tops.append(alts)
    return {"tokens": [texts(lp.token)[0] for _, lp in entries],
            "token_logprobs": [lp.logprob for _, lp in entries],
            "top_logprobs": tops,
            "text_offset": [offset + start for start, _ in entries]}


@dataclass(frozen=True)
class Echo:
    """A completion's echoed prompt: its text and, when logprobs were asked for, its tokens'
    (offset, TokenLogprob), the first one's logprob None."""

    text: str
    entries: list | None

    @classmethod
    def of(cls, prompt: str | list[int], ids: list[int], scored: list | None, tokenizer) -> "Echo":
        text = prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=True)
        if scored is None:
            return cls(text, None)
        released = Released(tokenizer)  # the offsets a streamed choice's tokens get
        released.add([s if s is not None else TokenLogprob(t, None) for t, s in zip(ids, scored)])
        return cls(text, released.rest(len(ids)))
