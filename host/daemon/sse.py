"""Server-sent events as the server writes them, for the OpenAI streams, the inferlet API's
/events and the deployment's proxy alike (a module of its own: the proxy imports no server)."""

from __future__ import annotations

import json

DONE = "[DONE]"  # the last data line of an OpenAI stream


def data(obj: dict | str) -> str:
    """One unnamed event: `data: JSON` (or `data: [DONE]`), OpenAI's chunks."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def event(name: str, obj: dict) -> str:
    """One named event (the inferlet API's text, tokens, stats, return, error)."""
    return f"event: {name}\n{data(obj)}"
