"""Page allocation for the paged KV pool: free list and reference counts.

Pure bookkeeping (no torch), in the manner of nano-vllm's block manager: it decides which
slots rows go to and which pages must be copied; the engine moves the tensors.
"""

from __future__ import annotations

import heapq
from typing import Callable

from ..errors import PoolExhausted, QuotaExhausted


class Quota:
    """A share of the pool: the working sets that carry it (one instance's) may hold at most
    `limit` pages at once, so one instance cannot starve the others. A page counts against
    the quota of the set that allocated it until it is freed or only the prefix cache holds it;
    sharing it (a fork, an attach of a cached page someone holds) is free.
    Quotas nest: a page counts against its quota and every `parent` above it (an instance's
    quota inside its API key's), and an allocation must fit all of them."""

    def __init__(self, limit: int, parent: "Quota | None" = None, whose: str = "this instance's",
                 flag: str = "--kv-share"):
        self.limit = limit
        self.used = 0
        self.parent = parent
        self.whose, self.flag = whose, flag  # named when it is exhausted

    def chain(self):
        q = self
        while q is not None:
            yield q
            q = q.parent


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = [0] * num_pages
        self._quota: list[Quota | None] = [None] * num_pages  # whose quota each page counts against
        # a heap: the lowest free ids go out first, so a sequence's pages tend to be one run of
        # slots, which attention reads as a view instead of a gather
        self._free = list(range(num_pages))
        self.cached: set[int] = set()  # pages the prefix cache holds a reference to
        self._idle: set[int] = set()  # of those, the ones nothing else holds: free for the taking
        self.reclaim: Callable[[int], int] | None = None  # frees up to n cached pages (prefix_cache.py)

    @property
    def free_pages(self) -> int:
        """Pages an allocation can have: free ones and those only the prefix cache holds."""
        return len(self._free) + len(self._idle)

    @property
    def used_pages(self) -> int:
        """Pages working sets hold."""
        return self.num_pages - self.free_pages

    def quota(self, share: float, parent: Quota | None = None, **named) -> Quota:
        """A quota of `share` of the pool's pages (at least one), counted against `parent` too."""
        return Quota(max(1, int(self.num_pages * share)), parent, **named)

    @staticmethod
    def _over(quota: Quota | None, n: int) -> Quota | None:
        """The first quota of the chain that has no room for n more pages, else None."""
        return next((q for q in quota.chain() if q.used + n > q.limit), None) if quota is not None else None

    def _charge(self, pages: list[int], quota: Quota | None) -> None:
        for p in pages:
            self._quota[p] = quota
        for q in quota.chain() if quota is not None else ():
            q.used += len(pages)

    def alloc(self, n: int, quota: Quota | None = None) -> list[int]:
        if (q := self._over(quota, n)) is not None:
            raise QuotaExhausted(
                f"KV page quota exhausted: need {n} more pages of {self.page_size} rows, {q.used} of {q.whose} "
                f"quota of {q.limit} pages (of {self.num_pages} in the pool) are in use; release "
                f"working sets or raise the quota ({q.flag})")
        if n > len(self._free) and self.reclaim is not None:
            self.reclaim(n - len(self._free))
        if n > len(self._free):
            raise PoolExhausted(
                f"KV pool exhausted: need {n} more pages of {self.page_size} rows, {len(self._free)} free "
                f"of {self.num_pages}; release working sets or start with a larger --kv-pages"
            )
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        self._charge(pages, quota)
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] += 1
            self._idle.discard(p)

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                heapq.heappush(self._free, p)
                self._idle.discard(p)
                self._uncharge(p)
            elif self._refs[p] == 1 and p in self.cached:  # only the cache holds it: nobody's quota
                self._idle.add(p)
                self._uncharge(p)

    def _uncharge(self, p: int) -> None:
        quota, self._quota[p] = self._quota[p], None
        for q in quota.chain() if quota is not None else ():
            q.used -= 1

    def adopt(self, page: int, quota: Quota | None) -> bool:
        """Take a reference to a cached page for a working set carrying `quota`: a page only the
        cache holds is charged to the quota, if it has room (else False, nothing taken)."""
        if self._refs[page] == 1 and quota is not None:
            if self._over(quota, 1) is not None:
                return False
            self._charge([page], quota)
        self._refs[page] += 1
        self._idle.discard(page)
        return True

    def refcount(self, page: int) -> int:
        return self._refs[page]
