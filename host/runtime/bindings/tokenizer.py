"""The WIT `tokenizer` interface: the model's tokenizer and chat template."""

from __future__ import annotations

from ...errors import InvalidArgument
from ..errors import Unsupported
from .core import Instance
from .wit import any_value, field, list_of, show, string, u32


class TokenizerCalls:
    NAME = "tokenizer"

    def __init__(self, inst: Instance):
        self.inst = inst

    def functions(self) -> dict:
        return {
            "encode": self.encode,
            "decode": self.decode,
            "apply-chat-template": self.apply_chat_template,
        }

    def encode(self, text: str) -> list[int]:
        return self.inst.engine.tokenizer.encode(string(text, "text"), add_special_tokens=False)

    def decode(self, tokens: list[int]) -> str:
        engine = self.inst.engine
        engine.check_ids(list_of(tokens, "tokens", u32))
        return engine.tokenizer.decode(tokens, skip_special_tokens=False)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool) -> str:
        engine = self.inst.engine
        tok = engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise Unsupported(f"model {engine.info.name} has no chat template")
        if type(add_generation_prompt) is not bool:
            raise InvalidArgument(f"add-generation-prompt must be a bool, not {show(add_generation_prompt)}")
        msgs = [{"role": string(field(m, "role", "a message"), "a message's role"),
                 "content": string(field(m, "content", "a message"), "a message's content")}
                for m in list_of(messages, "messages", any_value)]
        try:
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja raises its own exceptions for messages it rejects
            raise InvalidArgument(f"the chat template rejected the messages: {e}") from None
