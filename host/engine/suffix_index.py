"""The cross-request suffix index: what earlier requests of a namespace read and wrote, as drafts.

Bookkeeping only (no torch). SuffixDecoding (arXiv 2411.04975; Snowflake ArcticInference) keeps
a suffix tree over previous prompts and outputs and drafts, from the longest suffix of the current
context found in it, the continuation its counts make most likely. This is the same search over a
different structure: the texts (documents) are kept as token arrays, and every position is listed
under the KEY tokens before it (a suffix array cut at depth KEY and bucketed by hash). A lookup
takes the positions listed under the context's last KEY tokens (the most recent MAX_CANDIDATES),
extends each match backwards to at most `max_match` tokens, keeps those matched longest, and walks
their continuations forward: at each step the token most of them continue with, its share of them
the step's probability, the product the draft's probability so far. The draft stops where that
product falls below `min_prob`, at `k` tokens, or at `factor` x the match length (a longer match is
more likely to go on: SuffixDecoding's adaptive draft length). Its score, the sum of those
products, is the draft's expected number of accepted tokens by the index's own counts.

Memory is bounded by tokens over every namespace together: a document that is inserted or drafted
from becomes the most recently used, and the least recently used documents go first. An index is
per namespace (an API key on `pie serve`): a lookup never sees another namespace's text, and
another tenant's traffic can only evict this one's documents, never add to its drafts.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

KEY = 2  # tokens a position is listed under (a pair, as one int): the shortest match that drafts
MAX_CANDIDATES = 64  # positions a lookup extends (the most recent under its key)
MIN_DOCUMENT = KEY + 1  # a shorter text has no continuation to offer
SUFFIX_TOKENS = 1 << 18  # the engine's default bound: at most ~55 MB (random text; real text shares keys)


@dataclass(frozen=True)
class SuffixDraft:
    """A lookup's answer: the drafted tokens, the context tokens they were matched on, and the
    draft's expected accepted tokens by the index's counts."""

    tokens: list[int]
    match: int = 0
    score: float = 0.0


NO_DRAFT = SuffixDraft([])


class SuffixIndex:
    """One namespace's documents and their position lists; owned by a SuffixStore, which holds the
    lock and the memory bound."""

    def __init__(self, store: "SuffixStore", namespace: str):
        self.store = store
        self.namespace = namespace
        self._docs: dict[int, array] = {}
        self._hashes: dict[bytes, int] = {}  # a document's digest -> its id: an equal text is kept once
        self._digests: dict[int, bytes] = {}
        # key tokens (a << 32 | b) -> the positions after them, doc id << 32 | position, oldest first
        # (8 bytes each). A removed document's positions stay, skipped by lookups, until they outnumber
        # the live ones and the index is rebuilt.
        self._index: dict[int, array] = {}
        self._live = 0
        self._dead = 0

    @property
    def tokens(self) -> int:
        return sum(len(d) for d in self._docs.values())

    def __len__(self) -> int:
        return len(self._docs)

    def documents(self) -> list[list[int]]:
        """Its texts, the earliest listed first."""
        with self.store.lock:
            return [list(t) for t in self._docs.values()]

    def insert(self, tokens: list[int]) -> None:
        """List a text: its positions become candidates of later lookups."""
        with self.store.lock:
            self.store._insert(self, tokens)

    def draft(self, context: list[int], k: int, *, max_match: int = 32, factor: float = 1.0,
              min_prob: float = 0.1, min_match: int = KEY) -> SuffixDraft:
        """The draft for what follows `context` (up to k tokens); NO_DRAFT where no position
        matches its last max(min_match, KEY) tokens."""
        if k < 1 or len(context) < max(min_match, KEY):
            return NO_DRAFT
        with self.store.lock:
            d = self._draft(context, k, max_match, factor, min_prob, max(min_match, KEY))
            store = self.store
            store.lookups += 1
            if d.tokens:
                store.hits += 1
                store.drafted += len(d.tokens)
            return d

    # ---- under the store's lock ------------------------------------------------------
    def _add(self, doc_id: int, text: array) -> None:
        self._docs[doc_id] = text
        self._list(doc_id, text)

    def _list(self, doc_id: int, text: array) -> None:
        index = self._index
        base = doc_id << 32
        for i in range(KEY, len(text)):  # position i continues the key text[i-2:i]
            key = text[i - 2] << 32 | text[i - 1]
            bucket = index.get(key)
            if bucket is None:
                bucket = index[key] = array("q")
            bucket.append(base | i)
        self._live += max(len(text) - KEY, 0)

    def _remove(self, doc_id: int) -> int:
        text = self._docs.pop(doc_id)
        self._hashes.pop(self._digests.pop(doc_id), None)
        n = max(len(text) - KEY, 0)
        self._live -= n
        self._dead += n
        if self._dead > max(self._live, 1 << 12):
            self._index.clear()
            self._live = self._dead = 0
            for d, t in self._docs.items():
                self._list(d, t)
        return len(text)

    def _draft(self, context, k, max_match, factor, min_prob, min_match) -> SuffixDraft:
        key = context[-2] << 32 | context[-1]
        bucket = self._index.get(key)
        if not bucket:
            return NO_DRAFT
        docs = self._docs
        n_ctx = len(context)
        limit = min(max_match, n_ctx)
        best, found = 0, []
        live = (e for e in reversed(bucket) if (e >> 32) in docs)  # the most recent first, removed ones skipped
        for entry in itertools.islice(live, MAX_CANDIDATES):
            doc, pos = entry >> 32, entry & 0xFFFFFFFF
            text = docs[doc]
            m = KEY
            while m < limit and m < pos and text[pos - m - 1] == context[n_ctx - m - 1]:
                m += 1
            if m > best:
                best, found = m, [(doc, pos)]
            elif m == best:
                found.append((doc, pos))
        if best < min_match:
            return NO_DRAFT
        length = min(k, max(1, int(factor * best)))
        out: list[int] = []
        prob, score = 1.0, 0.0
        live = found
        for step in range(length):
            counts: dict[int, int] = {}
            for doc, pos in live:
                text = docs[doc]
                if pos + step < len(text):
                    t = text[pos + step]
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            tok = max(counts, key=counts.__getitem__)  # ties: the most recent candidate's (dicts keep order)
            p = prob * counts[tok] / len(live)
            if p < min_prob:
                break
            prob, score = p, score + p
            out.append(tok)
            live = [(d, q) for d, q in live if q + step < len(docs[d]) and docs[d][q + step] == tok]
        if not out:
            return NO_DRAFT
        for doc in {d for d, _ in live}:  # the documents drafted from stay longest
            self.store._touch(self, doc)
        return SuffixDraft(out, best, score)


class SuffixStore:
    """Every namespace's SuffixIndex under one bound of `max_tokens` listed tokens (LRU over
    documents, whatever their namespace). Thread-safe: inferlet threads insert, the model's
    thread drafts."""

    def __init__(self, max_tokens: int = SUFFIX_TOKENS, max_document: int = 1 << 15):
        if max_tokens < 1:
            raise ValueError("a suffix store needs room for at least one token")
        self.max_tokens = max_tokens
        self.max_document = min(max_document, max_tokens)  # a longer text keeps its end
        self.lock = threading.Lock()
        self._indexes: dict[str, SuffixIndex] = {}
        self._lru: OrderedDict[tuple[str, int], int] = OrderedDict()  # (namespace, doc id) -> tokens
        self._ids = itertools.count(1)
        self.tokens = 0  # positions listed now (documents' tokens)
        # counters: documents listed and evicted; lookups, those that drafted, and their drafts
        self.insertions = 0
        self.evictions = 0
        self.lookups = 0
        self.hits = 0
        self.drafted = 0

    def index(self, namespace: str) -> SuffixIndex:
        with self.lock:
            ix = self._indexes.get(namespace)
            if ix is None:
                ix = self._indexes[namespace] = SuffixIndex(self, namespace)
            return ix

    def __len__(self) -> int:
        return len(self._lru)

    def clear(self) -> None:
        with self.lock:
            self._indexes.clear()
            self._lru.clear()
            self.tokens = 0

    def _touch(self, ix: SuffixIndex, doc: int) -> None:
        self._lru.move_to_end((ix.namespace, doc))

    def _insert(self, ix: SuffixIndex, tokens: list[int]) -> None:
        if len(tokens) < MIN_DOCUMENT:
            return
        text = array("l", tokens[-self.max_document:])
        digest = hashlib.blake2b(text.tobytes(), digest_size=16).digest()
        same = ix._hashes.get(digest)
        if same is not None:  # an equal text is listed already: it becomes the most recent
            self._touch(ix, same)
            return
        while self._lru and self.tokens + len(text) > self.max_tokens:
            (ns, doc), n = self._lru.popitem(last=False)
            owner = self._indexes[ns]
            owner._remove(doc)
            self.tokens -= n
            self.evictions += 1
            if not owner._docs and owner is not ix:
                del self._indexes[ns]
        doc = next(self._ids)
        ix._add(doc, text)
        ix._hashes[digest], ix._digests[doc] = doc, digest
        self._lru[(ix.namespace, doc)] = len(text)
        self.tokens += len(text)
        self.insertions += 1
