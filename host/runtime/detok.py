"""Incremental detokenisation: the text that streams to the client as token ids are committed."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    """`push(ids)` returns the new text (possibly ''); `finish()` returns what was held back.

    A tokenizer with a Rust backend and no clean-up pass streams through tokenizers'
    DecodeStream: one call per token in Rust, against two Python-level decodes per push
    otherwise (the prefix method vLLM uses). Both hold back an incomplete UTF-8 sequence
    until its last byte arrives; `finish` flushes it as the full decode has it.
    """

    def __init__(self, tokenizer):
        self._tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._emitted = 0  # characters returned so far
        # the prefix method: text of _ids[_prefix:_read] is already returned; decoding from
        # _prefix keeps a merge across the boundary (spaces, UTF-8) right
        self._prefix = self._read = 0

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        if self._stream is not None:
            parts = [self._stream.step(self._backend, i) for i in ids]
            text = "".join(p for p in parts if p)
        else:
            text = self._diff(final=False)
        self._emitted += len(text)
        return text

    def finish(self) -> str:
        if self._stream is None:
            return self._diff(final=True)
        full = self._tok.decode(self._ids, skip_special_tokens=True)
        rest, self._emitted = full[self._emitted:], len(full)
        return rest

    def _diff(self, final: bool) -> str:
        decode = self._tok.decode
        seen = decode(self._ids[self._prefix:self._read], skip_special_tokens=True)
        text = decode(self._ids[self._prefix:], skip_special_tokens=True)
        if len(text) > len(seen) and (final or not text.endswith("\ufffd")):  # else: an incomplete UTF-8 sequence
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(seen):]
        return ""
