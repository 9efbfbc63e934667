"""OpenAI's response and stream-chunk shapes for completions and chat completions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass


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

    def first_chunk(self, index: int) -> dict | None:
        return None

    def delta_chunk(self, index: int, text: str) -> dict:
        return self.chunk(self._choice(index, text, None))

    def final_chunk(self, index: int, end: Ended) -> dict:
        return self.chunk(self._choice(index, "", end))


class ChatShape(_Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def response(self, choices: list[tuple[str, Ended]], usage: dict) -> dict:
        out = [_ended({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None}, end)
               for i, (text, end) in enumerate(choices)]
        return self._head(self.object) | {"choices": out, "usage": usage}

    def _choice(self, index: int, delta: dict, end: Ended | None) -> dict:
        return _ended({"index": index, "delta": delta, "logprobs": None}, end)

    def first_chunk(self, index: int) -> dict:
        return self.chunk(self._choice(index, {"role": "assistant", "content": ""}, None))

    def delta_chunk(self, index: int, text: str) -> dict:
        return self.chunk(self._choice(index, {"content": text}, None))

    def final_chunk(self, index: int, end: Ended) -> dict:
        return self.chunk(self._choice(index, {}, end))


def _ended(choice: dict, end: Ended | None) -> dict:
    """finish_reason (null while the choice runs), and this server's extension `limit`: the
    message of the limit that ended it, when one did (finish_reason is then "length")."""
    choice["finish_reason"] = None if end is None else end.finish_reason
    if end is not None and end.limit is not None:
        choice["limit"] = end.limit
    return choice
