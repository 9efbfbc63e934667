"""Automatic prefix caching: what one working set computed, the next one with the same prefix reuses.

Bookkeeping only (no torch), as vLLM's automatic prefix caching: a frozen page holding a full
block of page_size tokens is published under the hash of its block chained to the blocks before
it, salted by the working set's namespace (an API key on `pie serve`), so a block is found only
by a sequence that starts with the same tokens in the same namespace: one tenant never reads
another's KV, nor learns from a faster answer that another sent a prefix. A pass over an empty
working set attaches the cached pages of its window's leading blocks (shared, copy-on-write: a
write into a shared page copies it first) and the model computes only the rest.

The cache holds a reference to each page it lists. A page counts against the quota of the
working set that allocated it while any working set holds it; one only the cache holds counts
against nobody and is evicted, least recently used first, when the pool runs short (never while
a working set holds it). Attaching a page nobody else holds charges it to the attaching working
set's quota (PagePool.adopt); where the quota cannot take it, the attach stops there.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from .pages import PagePool


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class PrefixCache:
    def __init__(self, pool: PagePool):
        self.pool = pool
        self.block = pool.page_size
        self._pages: OrderedDict[bytes, int] = OrderedDict()  # block hash -> page, least recently used first
        self.queries = 0  # tokens of the windows looked up
        self.hits = 0  # tokens found in the cache
        pool.reclaim = self.reclaim

    def __len__(self) -> int:
        return len(self._pages)

    def chain(self, namespace: str, tokens: list[int], start: list[bytes], blocks: int) -> list[bytes]:
        """The hashes of the first `blocks` full blocks of `tokens`, continuing `start` (the hashes
        of the blocks before, already known)."""
        out = list(start)
        h = out[-1] if out else _digest(b"pie-prefix\0" + namespace.encode())
        for b in range(len(out), blocks):
            h = _digest(h + array("q", tokens[b * self.block:(b + 1) * self.block]).tobytes())
            out.append(h)
        return out

    def attach(self, ws, tokens: list[int], rows: int) -> int:
        """Give the empty working set `ws` the cached pages of the leading full blocks of `tokens`
        that lie within its first `rows` rows; returns how many rows it got (a multiple of the
        block). Its frozen length does not change: the pass writing `tokens` skips those rows."""
        blocks = max(rows, 0) // self.block
        self.queries += len(tokens)
        if blocks == 0:
            return 0
        hashes = self.chain(ws.namespace, tokens, [], blocks)
        got = []
        for h in hashes:
            page = self._pages.get(h)
            if page is None or not self.pool.adopt(page, ws.quota):
                break
            got.append(page)
        if not got:
            return 0
        for h in reversed(hashes[:len(got)]):  # the first block most recent: a chain is evicted from its end
            self._pages.move_to_end(h)
        ws.pages = got
        ws.attached = len(got) * self.block
        ws.chain = hashes[:len(got)]
        self.hits += ws.attached
        ws.cached_tokens += ws.attached
        return ws.attached

    def publish(self, ws) -> None:
        """List the working set's frozen full blocks not listed yet (a block another working set
        published already keeps its page)."""
        if not ws.cacheable or ws.released:
            return
        full = ws.frozen // self.block
        if full <= len(ws.chain):
            return
        first = len(ws.chain)
        ws.chain = self.chain(ws.namespace, ws.tokens, ws.chain, full)
        for b in range(first, full):
            h = ws.chain[b]
            if h in self._pages:
                continue
            page = ws.pages[b]
            self.pool.retain([page])
            self.pool.cached.add(page)
            self._pages[h] = page

    def reclaim(self, n: int) -> int:
        """Evict up to n pages that only the cache holds, least recently used first; returns how
        many were freed."""
        freed = 0
        for h in list(self._pages):
            if freed >= n:
                break
            page = self._pages[h]
            if self.pool.refcount(page) == 1:
                del self._pages[h]
                self.pool.cached.discard(page)
                self.pool.release([page])
                freed += 1
        return freed

    def clear(self) -> int:
        """Evict every page only the cache holds (the others stay listed); returns how many."""
        return self.reclaim(len(self._pages))
