"""What one server holds (the runtime, its model, instances and metrics) and how an OpenAI
request becomes the inferlet's arguments."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from ..runtime.cli import BUILD
from ..runtime.runtime import Runtime
from ..store import pie_home
from .errors import BadRequest, UnknownModel
from .instances import Generation, Instances
from .metrics import Metrics
from .programs import Programs
from .runs import Runs
from .schemas import ChatMessage, SamplingRequest


@dataclass(frozen=True)
class ServeConfig:
    inferlet: Path  # the .wasm that serves completions (text-completion by default)
    max_instances: int = 8  # OpenAI requests and launched inferlets together
    api_keys: list[str] | None = None  # None: no authentication
    builtin_dir: Path = BUILD  # the built inferlets the inferlet API lists and launches by name
    upload_dir: Path | None = None  # None: $PIE_HOME/inferlets
    max_upload_bytes: int = 64 << 20


class Service:
    def __init__(self, runtime: Runtime, config: ServeConfig):
        self.runtime = runtime
        self.engine = runtime.engine
        self.config = config
        self.model = self.engine.info.name
        self.metrics = Metrics(self.model)
        self.instances = Instances(runtime, config.inferlet, config.max_instances, self.metrics)
        self.programs = Programs(runtime, config.builtin_dir, config.upload_dir or pie_home() / "inferlets",
                                 config.max_upload_bytes)
        self.runs = Runs(self.instances)

    def check_model(self, name: str) -> None:
        if name != self.model:
            raise UnknownModel(f"the model {name!r} does not exist; this server serves {self.model!r}",
                               param="model")

    def render_chat(self, messages: list[ChatMessage]) -> str:
        """All messages in the model's chat template, with the assistant's turn opened. For one
        user message this is the text `--chat` renders inside the inferlet (the same bindings
        call), so the tokens match `pie run text-completion --chat`; for a conversation it keeps
        the system message and earlier turns, which `--chat` on the last message would drop."""
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise BadRequest(f"model {self.model} has no chat template; use /v1/completions", param="messages")
        # "developer" is OpenAI's newer name for the system role; templates know "system"
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
        try:
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja raises its own exceptions for conversations a template rejects
            raise BadRequest(f"the chat template rejected the messages: {e}", param="messages") from None

    def generate(self, req: SamplingRequest, prompt: str, max_tokens: int | None) -> Generation:
        """Start the inferlet on `prompt` (already templated: passed without --chat)."""
        self.check_model(req.model)
        req.check_supported()
        stops = req.stops()
        # the same encoding as the inferlet's (the bindings' encode): the prompt's token count
        n_prompt = len(self.engine.tokenizer.encode(prompt, add_special_tokens=False))
        if n_prompt == 0:
            raise BadRequest("the prompt is empty", param="prompt")
        room = self.engine.info.context_len - n_prompt
        if max_tokens is None:
            max_tokens = room  # as vLLM: up to the end of the context
        if max_tokens > room or room < 1:
            raise BadRequest(f"the prompt's {n_prompt} tokens and max_tokens={max_tokens} exceed the model's context "
                             f"of {self.engine.info.context_len} tokens", param="max_tokens",
                             code="context_length_exceeded")
        seed = req.seed if req.seed is not None else secrets.randbits(63)  # unseeded requests differ
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        args = ["--prompt", prompt, "--max-tokens", str(max_tokens), "--temperature", repr(temperature),
                "--top-p", repr(top_p), "--seed", str(seed)]
        return self.instances.start(args, prompt_tokens=n_prompt, stops=stops)
