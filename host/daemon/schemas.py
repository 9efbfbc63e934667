"""Request bodies of the OpenAI-compatible endpoints (pydantic). Fields this server does not
know are ignored, as OpenAI-compatible servers do; fields of OpenAI's API (and vLLM's sampling
extensions) it cannot honour yet are refused by `check_supported` when they ask for anything but
their neutral value (`NOT_HONOURED`): a request is never served as if they had not been sent. A `response_format` of `json_object` or
`json_schema` is served by the constrained-speculative-decoding inferlet (`json_schema_text`).
`inferlet` and `inferlet_args` are this server's extensions (the openai client sends them in
`extra_body`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from ..engine.logprobs import MAX_TOP
from .errors import BadRequest
from . import tools
from .tools import Tool, ToolCall


# the inferlet arguments a completion sets from its own fields (the prompt comes templated: no --chat)
SET_BY_REQUEST = frozenset({"--prompt", "--prompt-ids", "--chat", "--max-tokens", "--temperature", "--top-p", "--top-k",
                            "--min-p", "--logit-bias", "--presence-penalty", "--frequency-penalty",
                            "--repetition-penalty", "--seed"})


def utf8_len(text: str, param: str) -> int:
    """Its UTF-8 length; a lone surrogate (JSON's "\\ud800") is no text an inferlet or the tokenizer
    can take: 400."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise BadRequest(f"{param}: not valid Unicode text ({e.reason} at character {e.start})", param=param) from None


# field -> the values that ask for nothing (clients send them by default); any other value is 400
NOT_HONOURED: dict[str, tuple] = {
    "best_of": (1,), "suffix": ("",), "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],),
    "function_call": ("none", "auto"),
}  # tools and tool_choice: chat completions take them (ChatRequest); the legacy completions do not


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What both completions endpoints take. A null is the field's default, as in OpenAI's API."""

    model_config = ConfigDict(extra="allow")  # kept to check NOT_HONOURED; the rest is ignored

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: OpenAI's default, 1.0; 0 is greedy
    top_p: float | None = Field(None, gt=0, le=1)  # None: 1.0
    # vLLM's sampling extensions, in the one sampling rule (temperature, top-k, min-p, top-p)
    top_k: int | None = Field(None, ge=-1)  # None, 0 or -1: off
    min_p: float | None = Field(None, ge=0, le=1)  # None or 0: off
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as text) -> a bias in [-100, 100]
    # the one sampling rule's penalties: OpenAI's over the output, vLLM's (HF's) repetition over it all
    presence_penalty: float | None = Field(None, ge=-2, le=2)  # None or 0: off
    frequency_penalty: float | None = Field(None, ge=-2, le=2)  # None or 0: off
    repetition_penalty: float | None = Field(None, gt=0, le=2)  # None or 1: off (vLLM's range)

    def penalty_args(self) -> list[str]:
        """The inferlet's penalty arguments: only those that are on."""
        out = []
        for flag, value, off in (("--presence-penalty", self.presence_penalty, 0.0),
                                 ("--frequency-penalty", self.frequency_penalty, 0.0),
                                 ("--repetition-penalty", self.repetition_penalty, 1.0)):
            if value is not None and value != off:
                out += [flag, repr(float(value))]
        return out

    def bias_arg(self, vocab: int) -> list[str]:
        """--logit-bias for the inferlet, each id and bias checked."""
        if not self.logit_bias:
            return []
        if len(self.logit_bias) > 300:  # OpenAI's bound
            raise BadRequest(f"logit_bias holds {len(self.logit_bias)} entries; at most 300", param="logit_bias")
        items = []
        for key, value in self.logit_bias.items():
            if not key.isdigit() or int(key) >= vocab:
                raise BadRequest(f"logit_bias: {key!r} is not a token id of the vocabulary [0, {vocab})",
                                 param="logit_bias")
            if not -100 <= value <= 100:
                raise BadRequest(f"logit_bias: the bias {value} of token {key} is outside [-100, 100]",
                                 param="logit_bias")
            items.append(f"{int(key)}:{value!r}")
        return ["--logit-bias", ",".join(items)]
    seed: int | None = Field(None, ge=0, lt=2**64)  # the inferlet's seed is a u64
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)  # choices per prompt; None: 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: dict | None = None
    # extensions: the inferlet that serves this request (a built-in's or an upload's name, or a
    # sha256; None: the server's --default-inferlet) and arguments of its own
    inferlet: str | None = Field(None, min_length=1)
    inferlet_args: list[str] = []
    # extension: the answer's `metrics.speculative_decoding` (what speculation bought this request);
    # None: the server's default (pie serve --per-request-spec-decode-metrics)
    spec_decode_metrics: bool | None = None

    def extra_args(self, max_count: int) -> list[str]:
        """inferlet_args, refused where they would override what the request's own fields set."""
        if len(self.inferlet_args) > max_count:
            raise BadRequest(f"inferlet_args: {len(self.inferlet_args)} arguments exceed this server's limit of "
                             f"{max_count}", param="inferlet_args")
        for arg in self.inferlet_args:
            utf8_len(arg, "inferlet_args")
            flag = arg.partition("=")[0]
            if flag in SET_BY_REQUEST:
                raise BadRequest(f"inferlet_args: {flag} is set from the request's fields "
                                 f"({', '.join(sorted(SET_BY_REQUEST))} are not allowed here)", param="inferlet_args")
        return list(self.inferlet_args)

    def stops(self, max_count: int, max_chars: int) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > max_count:
            raise BadRequest(f"stop takes at most {max_count} sequences", param="stop")
        for s in stops:  # each is searched for in the text as it streams: bounded
            if len(s) > max_chars:
                raise BadRequest(f"a stop string of {len(s)} characters exceeds this server's limit of {max_chars}",
                                 param="stop")
            utf8_len(s, "stop")
        return [s for s in stops if s]

    def check_supported(self) -> None:
        extra = self.model_extra or {}
        for name, neutral in NOT_HONOURED.items():
            value = extra.get(name)
            if value is not None and not any(type(value) is not bool and value == v or value is v for v in neutral):
                raise BadRequest(f"{name}={_short(value)} is not supported by this server yet; leave it out (or send "
                                 f"{_short(neutral[0])}) rather than have it ignored", param=name,
                                 code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true", param="stream_options")

    def constraint(self) -> Constraint | None:
        """The grammar the output must follow, if any: the response_format's schema."""
        schema = self.json_schema_text()
        return None if schema is None else Constraint("--json-schema", "json-schema", schema, "response_format")

    def json_schema_text(self) -> str | None:
        """The JSON Schema the output must satisfy (OpenAI's response_format), or None for free text:
        `json_object` is any JSON object; `json_schema` carries {"name", "schema", "strict"}."""
        fmt = self.response_format
        kind = "text" if fmt is None else fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return json.dumps({"type": "object"})
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise BadRequest("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                                 param="response_format")
            return json.dumps(schema)
        raise BadRequest(f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                         param="response_format", code="unsupported_value")

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def logprobs_top(self) -> int | None:
        """How many alternatives each token's logprob carries; None: no logprobs asked for."""
        return None


@dataclass(frozen=True)
class Constraint:
    """A grammar a request's output must follow, as the constrained inferlet takes it."""

    flag: str  # the inferlet's argument
    kind: str  # the grammar engine's kind (host/grammar)
    source: str
    param: str  # the request field it came from, for errors


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


class CompletionRequest(SamplingRequest):
    # text, a batch of texts, one prompt's token ids, or a batch of those (OpenAI's four forms)
    prompt: str | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    # each token's logprob and this many alternatives (OpenAI allows 5; vLLM, as here, 20)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
    echo: bool | None = False  # the prompt before the completion (with logprobs: the prompt's too)
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt's logprobs alone (lm-eval's loglikelihood)

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens=0 asks for nothing unless echo=true (the prompt's logprobs)",
                             param="max_tokens")

    def logprobs_top(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch (one for a plain prompt), in order."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise BadRequest("prompt is an empty list", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = ""  # None: an assistant turn that only called tools
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None  # none, auto, required, or {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:  # as OpenAI answers it
            raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")

    def logprobs_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_mode(self) -> tuple[str, str | None]:
        """(none | auto | required, the function a named tool_choice names)."""
        return tools.choice_mode(self.tools, self.tool_choice)

    def offered(self) -> list[Tool] | None:
        """The tools the model may call (none under tool_choice none)."""
        return self.tools if self.tools and self.tool_mode()[0] != "none" else None

    def constraint(self) -> Constraint | None:
        mode, name = self.tool_mode()
        if mode == "none" or not self.tools:
            return super().constraint()
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise BadRequest("tools and a response_format cannot be combined yet; send one of them",
                             param="response_format", code="unsupported_value")
        lark = tools.grammar(self.tools, mode, name, self.parallel_tool_calls is not False)
        return Constraint("--grammar", "lark", lark, "tools")

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
