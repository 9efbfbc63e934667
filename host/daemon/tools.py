"""Tool calling: the tools a chat request offers, as a grammar the output must follow, rendered
into the prompt, and the output parsed back into OpenAI's `tool_calls`.

A call is written `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the format of
Hermes and Qwen templates); several calls are separated by a newline. The grammar (llguidance
Lark, with each tool's JSON Schema inlined) makes every call parse and validate: `required` and a
named function allow only calls, `auto` a plain answer or calls (a plain answer cannot begin with
`<`, so the first character tells them apart), `none` (or no tools) no grammar at all.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..grammar.matcher import JSON_STYLE
from .errors import BadRequest

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]+)", "arguments": ')  # a call's body up to its arguments (JSON_STYLE)


class FunctionDef(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema; None: no arguments
    strict: bool | None = None  # calls always follow the schema here, strict or not


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class CallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call in an assistant message of the conversation (a previous turn's)."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction


def choice_mode(tools: list[Tool] | None, tool_choice) -> tuple[str, str | None]:
    """(mode, the named function's name): mode is none, auto or required (a named function is
    required with one tool). OpenAI's default is auto with tools, none without."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise BadRequest(f"tool_choice must be none, auto, required or a named function, not {tool_choice!r}",
                             param="tool_choice")
        if tool_choice != "none" and not tools:
            raise BadRequest(f"tool_choice={tool_choice!r} needs tools", param="tool_choice")
        return tool_choice, None
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise BadRequest("a named tool_choice is {'type': 'function', 'function': {'name': NAME}}", param="tool_choice")
    if name not in {t.function.name for t in tools or []}:
        raise BadRequest(f"tool_choice names {name!r}, which is not one of the tools", param="tool_choice")
    return "required", name


def grammar(tools: list[Tool], mode: str, name: str | None, parallel: bool) -> str:
    """The Lark grammar of the output (mode auto or required)."""
    offered = [t for t in tools if name is None or t.function.name == name]
    names = [t.function.name for t in offered]
    if len(set(names)) != len(names):
        raise BadRequest("two tools share a name", param="tools")
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name},
                             "arguments": t.function.parameters or {"type": "object", "properties": {}}}}
             for t in offered]
    schema = {"anyOf": calls, "x-guidance": JSON_STYLE}
    start = "calls" if mode == "required" else "TEXT | calls"
    many = ' ("\\n" call)*' if parallel and name is None else ""  # a named function: exactly one call, as OpenAI
    return "\n".join([f"start: {start}", f"calls: call{many}", f"call: {json.dumps(OPEN)} body {json.dumps(CLOSE)}",
                      f"body: %json {json.dumps(schema)}", r"TEXT: /[^<][\s\S]*/"])


def system_text(tools: list[Tool]) -> str:
    """How tools are shown to a model whose chat template has no tool support (the default
    rendering): a system message, after the request's own system text."""
    lines = [json.dumps(t.function.model_dump(exclude_none=True), ensure_ascii=False) for t in tools]
    return ("You can call these tools. To call one, answer with nothing but\n"
            f'{OPEN}{{"name": "TOOL_NAME", "arguments": {{...}}}}{CLOSE}\n'
            "one such block per call, one call per line. Tools:\n" + "\n".join(lines))


def render_calls(calls: list[ToolCall]) -> str:
    """A previous turn's calls as the model writes them."""
    out = []
    for c in calls:
        try:
            args = json.loads(c.function.arguments)
        except ValueError:
            raise BadRequest(f"tool call {c.function.name!r}: arguments are not JSON", param="messages") from None
        out.append(OPEN + json.dumps({"name": c.function.name, "arguments": args}, ensure_ascii=False) + CLOSE)
    return "\n".join(out)


def is_call(text: str) -> bool:
    return text.startswith("<")


def parse(text: str) -> list[dict]:
    """The calls the output holds, in OpenAI's shape; a call cut short by max_tokens is left out."""
    calls = []
    for m in _CALL.finditer(text):
        try:
            body = json.loads(m.group(1))
        except ValueError:  # only a call cut at its end can fail: the grammar made the rest
            continue
        calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": body["name"], "arguments": json.dumps(body["arguments"],
                                                                                 ensure_ascii=False)}})
    return calls


class CallStream:
    """One choice's calls as OpenAI streams them, from the output's text as it is generated: a
    call's first delta names it (with its id), the next ones carry its arguments' JSON text as it
    comes. The grammar fixes the body's shape (`{"name": ..., "arguments": ...}` in JSON_STYLE),
    so the arguments are what lies between the head and the `}` before CLOSE (a JSON string holds
    no raw newline, so CLOSE never occurs inside them)."""

    def __init__(self):
        self._text = ""  # generated text not yet turned into deltas
        self._index = -1  # the call being streamed
        self._in_arguments = False

    def push(self, text: str) -> list[dict]:
        """The deltas (OpenAI's `delta.tool_calls` entries) that `text`, appended, completes."""
        self._text += text
        out = []
        while True:
            if not self._in_arguments:
                start = self._text.find(OPEN)
                head = _HEAD.match(self._text, start + len(OPEN)) if start >= 0 else None
                if head is None:
                    return out
                self._index += 1
                out.append({"index": self._index, "id": f"call_{secrets.token_hex(12)}", "type": "function",
                            "function": {"name": head.group(1), "arguments": ""}})
                self._text, self._in_arguments = self._text[head.end():], True
            end = self._text.find(CLOSE)
            if end < 0:  # all but what may be the body's "}" and the start of CLOSE
                ready = len(self._text) - len(CLOSE)
                if ready > 0:
                    out.append(self._arguments(self._text[:ready]))
                    self._text = self._text[ready:]
                return out
            if end > 1:  # the arguments' rest, without the body's closing "}"
                out.append(self._arguments(self._text[:end - 1]))
            self._text, self._in_arguments = self._text[end + len(CLOSE):], False

    def _arguments(self, text: str) -> dict:
        return {"index": self._index, "function": {"arguments": text}}
