"""A working set: one sequence's KV state as a page table over the pool.

Rows 0..frozen are committed. Rows past frozen are scratch: a pass writes its window there
and only the first `fold` rows become frozen; the next pass overwrites the rest.
All methods here are bookkeeping only and return the slot copies the engine must perform.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import BadHandle, InvalidArgument
from .pages import PagePool, Quota


@dataclass
class WorkingSet:
    id: int
    pool: PagePool
    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # committed token ids, one per frozen row
    positions: list[int] = field(default_factory=list)  # position id of each frozen row
    scratch: list[int] = field(default_factory=list)  # tokens of the rows the last pass wrote past frozen
    edits: int = 0  # how many times frozen rows were dropped or moved (truncate, evict): appends are not edits
    released: bool = False
    quota: Quota | None = None  # the owning instance's share of the pool; its forks carry it too
    scores: object | None = None  # logprobs.RowScores when its instance reports logprobs; forks copy it
    # prefix caching (prefix_cache.py): the namespace its blocks are hashed in, the hashes of its
    # frozen blocks listed so far, whether it may list more (not once rows were evicted: positions
    # moved), the rows a pass attached from the cache (its window's first rows, not computed)
    namespace: str = ""
    chain: list[bytes] = field(default_factory=list)
    cacheable: bool = True
    attached: int = 0
    cached_tokens: int = 0  # rows it was given from the cache, in all
    indexed: bool = True  # it drafts from its namespace's suffix index and its text joins it when released

    @property
    def frozen(self) -> int:
        return len(self.tokens)

    @property
    def next_position(self) -> int:
        return self.positions[-1] + 1 if self.positions else 0

    def check_alive(self) -> None:
        if self.released:
            raise BadHandle(f"working set {self.id} was released")

    def slot(self, row: int) -> int:
        p = self.pool.page_size
        return self.pages[row // p] * p + row % p

    def slots(self, start: int, end: int) -> list[int]:
        p = self.pool.page_size
        return [self.pages[r // p] * p + r % p for r in range(start, end)]

    def slot_run(self, end: int) -> tuple[int, int] | None:
        """The slots of rows [0, end) as one run (first, first + end) where their pages follow each
        other in the pool (attention then reads a view, no gather), else None."""
        need = self._pages_for(end)
        used = self.pages[:need]
        if not used or len(used) < need or used != list(range(used[0], used[0] + need)):
            return None
        first = used[0] * self.pool.page_size
        return first, first + end

    def _pages_for(self, rows: int) -> int:
        return -(-rows // self.pool.page_size)

    def prepare_write(self, window: int) -> list[tuple[int, int]]:
        """Make rows frozen..frozen+window writable: allocate pages, copy shared ones.

        Returns (src_page, dst_page) copies. Nothing changes if the pool cannot supply the pages.
        Rows a pass attached from the prefix cache are in place already: writing starts after them.
        """
        start = self.frozen + self.attached
        first, need = start // self.pool.page_size, self._pages_for(start + window)
        shared = [i for i in range(first, min(need, len(self.pages))) if self.pool.refcount(self.pages[i]) > 1]
        if not shared and need <= len(self.pages):  # a decode step inside its last page: nothing to do
            return []
        # Only a page holding frozen rows needs its contents copied; a shared page past the
        # frozen end can only come from a fork, which never shares scratch pages.
        new = self.pool.alloc(max(0, need - len(self.pages)) + len(shared), self.quota)
        copies = []
        for i in shared:
            dst = new.pop()
            copies.append((self.pages[i], dst))
            self.pool.release([self.pages[i]])
            self.pages[i] = dst
        self.pages.extend(new)
        return copies

    def apply_fold(self, window_tokens: list[int], fold: int, first_position: int) -> None:
        """Freeze the first `fold` rows of the window a pass just wrote; the rest are scratch."""
        self.tokens.extend(window_tokens[:fold])
        self.positions.extend(range(first_position, first_position + fold))
        self.scratch = list(window_tokens[fold:])
        self.attached = 0

    def commit(self, n: int) -> None:
        """Freeze the first n scratch rows the last pass left: a fold decided after the pass
        (the WIT's working-sets.commit)."""
        if not 0 <= n <= len(self.scratch):
            raise InvalidArgument(f"cannot freeze {n} rows: the last pass left {len(self.scratch)} scratch rows")
        first = self.next_position
        self.tokens.extend(self.scratch[:n])
        self.positions.extend(range(first, first + n))
        del self.scratch[:n]

    def fork(self, new_id: int) -> "WorkingSet":
        keep = self.pages[: self._pages_for(self.frozen)]
        self.pool.retain(keep)
        return WorkingSet(new_id, self.pool, list(keep), list(self.tokens), list(self.positions), quota=self.quota,
                          scores=self.scores.fork() if self.scores is not None else None, namespace=self.namespace,
                          chain=list(self.chain), cacheable=self.cacheable, indexed=self.indexed)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.frozen:
            raise InvalidArgument(f"truncate to {n}: must be between 0 and the frozen length {self.frozen}")
        del self.tokens[n:]
        del self.positions[n:]
        self.scratch = []
        self.edits += 1
        del self.chain[n // self.pool.page_size:]
        self.attached = 0
        keep = self._pages_for(n)
        self.pool.release(self.pages[keep:])
        del self.pages[keep:]

    def evict(self, start: int, end: int) -> list[tuple[int, int]]:
        """Drop frozen rows start..end; later rows move down and keep their positions.

        Returns (src_slot, dst_slot) row copies. Nothing changes if the pool is exhausted.
        """
        if not 0 <= start < end <= self.frozen:
            raise InvalidArgument(f"evict [{start}, {end}): need 0 <= start < end <= frozen length {self.frozen}")
        p = self.pool.page_size
        first = start // p
        moved = list(range(first * p, start)) + list(range(end, self.frozen))
        new_pages = self.pool.alloc(self._pages_for(len(moved)), self.quota)
        copies = [(self.slot(r), new_pages[i // p] * p + i % p) for i, r in enumerate(moved)]
        self.pool.release(self.pages[first:])
        self.pages[first:] = new_pages
        del self.tokens[start:end]
        del self.positions[start:end]
        self.scratch = []
        self.edits += 1
        self.cacheable = False  # later rows keep their positions: its blocks are no prefix any more
        return copies

    def release(self) -> None:
        if not self.released:
            self.pool.release(self.pages)
            self.pages = []
            self.attached = 0
            self.scores = None
            self.released = True
