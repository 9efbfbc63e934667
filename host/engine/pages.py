"""Page allocation for the paged KV pool: free list and reference counts.

Pure bookkeeping (no torch), in the manner of nano-vllm's block manager: it decides which
slots rows go to and which pages must be copied; the engine moves the tensors.
"""

from __future__ import annotations

import heapq

from ..errors import PoolExhausted


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = [0] * num_pages
        # a heap: the lowest free ids go out first, so a sequence's pages tend to be one run of
        # slots, which attention reads as a view instead of a gather
        self._free = list(range(num_pages))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(
                f"KV pool exhausted: need {n} more pages of {self.page_size} rows, {len(self._free)} free "
                f"of {self.num_pages}; release working sets or start with a larger --kv-pages"
            )
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                heapq.heappush(self._free, p)

    def refcount(self, page: int) -> int:
        return self._refs[page]
