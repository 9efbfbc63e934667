"""OpenAI's response and stream-chunk shapes for completions and chat completions."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from . import tools
from .logprobs import Echo, TokenTexts, chat_logprobs, completion_logprobs


@dataclass(frozen=True)
class Delta:
    """A choice's next text, and the logprobs of the tokens it completes: (offset of the token's
    text in the choice's, TokenLogprob), or None when the request asked for none."""

    text: str
    logprobs: list | None = None


@dataclass(frozen=True)
class Ended:
    """A choice has ended; its text is complete. `limit`: the limit that ended it, if one did."""

    finish_reason: str
    limit: str | None = None


class _Shape:
    object: str
    chunk_object: str
    id_prefix: str

    def __init__(self, model: str, include_usage: bool = False, logprobs: int | None = None,
                 texts: TokenTexts | None = None):
        """logprobs: the alternatives each token's logprob carries (None: the request asked for
        none); texts: the tokens' texts (with logprobs)."""
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.texts = texts

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, choice: dict | None) -> dict:
        out = self._head(self.chunk_object) | {"choices": [] if choice is None else [choice]}
        if self.include_usage:  # OpenAI: null in every chunk but the last, which holds the usage alone
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict) -> dict:
        return self.chunk(None) | {"usage": usage}



class CompletionShape(_Shape):
    """`echoes`: with `echo`, each choice's prompt (Service.echoes), sent before its text."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.echoes: list[Echo] | None = None
        self._shift: dict[int, int] = {}  # a streamed choice -> its echoed prompt's length

    def response(self, choices: list[tuple[str, Ended, list | None]], usage: dict) -> dict:
        """choices: (text, how it ended, its logprobs) in index order."""
        out = []
        for i, (text, end, logprobs) in enumerate(choices):
            echo = self.echoes[i] if self.echoes else None
            if echo is not None:
                shift = len(echo.text)
                text, logprobs = echo.text + text, (echo.entries or []) + [(at + shift, lp) for at, lp in logprobs or []]
            out.append(self._choice(i, text, end, logprobs))
        return self._head(self.object) | {"choices": out, "usage": usage}

    def _choice(self, index: int, text: str, end: Ended | None, logprobs: list | None = None) -> dict:
        lp = None if self.logprobs is None else completion_logprobs(logprobs or [], self.logprobs, self.texts)
        return _ended({"index": index, "text": text, "logprobs": lp}, end)

    def _echo(self, index: int) -> list[dict]:
        """The chunk of choice `index`'s prompt, before its first text."""
        if not self.echoes or index in self._shift:
            return []
        echo = self.echoes[index]
        self._shift[index] = len(echo.text)
        return [self.chunk(self._choice(index, echo.text, None, echo.entries))]

    def deltas(self, index: int, delta: Delta) -> list[dict]:
        """The chunks for choice `index`'s next text."""
        out = self._echo(index)
        shift = self._shift.get(index, 0)
        lps = None if delta.logprobs is None else [(at + shift, lp) for at, lp in delta.logprobs]
        return out + [self.chunk(self._choice(index, delta.text, None, lps))]

    def ends(self, index: int, end: Ended) -> list[dict]:
        """The chunks that end choice `index`."""
        return self._echo(index) + [self.chunk(self._choice(index, "", end))]


class ChatShape(_Shape):
    """`calling`: the request offered tools (tools.py), so an output that is calls is answered as
    `tool_calls` with finish_reason "tool_calls". Streamed, a choice's calls come as OpenAI streams
    them (tools.CallStream: each call's name, then its arguments as they are generated); its first
    character tells calls from text."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model: str, include_usage: bool = False, calling: bool = False, logprobs: int | None = None,
                 texts: TokenTexts | None = None):
        super().__init__(model, include_usage, logprobs, texts)
        self.calling = calling
        self._began: set[int] = set()  # choices whose first chunk (the role) is out
        self._began_text: set[int] = set()  # choices that have streamed some text
        self._calls: dict[int, tools.CallStream] = {}  # choices that are calls, as they stream
        self._held_logprobs: dict[int, list] = {}  # logprobs of their tokens not sent yet

    def response(self, choices: list[tuple[str, Ended, list | None]], usage: dict) -> dict:
        out = []
        for i, (text, end, logprobs) in enumerate(choices):
            calls = self.calling and tools.is_call(text)
            if calls:
                message = {"role": "assistant", "content": None, "tool_calls": tools.parse(text)}
            else:
                message = {"role": "assistant", "content": text}
            out.append(_ended({"index": i, "message": message, "logprobs": self._logprobs(logprobs)},
                              self._end(calls, end)))
        return self._head(self.object) | {"choices": out, "usage": usage}

    def _logprobs(self, entries: list | None) -> dict | None:
        return None if self.logprobs is None else chat_logprobs(entries or [], self.logprobs, self.texts)

    def _end(self, calls: bool, end: Ended) -> Ended:
        """A choice of calls the grammar let finish ends with "tool_calls", as OpenAI's."""
        if calls and end.finish_reason == "stop" and end.limit is None:
            return Ended("tool_calls")
        return end

    def _choice(self, index: int, delta: dict, end: Ended | None, logprobs: list | None = None) -> dict:
        lp = self._logprobs(logprobs) if logprobs else None  # a chunk without tokens carries none, as OpenAI's
        return _ended({"index": index, "delta": delta, "logprobs": lp}, end)

    def _begin(self, index: int) -> list[dict]:
        if index in self._began:
            return []
        self._began.add(index)
        return [self.chunk(self._choice(index, {"role": "assistant", "content": ""}, None))]

    def deltas(self, index: int, delta: Delta) -> list[dict]:
        out = self._begin(index)
        text = delta.text
        if index in self._calls or (self.calling and index not in self._began_text and tools.is_call(text)):
            held = self._held_logprobs.setdefault(index, [])
            held.extend(delta.logprobs or [])
            calls = self._calls.setdefault(index, tools.CallStream()).push(text)
            if calls:
                out.append(self.chunk(self._choice(index, {"tool_calls": calls}, None, held if held else None)))
                self._held_logprobs[index] = []
        elif text or delta.logprobs:
            out.append(self.chunk(self._choice(index, {"content": text}, None, delta.logprobs)))
        if text:
            self._began_text.add(index)
        return out

    def ends(self, index: int, end: Ended) -> list[dict]:
        out = self._begin(index)
        calls = self._calls.pop(index, None) is not None  # a call cut by the limit has streamed what it had
        held = self._held_logprobs.pop(index, None)
        out.append(self.chunk(self._choice(index, {}, self._end(calls, end), held)))
        return out


def _ended(choice: dict, end: Ended | None) -> dict:
    """finish_reason (null while the choice runs), and this server's extension `limit`: the
    message of the limit that ended it, when one did (finish_reason is then "length")."""
    choice["finish_reason"] = None if end is None else end.finish_reason
    if end is not None and end.limit is not None:
        choice["limit"] = end.limit
    return choice
