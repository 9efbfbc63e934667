"""Request bodies of the OpenAI-compatible endpoints (pydantic). Fields this server does not
know are ignored, as OpenAI-compatible servers do; fields it knows but cannot honour yet
(`n` other than 1, a `response_format` other than text) are refused by `check_supported`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import BadRequest


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What both completions endpoints take. A null is the field's default, as in OpenAI's API."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: OpenAI's default, 1.0; 0 is greedy
    top_p: float | None = Field(None, gt=0, le=1)  # None: 1.0
    seed: int | None = Field(None, ge=0, lt=2**64)  # the inferlet's seed is a u64
    stop: str | list[str] | None = None
    n: int | None = None  # None: 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: dict | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:  # OpenAI's limit
            raise BadRequest("stop takes at most 4 sequences", param="stop")
        return [s for s in stops if s]

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise BadRequest(f"n={self.n} is not supported: this server returns one choice per request (n=1)",
                             param="n", code="unsupported_value")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise BadRequest("response_format is not supported yet: constrained (JSON) decoding has no inferlet "
                             "in this server", param="response_format", code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true", param="stream_options")

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[str]

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise BadRequest("a list prompt must hold exactly one string (batched prompts are not supported)",
                             param="prompt", code="unsupported_value")
        return self.prompt[0]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = ""

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
