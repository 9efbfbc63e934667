"""OpenAI's response and stream-chunk shapes for completions and chat completions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from . import tools


@dataclass(frozen=True)
class Ended:
    """A choice has ended; its text is complete. `limit`: the limit that ended it, if one did."""

    finish_reason: str
    limit: str | None = None


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: JSON` (or `data: [DONE]`)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class _Shape:
    object: str
    chunk_object: str
    id_prefix: str

    def __init__(self, model: str, include_usage: bool = False):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

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
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def response(self, choices: list[tuple[str, Ended]], usage: dict) -> dict:
        """choices: (text, how it ended) in index order."""
        return self._head(self.object) | {"choices": [self._choice(i, t, e) for i, (t, e) in enumerate(choices)],
                                          "usage": usage}

    def _choice(self, index: int, text: str, end: Ended | None) -> dict:
        return _ended({"index": index, "text": text, "logprobs": None}, end)

    def deltas(self, index: int, text: str) -> list[dict]:
        """The chunks for choice `index`'s next text."""
        return [self.chunk(self._choice(index, text, None))]

    def ends(self, index: int, end: Ended) -> list[dict]:
        """The chunks that end choice `index`."""
        return [self.chunk(self._choice(index, "", end))]


class ChatShape(_Shape):
    """`calling`: the request offered tools (tools.py), so an output that is calls is answered as
    `tool_calls` with finish_reason "tool_calls". Streamed, a choice's calls come whole in one
    delta once it ends (its text is held from its first character, which tells calls apart)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model: str, include_usage: bool = False, calling: bool = False):
        super().__init__(model, include_usage)
        self.calling = calling
        self._began: set[int] = set()  # choices whose first chunk (the role) is out
        self._began_text: set[int] = set()  # choices that have streamed some text
        self._held: dict[int, list[str]] = {}  # the text of choices that are calls

    def response(self, choices: list[tuple[str, Ended]], usage: dict) -> dict:
        out = []
        for i, (text, end) in enumerate(choices):
            if self.calling and tools.is_call(text):
                message = {"role": "assistant", "content": None, "tool_calls": tools.parse(text)}
            else:
                message = {"role": "assistant", "content": text}
            out.append(_ended({"index": i, "message": message, "logprobs": None}, self._end(text, end)))
        return self._head(self.object) | {"choices": out, "usage": usage}

    def _end(self, text: str, end: Ended) -> Ended:
        """A choice of calls the grammar let finish ends with "tool_calls", as OpenAI's."""
        if self.calling and end.finish_reason == "stop" and end.limit is None and tools.is_call(text):
            return Ended("tool_calls")
        return end

    def _choice(self, index: int, delta: dict, end: Ended | None) -> dict:
        return _ended({"index": index, "delta": delta, "logprobs": None}, end)

    def _begin(self, index: int) -> list[dict]:
        if index in self._began:
            return []
        self._began.add(index)
        return [self.chunk(self._choice(index, {"role": "assistant", "content": ""}, None))]

    def deltas(self, index: int, text: str) -> list[dict]:
        out = self._begin(index)
        if index in self._held or (self.calling and index not in self._began_text and tools.is_call(text)):
            self._held.setdefault(index, []).append(text)
        elif text:
            out.append(self.chunk(self._choice(index, {"content": text}, None)))
        if text:
            self._began_text.add(index)
        return out

    def ends(self, index: int, end: Ended) -> list[dict]:
        out = self._begin(index)
        text = "".join(self._held.pop(index, []))
        if text:
            calls = [{"index": k, **c} for k, c in enumerate(tools.parse(text))]
            out.append(self.chunk(self._choice(index, {"tool_calls": calls} if calls else {"content": text}, None)))
        out.append(self.chunk(self._choice(index, {}, self._end(text, end))))
        return out


def _ended(choice: dict, end: Ended | None) -> dict:
    """finish_reason (null while the choice runs), and this server's extension `limit`: the
    message of the limit that ended it, when one did (finish_reason is then "length")."""
    choice["finish_reason"] = None if end is None else end.finish_reason
    if end is not None and end.limit is not None:
        choice["limit"] = end.limit
    return choice
