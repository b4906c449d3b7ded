"""The host side of the paged caches: which pages hold which tokens, who uses them, what is cached.

One page table serves both device pools (the MLA latent and the indexer keys, paged alike), so
one allocator decides for both. A page holds `page_size` consecutive positions of one sequence.

Invariants (checked by `check`):
  - every page is in exactly one of three states: free (on the free list, refcount 0), in use
    (refcount >= 1: that many sequences' page tables point at it), or cached (refcount 0, holding
    a full page of a known token prefix, kept for reuse until evicted least-recently-used);
  - a cached or shared page is FULL and never written again: a sequence writes only into pages
    it alone holds (the pages past its matched prefix);
  - `free + in use + cached == num_pages`; after every sequence is released nothing is in use.

Prefix caching: a full page is keyed by a hash chain over its tokens, h_i = H(h_{i-1}, tokens of
page i), so a key names the whole prefix up to that page and two prompts share page i only when
they agree on every token before it. The chain starts at a `root` (the request's: its LoRA adapter,
scheduler.Request.prefix_root): pages computed through one adapter are never shared with another's
requests, whose cache entries differ for the same tokens. `match(tokens)` returns the longest run of cached full
pages that starts the prompt; the caller takes a reference on each (`share`), then allocates
fresh pages for the rest. When a sequence finishes, its full pages are `publish`ed (keyed and
kept while no one uses them); `allocate` evicts the least recently used cached pages when the
free list runs short. Page ids are ints in [0, num_pages).

Shards (decode on a mesh, paged_cache.py): with `shards` = D the pages split into D equal ranges,
shard s = pages [s*N/D, (s+1)*N/D), the pool slots device s holds. Invariant: every page of one
sequence lies in one shard (its home: the device that runs its row), so `allocate` takes the shard
and `match` returns only a run of cached pages within one shard; each shard has its own free list
and LRU, so an allocation for shard s never evicts or takes another shard's page.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence


class OutOfPages(RuntimeError):
  """Not enough free or evictable pages for an allocation (the scheduler preempts and retries)."""


def page_hashes(tokens: Sequence[int], page_size: int, root: bytes = b"") -> list[bytes]:
  """The hash chain of the FULL pages of `tokens` from `root`: one key per full page, each covering the whole
  prefix up to its page's end (a partial last page has no key)."""
  keys, h = [], root
  for i in range(len(tokens) // page_size):
    page = tokens[i * page_size:(i + 1) * page_size]
    h = hashlib.blake2b(h + b"|" + ",".join(map(str, page)).encode(), digest_size=16).digest()
    keys.append(h)
  return keys


class PageAllocator:
  """Free list, reference counts and the prefix cache of `num_pages` pages of `page_size` tokens."""

  def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = True, shards: int = 1):
    if num_pages < 1 or page_size < 1 or shards < 1 or num_pages % shards:
      raise ValueError(f"PageAllocator: num_pages={num_pages} and page_size={page_size} must be >= 1 and "
                       f"num_pages a multiple of shards={shards}")
    self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
    self.shards, self.shard_pages = shards, num_pages // shards
    # per shard: pages with no content worth keeping, and cached ones (refcount 0; oldest first)
    self._frees = [collections.deque(range(s * self.shard_pages, (s + 1) * self.shard_pages)) for s in range(shards)]
    self._lrus: list[collections.OrderedDict[int, None]] = [collections.OrderedDict() for _ in range(shards)]
    self._refs = [0] * num_pages
    self._key_of: dict[int, bytes] = {}  # page -> its prefix key (cached or in use)
    self._page_of: dict[bytes, int] = {}  # prefix key -> page
    self.lookups = 0  # full prompt pages looked up in the prefix cache
    self.hits = 0  # ... of which were found

  # ---- counts
  @property
  def free_pages(self) -> int:
    """Pages allocations can take now, all shards: free plus evictable cached ones."""
    return sum(self.free_in(s) for s in range(self.shards))

  def free_in(self, shard: int) -> int:
    """Pages an allocation for `shard` can take now."""
    return len(self._frees[shard]) + len(self._lrus[shard])

  def shard_of(self, page: int) -> int:
    return page // self.shard_pages

  @property
  def used_pages(self) -> int:
    return sum(1 for r in self._refs if r > 0)

  @property
  def cached_pages(self) -> int:
    return sum(len(lru) for lru in self._lrus)

  def pages_for(self, num_tokens: int) -> int:
    return -(-num_tokens // self.page_size)

  # ---- allocation
  def allocate(self, n: int, shard: int = 0) -> list[int]:
    """n fresh pages (refcount 1) of `shard`, evicting its least recently used cached pages if needed.
    Raises OutOfPages, taking nothing, when fewer than n are free or evictable there."""
    if n > self.free_in(shard):
      raise OutOfPages(f"{n} pages asked, {self.free_in(shard)} free or evictable of {self.shard_pages}"
                       + (f" in shard {shard}" if self.shards > 1 else ""))
    free, lru = self._frees[shard], self._lrus[shard]
    pages = []
    for _ in range(n):
      if free:
        p = free.popleft()
      else:
        p, _ = lru.popitem(last=False)  # evict the oldest cached page
        del self._page_of[self._key_of.pop(p)]
      self._refs[p] = 1
      pages.append(p)
    return pages

  def match(self, tokens: Sequence[int], count: bool = True, root: bytes = b"") -> list[int]:
    """The cached pages that hold the longest run of full pages starting `tokens`, all in the first
    one's shard (no reference taken: `share` them before anything else allocates). count=False: a
    repeated lookup, left out of `lookups` and `hits`."""
    if not self.prefix_caching:
      return []
    pages = []
    keys = page_hashes(tokens, self.page_size, root)
    for key in keys:
      p = self._page_of.get(key)
      if p is None or (pages and self.shard_of(p) != self.shard_of(pages[0])):
        break
      pages.append(p)
    if count:
      self.lookups += len(keys)
      self.hits += len(pages)
    return pages

  def share(self, pages: Sequence[int]) -> None:
    """Takes a reference on each page (a sequence's page table now points at it)."""
    for p in pages:
      if self._refs[p] == 0:
        self._lrus[self.shard_of(p)].pop(p, None)  # a cached page comes back into use
      self._refs[p] += 1

  def publish(self, pages: Sequence[int], tokens: Sequence[int], root: bytes = b"") -> None:
    """Keys the full pages among `pages` (a sequence's page table, in order) by the prefix of
    `tokens` they hold, so later prompts can share them. A page whose key another page already
    holds stays unkeyed (freed when released)."""
    if not self.prefix_caching:
      return
    for p, key in zip(pages, page_hashes(tokens, self.page_size, root)):
      if self._page_of.get(key) not in (None, p) or (p in self._key_of and self._key_of[p] != key):
        continue
      self._key_of[p] = key
      self._page_of[key] = p

  def release(self, pages: Sequence[int]) -> None:
    """Drops one reference on each page; a page no one uses becomes cached (keyed) or free."""
    for p in pages:
      if self._refs[p] <= 0:
        raise ValueError(f"page {p} released more often than taken")
      self._refs[p] -= 1
      if self._refs[p] == 0:
        if p in self._key_of:
          self._lrus[self.shard_of(p)][p] = None  # most recently used last
        else:
          self._frees[self.shard_of(p)].append(p)

  def holds(self, key: bytes) -> bool:
    """Whether a page keyed `key` (a prefix key, `page_hashes`) is cached or in use now."""
    return key in self._page_of

  def hit_rate(self) -> float:
    return self.hits / self.lookups if self.lookups else 0.0

  def check(self) -> None:
    """Asserts the invariants of the module docstring (tests call it after every operation)."""
    free = {p for f in self._frees for p in f}
    cached = {p for lru in self._lrus for p in lru}
    used = {p for p, r in enumerate(self._refs) if r > 0}
    assert len(free) == sum(len(f) for f in self._frees), "a page is on the free list twice"
    assert all(self.shard_of(p) == s for s in range(self.shards) for p in [*self._frees[s], *self._lrus[s]]), \
        "a page is listed in another shard"
    assert not (free & cached) and not (free & used) and not (cached & used), "a page in two states"
    assert len(free) + len(cached) + len(used) == self.num_pages, "a page is lost"
    assert all(self._refs[p] == 0 for p in free | cached), "a free or cached page is referenced"
    assert all(p in self._key_of for p in cached), "a cached page has no key"
    assert all(self._page_of[k] == p for p, k in self._key_of.items()), "the key maps disagree"


__all__ = ["PageAllocator", "OutOfPages", "page_hashes"]
