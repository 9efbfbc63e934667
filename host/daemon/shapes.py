"""OpenAI's response and stream-chunk shapes for completions and chat completions."""

from __future__ import annotations

import json
import time
import uuid


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

    def first_chunk(self) -> dict | None:
        return None


class CompletionShape(_Shape):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def response(self, text: str, finish_reason: str, usage: dict) -> dict:
        return self._head(self.object) | {"choices": [self._choice(text, finish_reason)], "usage": usage}

    def _choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def delta_chunk(self, text: str) -> dict:
        return self.chunk(self._choice(text, None))

    def final_chunk(self, finish_reason: str) -> dict:
        return self.chunk(self._choice("", finish_reason))


class ChatShape(_Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def response(self, text: str, finish_reason: str, usage: dict) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        return self._head(self.object) | {"choices": [choice], "usage": usage}

    def _choice(self, delta: dict, finish_reason: str | None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def first_chunk(self) -> dict:
        return self.chunk(self._choice({"role": "assistant", "content": ""}, None))

    def delta_chunk(self, text: str) -> dict:
        return self.chunk(self._choice({"content": text}, None))

    def final_chunk(self, finish_reason: str) -> dict:
        return self.chunk(self._choice({}, finish_reason))
