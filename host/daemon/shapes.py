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



class CompletionShape(_Shape):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def response(self, choices: list[tuple[str, str]], usage: dict) -> dict:
        """choices: (text, finish_reason) in index order."""
        return self._head(self.object) | {"choices": [self._choice(i, t, r) for i, (t, r) in enumerate(choices)],
                                          "usage": usage}

    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def first_chunk(self, index: int) -> dict | None:
        return None

    def delta_chunk(self, index: int, text: str) -> dict:
        return self.chunk(self._choice(index, text, None))

    def final_chunk(self, index: int, finish_reason: str) -> dict:
        return self.chunk(self._choice(index, "", finish_reason))


class ChatShape(_Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def response(self, choices: list[tuple[str, str]], usage: dict) -> dict:
        out = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason} for i, (text, reason) in enumerate(choices)]
        return self._head(self.object) | {"choices": out, "usage": usage}

    def _choice(self, index: int, delta: dict, finish_reason: str | None) -> dict:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def first_chunk(self, index: int) -> dict:
        return self.chunk(self._choice(index, {"role": "assistant", "content": ""}, None))

    def delta_chunk(self, index: int, text: str) -> dict:
        return self.chunk(self._choice(index, {"content": text}, None))

    def final_chunk(self, index: int, finish_reason: str) -> dict:
        return self.chunk(self._choice(index, {}, finish_reason))
