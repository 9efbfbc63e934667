"""llguidance behind the product's names: a Grammars per model tokenizer compiles JSON Schemas,
regexes and Lark grammars (cached by content); a Matcher follows one sequence through a grammar.

Nothing here is a grammar engine: parsing, token masks, forced tokens and rollback are
llguidance's. What is ours: the error messages, the cache, the bookkeeping that lets the
epilogue's ops (host/epilogue/ops/grammar.py) use a matcher for a window of drafts."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from enum import Enum
from typing import Sequence

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from ..errors import InvalidArgument

MAX_SOURCE_BYTES = 1 << 20  # a grammar's text
MAX_CACHED = 256  # compiled grammars kept per tokenizer
NOT_COMMITTED = -1  # Matcher.committed_at before the first commit
# JSON as json.dumps writes it: one way to space it makes punctuation and known keys forced
# tokens (drafted for free); a schema's own "x-guidance" options override this.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(InvalidArgument):
    """A bad schema, regex or grammar (the engine's message), or a token the grammar forbids."""


class Kind(str, Enum):
    """What a grammar's text is (WIT `grammars.grammar-kind`)."""

    JSON_SCHEMA = "json-schema"
    REGEX = "regex"
    LARK = "lark"


def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer: a fast Hugging Face tokenizer, or any object
    with `grammar_tokens()` (each id's bytes; the tests' tiny models)."""
    eos = list(eos_ids) or None
    if hasattr(tokenizer, "backend_tokenizer"):
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    if hasattr(tokenizer, "grammar_tokens"):
        tokens = list(tokenizer.grammar_tokens())
        for e in eos or ():  # llguidance reads a leading 0xff as "special": EOS is no text any grammar matches
            if e < len(tokens) and not tokens[e].startswith(b"\xff"):
                tokens[e] = b"\xff" + tokens[e]
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(tokens, eos[0])),
                                      n_vocab=vocab_size, eos_token=eos)
    raise GrammarError(f"this model's tokenizer ({type(tokenizer).__name__}) is not one the grammar engine reads")


class _ByteTokens:
    """The minimal tokenizer llguidance's TokenizerWrapper wraps: token bytes and a greedy encoder."""

    def __init__(self, tokens: list[bytes], eos: int):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self._ids = {t: i for i, t in enumerate(tokens) if t and i != eos}

    def __call__(self, s):
        data = s if isinstance(s, bytes) else s.encode("utf-8")
        out, i = [], 0
        while i < len(data):
            for j in range(len(data), i, -1):
                if data[i:j] in self._ids:
                    out.append(self._ids[data[i:j]])
                    i = j
                    break
            else:
                raise ValueError(f"byte {data[i]} has no token")
        return out


class Grammars:
    """The grammar engine for one model: llguidance's tokenizer (built on first use, ~0.3 s) and
    the compiled grammars, cached by (kind, text)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self._tokenizer, self._eos = tokenizer, list(eos_ids)
        self._ll: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def _llt(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            self._ll = _ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
        return self._ll

    def compile(self, kind: Kind | str, source: str) -> "Grammar":
        """A compiled grammar; the same text returns the cached one. GrammarError with the
        engine's message for a bad schema, regex or grammar."""
        try:
            kind = Kind(kind)
        except ValueError:
            raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {[k.value for k in Kind]}") from None
        if not isinstance(source, str):
            raise GrammarError("a grammar's source must be text")
        if len(source.encode("utf-8", "surrogatepass")) > MAX_SOURCE_BYTES:
            raise GrammarError(f"the grammar's text is longer than {MAX_SOURCE_BYTES} bytes")
        digest = hashlib.sha256(f"{kind.value}\0{source}".encode("utf-8", "surrogatepass")).hexdigest()
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None:
                self._cache.move_to_end(digest)
                return hit
            grammar = Grammar(digest, kind, self._template(kind, source), self.vocab_size, self._eos)
            self._cache[digest] = grammar
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
            return grammar

    def _template(self, kind: Kind, source: str) -> llguidance.LLMatcher:
        what = {Kind.JSON_SCHEMA: "JSON schema", Kind.REGEX: "regex", Kind.LARK: "Lark grammar"}[kind]
        if kind is Kind.JSON_SCHEMA:
            try:
                schema = json.loads(source)
            except (ValueError, RecursionError) as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be an object or a boolean")
            spec = self._json_grammar(schema)
        elif kind is Kind.REGEX:
            spec = llguidance.LLMatcher.grammar_from_regex(source)
        else:
            spec = llguidance.LLMatcher.grammar_from_lark(source)
        llt = self._llt()
        problem = llguidance.LLMatcher.validate_grammar(spec, llt)
        if problem:
            raise GrammarError(f"bad {what}: {problem.strip()}")
        m = llguidance.LLMatcher(llt, spec, log_level=0)
        if m.is_error():
            raise GrammarError(f"bad {what}: {m.get_error().strip()}")
        return m


    def _json_grammar(self, schema) -> str:
        """llguidance's grammar for a schema. A `format` it does not know is dropped: JSON Schema
        makes formats annotations that validators ignore unless they know them (jsonschema does)."""
        for _ in range(16):
            try:
                spec = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
            except ValueError as e:
                raise GrammarError(f"bad JSON schema: {e}") from None
            problem = llguidance.LLMatcher.validate_grammar(spec, self._llt())
            unknown = problem.strip().removeprefix("Unknown format: ") if problem.startswith("Unknown format: ") else None
            if not unknown or "\n" in unknown:
                return spec
            schema = _drop_format(schema, unknown)
        return spec


def _drop_format(node, name: str):
    if isinstance(node, dict):
        return {k: _drop_format(v, name) for k, v in node.items() if not (k == "format" and v == name)}
    if isinstance(node, list):
        return [_drop_format(v, name) for v in node]
    return node


class Grammar:
    """A compiled grammar: a fresh matcher is a copy of its template (no recompilation)."""

    def __init__(self, digest: str, kind: Kind, template: llguidance.LLMatcher, vocab_size: int, eos_ids: list[int]):
        self.digest, self.kind, self.vocab_size, self.eos_ids = digest, kind, vocab_size, eos_ids
        self._template = template

    def matcher(self) -> "Matcher":
        return Matcher(self._template.deep_copy(), self.vocab_size, self.eos_ids)


_EXECUTOR: llguidance.LLExecutor | None = None


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor(num_threads=max(1, min(4, os.cpu_count() or 1)))
    return _EXECUTOR


class Matcher:
    """One sequence's place in a grammar: the tokens it has consumed since its start.

    The epilogue's ops use `window_masks` and `commit` (the GrammarMatcher protocol of
    host/epilogue/env.py); the guest's WIT calls use the rest."""

    def __init__(self, ll: llguidance.LLMatcher, vocab_size: int, eos_ids: list[int]):
        self._ll, self.vocab_size, self.eos_ids = ll, vocab_size, eos_ids
        self.consumed = 0  # tokens consumed since the start: the most rollback can undo
        self.ended = False  # an EOS was consumed: nothing more is (llguidance records no second EOS)
        self.committed_at = NOT_COMMITTED  # the window position of the last epilogue commit

    def _check(self) -> None:
        if self._ll.is_error():
            raise GrammarError(f"the grammar matcher failed: {self._ll.get_error().strip()}")

    # --- the guest's calls ---------------------------------------------------------------
    def accept(self, tokens: Sequence[int]) -> int:
        """Consume the longest allowed prefix of `tokens`; returns its length."""
        self._check()
        tokens = list(tokens)
        if self.ended:
            return 0
        n = self._ll.try_consume_tokens(tokens)
        if n < len(tokens) and tokens[n] in self.eos_ids and self._ll.is_accepting():
            # the end of the sequence, where the grammar allows it (try_consume_tokens refuses EOS)
            n += self._ll.consume_token(tokens[n])
        self.ended = any(t in self.eos_ids for t in tokens[:n])
        self.consumed += n
        return n

    def validate(self, tokens: Sequence[int]) -> int:
        """How many leading tokens `accept` would consume; the state is unchanged."""
        self._check()
        tokens = list(tokens)
        if self.ended:
            return 0
        n = self._ll.validate_tokens(tokens)
        if n < len(tokens) and tokens[n] in self.eos_ids:  # as accept: EOS where the grammar may end
            return self.fork().accept(tokens[:n + 1])
        return n

    def bitmask(self) -> np.ndarray:
        """The allowed next tokens as uint32 words: token t is bit t % 32 of word t // 32."""
        self._check()
        words = (self.vocab_size + 31) // 32
        return np.frombuffer(self._ll.compute_bitmask(), dtype=np.uint32)[:words].copy()

    def rollback(self, n: int) -> None:
        if n > self.consumed:
            raise InvalidArgument(f"cannot roll back {n} tokens; the matcher has consumed {self.consumed}")
        self._check()
        if n and not self._ll.rollback(n):
            raise GrammarError(f"the grammar matcher could not roll back {n} tokens")
        self.consumed -= n
        self.ended = self.ended and n == 0  # a rollback undoes the EOS first

    def fork(self) -> "Matcher":
        m = Matcher(self._ll.deep_copy(), self.vocab_size, self.eos_ids)
        m.consumed, m.committed_at, m.ended = self.consumed, self.committed_at, self.ended
        return m

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (jump-forward), possibly none."""
        self._check()
        return list(self._ll.compute_ff_tokens())

    @property
    def accepting(self) -> bool:
        return self._ll.is_accepting()

    @property
    def stopped(self) -> bool:
        return self._ll.is_stopped()

    # --- the epilogue's calls (GrammarMatcher) ------------------------------------------------
    def window_masks(self, window: Sequence[int]) -> np.ndarray:
        """bool [W, V]: row 0 the tokens allowed now, row j those allowed after also consuming
        window[1..j]; from the first draft the grammar forbids on, rows are all false. The
        matcher ends where it began (llguidance walks the drafts and rolls them back)."""
        self._check()
        W = len(window)
        bm = llguidance.numpy.allocate_token_bitmask(W, self.vocab_size)
        bm.fill(0)
        if W == 1:
            llguidance.numpy.fill_next_token_bitmask(self._ll, bm)
        else:
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(
                _executor(), [(self._ll, 0, [int(t) for t in window[1:]])], bm)
        self._check()
        bits = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little")
        return bits[:, :self.vocab_size].view(np.bool_)

    def commit(self, tokens: Sequence[int], at: int) -> None:
        """Consume tokens chosen under this matcher's masks, for the window at position `at`.
        A second commit for the same position (an epilogue run retried) changes nothing."""
        if at == self.committed_at:
            return
        tokens = [int(t) for t in tokens]
        n = self.accept(tokens)
        self.committed_at = at
        if n != len(tokens):
            raise GrammarError(f"token {tokens[n]} is not allowed by the grammar at this point")

    def forced_tokens(self, limit: int) -> list[int]:
        return self.forced()[:limit] if not self._ll.is_stopped() else []
