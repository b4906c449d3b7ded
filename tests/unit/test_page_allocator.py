"""MaxText/inference/page_allocator.py: free list, reference counts, the prefix cache and LRU eviction."""

import random

import pytest

from MaxText.inference.page_allocator import OutOfPages, PageAllocator, page_hashes


def test_allocate_release_round_trip_and_out_of_pages_takes_nothing():
  a = PageAllocator(4, page_size=2)
  p = a.allocate(3)
  assert sorted(p) == [0, 1, 2] and a.free_pages == 1 and a.used_pages == 3
  with pytest.raises(OutOfPages):
    a.allocate(2)
  assert a.free_pages == 1 and a.used_pages == 3  # the failed call took nothing
  a.release(p)
  a.check()
  assert a.free_pages == 4 and a.used_pages == 0
  with pytest.raises(ValueError, match="released more often"):
    a.release([p[0]])


def test_hash_chain_keys_the_whole_prefix_and_only_full_pages():
  k = page_hashes([1, 2, 3, 4, 5], page_size=2)
  assert len(k) == 2  # the partial third page has no key
  assert page_hashes([9, 9, 3, 4], 2)[1] != k[1]  # same page content after another prefix: another key
  assert page_hashes([1, 2, 3, 4, 7], 2) == k  # the partial page never matters
  assert page_hashes([12, 3], 1) != page_hashes([1, 23], 1)  # token boundaries are part of the key


def test_a_published_prefix_is_shared_until_the_first_different_page():
  a = PageAllocator(8, page_size=2)
  first = a.allocate(3)  # tokens 0..5 written
  a.publish(first, [1, 2, 3, 4, 5, 6])
  assert a.match([1, 2, 3, 4, 5, 6, 7]) == first  # every full page of the prefix
  assert a.match([1, 2, 3, 9, 5, 6]) == first[:1]  # differs in page 1
  assert a.match([7, 2, 3, 4]) == []
  assert a.match([1]) == []  # no full page
  a.share(first[:2])  # a second sequence takes two shared pages, then its own
  own = a.allocate(1)
  assert own[0] not in first and a.used_pages == 4
  a.release(first)
  a.check()
  assert a.cached_pages == 1  # page 2 is unused but kept; pages 0, 1 still in use
  a.release(first[:2] + own)
  a.check()
  assert a.used_pages == 0 and a.cached_pages == 3 and a.free_pages == 8
  assert a.match([1, 2, 3, 4, 5, 6]) == first  # still cached after every sequence left
  assert a.hit_rate() == pytest.approx((3 + 1 + 0 + 0 + 3) / (3 + 3 + 2 + 0 + 3))


def test_eviction_takes_the_least_recently_used_cached_page_and_never_a_shared_one():
  a = PageAllocator(3, page_size=1)
  pages = a.allocate(3)
  a.publish(pages, [10, 11, 12])
  a.release([pages[1]])  # cached first: the oldest
  a.release([pages[0]])
  a.release([pages[2]])
  assert a.cached_pages == 3 and a.free_pages == 3
  a.share(a.match([10]))  # page 0 back in use: not evictable
  got = a.allocate(1)
  assert got == [pages[1]]  # the least recently released cached page
  assert a.match([10, 11]) == [pages[0]]  # page 1's key went with it
  assert a.allocate(1) == [pages[2]]
  with pytest.raises(OutOfPages):
    a.allocate(1)
  a.check()


def test_prefix_caching_off_never_matches_or_keeps_pages():
  a = PageAllocator(2, page_size=1, prefix_caching=False)
  p = a.allocate(2)
  a.publish(p, [1, 2])
  a.release(p)
  assert a.match([1, 2]) == [] and a.cached_pages == 0 and a.free_pages == 2


def test_random_sequences_keep_every_invariant_and_leak_nothing():
  """Sequences arrive with prompts that share prefixes, grow, finish or are preempted in a random
  order; the invariants hold after every operation and every page is free or cached at the end."""
  rng = random.Random(0)
  a = PageAllocator(24, page_size=4)
  running = {}  # id -> (pages, tokens)
  prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
  for step in range(400):
    op = rng.random()
    if op < 0.4 and len(running) < 6:  # a new sequence: a shared prefix plus its own tokens
      tokens = rng.choice(prefixes)[:rng.randrange(13)] + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
      shared = a.match(tokens)
      a.share(shared)
      try:
        own = a.allocate(a.pages_for(len(tokens)) - len(shared))
      except OutOfPages:
        a.release(shared)
      else:
        running[step] = (shared + own, tokens)
    elif op < 0.7 and running:  # a sequence grows by one token, maybe into a new page
      sid = rng.choice(list(running))
      pages, tokens = running[sid]
      tokens = tokens + [rng.randrange(50)]
      try:
        pages = pages + a.allocate(a.pages_for(len(tokens)) - len(pages))
      except OutOfPages:  # preempted: everything it holds goes back
        a.release(pages)
        del running[sid]
        continue
      running[sid] = (pages, tokens)
    elif running:  # a sequence finishes (its full pages published) or is aborted
      sid = rng.choice(list(running))
      pages, tokens = running.pop(sid)
      if rng.random() < 0.7:
        a.publish(pages, tokens)
      a.release(pages)
    a.check()
  for pages, _ in running.values():
    a.release(pages)
  a.check()
  assert a.used_pages == 0 and a.free_pages == 24 and a.hits > 0



def test_shards_allocate_evict_and_match_within_one_shard():
  a = PageAllocator(8, page_size=2, shards=2)  # shard 0: pages 0-3, shard 1: pages 4-7
  left = a.allocate(2, shard=0)
  right = a.allocate(4, shard=1)
  assert all(a.shard_of(p) == 0 for p in left) and sorted(right) == [4, 5, 6, 7]
  with pytest.raises(OutOfPages):
    a.allocate(1, shard=1)  # shard 1 is full though shard 0 has room
  a.publish(left[:1], [7, 7])  # [7,7] cached on shard 0
  a.release(left)
  # shard 1 computed [7,7][8,8] itself: its first page stays unkeyed (shard 0 holds that key), its second is keyed
  a.publish(right[:2], [7, 7, 8, 8])
  a.release(right)
  assert a.free_in(1) == 4 and a.cached_pages == 2
  assert a.match([7, 7, 8, 8, 9]) == [left[0]]  # the chain's second page lies in shard 1: the run stops
  assert a.match([7, 7]) == [left[0]]
  taken = a.allocate(4, shard=0)  # shard 0's 3 free pages first, then its own cached page; shard 1's stays
  assert all(a.shard_of(p) == 0 for p in taken) and a.cached_pages == 1 and a.match([7, 7]) == []
  a.check()
