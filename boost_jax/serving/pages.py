"""The page allocator of the paged KV cache: which pool pages each sequence owns, in order (its page
table), and which are free. Host-side bookkeeping only, no JAX (serve/paged.py moves the data).

    pages = Pages(n_pages=65, page_tokens=16, max_pages=8)
    pages.admit("a", reserve=40)     # a sequence that may reach 40 positions: 3 pages promised
    pages.grow("a", 17)              # pages for positions 0..16 taken from the free list (2 pages)
    pages.table("a")                 # int32 [max_pages]: its pages, then NULL_PAGE
    pages.finish("a")                # (or cancel) every page back on the free list, at once

Page 0 is the null page: never owned, never written (a write aimed at a position a sequence does
not own is dropped), so a table's unused entries read it. A sequence is admitted only when the
pages it may ever need (its prompt + max_tokens) are free beyond every other sequence's promise, and
takes them as it grows: growing never fails and no running sequence is ever evicted, while the
pages in use (`used`) are only those holding tokens.

Freed pages are masked, not zeroed: a sequence reads only positions below its next one, and every
one of those it wrote itself (its prompt's prefill, then each token it decoded) after it took the
page; what an earlier owner left in the rest of the page sits at positions its causal mask hides
until it overwrites them. Zeroing would cost a write of every freed page for no read it changes
(docs/design/serving.md).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

NULL_PAGE = 0


class Pages:
    """`n_pages` pages of `page_tokens` positions (page 0 the null page), tables of `max_pages` entries."""

    def __init__(self, n_pages: int, page_tokens: int, max_pages: int):
        if n_pages < 2 or page_tokens < 1 or max_pages < 1:
            raise ValueError(f"a pool needs >= 2 pages (one is the null page), >= 1 token per page and table "
                             f"entry; got {n_pages}, {page_tokens}, {max_pages}")
        self.n_pages, self.page_tokens, self.max_pages = n_pages, page_tokens, max_pages
        self._free = list(range(n_pages - 1, NULL_PAGE, -1))  # popped from the end: lowest first
        self._owned: dict[Hashable, list[int]] = {}
        self._promised: dict[Hashable, int] = {}  # pages each sequence may still take

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_tokens)

    @property
    def used(self) -> int:
        """Pages holding some sequence's tokens."""
        return self.n_pages - 1 - len(self._free)

    @property
    def free(self) -> int:
        """Pages no sequence holds (promised ones included)."""
        return len(self._free)

    @property
    def unpromised(self) -> int:
        """Free pages no admitted sequence may still take: what a new admission can have."""
        return len(self._free) - sum(self._promised.values())

    def can_admit(self, reserve: int) -> bool:
        return self.pages_for(reserve) <= min(self.unpromised, self.max_pages)

    def admit(self, seq: Hashable, reserve: int) -> bool:
        """Promise `seq` the pages of `reserve` positions; False (nothing changed) if they are not free."""
        if seq in self._owned:
            raise ValueError(f"sequence {seq!r} is already admitted")
        if not self.can_admit(reserve):
            return False
        self._owned[seq], self._promised[seq] = [], self.pages_for(reserve)
        return True

    def grow(self, seq: Hashable, positions: int) -> None:
        """Pages for positions 0 .. positions - 1 of `seq`, taken from its promise."""
        owned = self._owned[seq]
        need = self.pages_for(positions) - len(owned)
        if need > self._promised[seq]:
            raise ValueError(f"sequence {seq!r} grows to {positions} positions, past the pages it was promised")
        for _ in range(max(need, 0)):
            owned.append(self._free.pop())
            self._promised[seq] -= 1

    def release(self, seq: Hashable) -> None:
        """Every page of `seq` (and its promise) back at once: its end (finish) or its cancellation."""
        self._free.extend(reversed(self._owned.pop(seq)))
        del self._promised[seq]

    finish = cancel = release

    def owned(self, seq: Hashable) -> list[int]:
        return list(self._owned[seq])

    def sequences(self) -> list[Hashable]:
        return list(self._owned)

    def table(self, seq: Hashable | None) -> np.ndarray:
        """int32 [max_pages]: the pages of `seq` in order, the rest (all, for None) the null page."""
        out = np.full(self.max_pages, NULL_PAGE, np.int32)
        if seq is not None:
            owned = self._owned[seq]
            out[:len(owned)] = owned
        return out
