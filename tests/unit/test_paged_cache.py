"""MaxText/inference/paged_cache.py against the contiguous cache (kv_cache.py): the same tokens
written through a page table read back the same, the selected latents gather the same, and the
indexer's selection over a paged sequence is the contiguous one."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.inference import kv_cache, paged_cache, paged_pools
from MaxText.kernels import backend, paged_decode
from MaxText.kernels.cached_attention import ContiguousKeys, latent_attention_dense, merge_selected
from MaxText.kernels.index_scores import index_scores
from MaxText.kernels.topk_indices import topk_indices
from tests.conftest import make_config

PAGE, PAGES = 4, 10


def _entries(cfg, b, t, seed):
  rng = np.random.default_rng(seed)
  f = lambda n: jnp.asarray(rng.standard_normal((b, t, n)) * 3, jnp.float32)
  return dict(c_kv=f(cfg.kv_lora_rank), k_pe=f(cfg.qk_rope_head_dim), idx_k=f(cfg.indexer_head_dim))


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
@pytest.mark.parametrize("dtype", ["float32", "fp8"])
def test_paged_writes_read_back_as_the_contiguous_cache_and_select_the_same_keys(dtype, monkeypatch):
  cfg = make_config(kv_cache_dtype=dtype, indexer_topk=5)
  lengths = np.array([11, 7])  # ragged rows
  # rows share their first page (the same prompt prefix), then hold their own pages in any order
  table = jnp.asarray([[3, 7, 1, -1], [3, 0, -1, -1]], jnp.int32)  # [B,P]; -1: no page
  s = table.shape[1] * PAGE
  pools = paged_pools.init_layer_pools(cfg, PAGES * PAGE)
  contiguous = kv_cache.init_layer_cache(cfg, 2, length=s)
  first = _entries(cfg, 1, PAGE, seed=0)  # the shared page's tokens, the same in both rows
  rest = _entries(cfg, 2, s - PAGE, seed=1)
  both = {k: jnp.concatenate([jnp.broadcast_to(first[k], (2,) + first[k].shape[1:]), rest[k]], axis=1)
          for k in first}  # [B,S,n]
  positions = jnp.where(jnp.arange(s)[None] < jnp.asarray(lengths)[:, None], jnp.arange(s)[None], -1)  # [B,S]
  for lo in range(0, s, 5):  # chunks of 5 new tokens (the last one partly padding)
    pos = positions[:, lo:lo + 5]
    chunk = {k: v[:, lo:lo + 5] for k, v in both.items()}
    pools = paged_pools.write(pools, paged_pools.slots(table, pos, PAGE, PAGES * PAGE), **chunk)
    contiguous = kv_cache.write(contiguous, jnp.full((2,), lo, jnp.int32), **chunk)

  view = paged_cache.sequence_view(pools, table, PAGE)
  real = np.arange(s)[None] < lengths[:, None]  # [B,S]
  for got, want in ((kv_cache.read_latents(view), kv_cache.read_latents(contiguous)),
                    ((kv_cache.read_indexer_keys(view),), (kv_cache.read_indexer_keys(contiguous),))):
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g)[real], np.asarray(w)[real])
  assert not np.array_equal(np.asarray(kv_cache.read_latents(view)[0]), 0)

  idx = jnp.asarray([[0, 5, 10, 3], [6, 1, 2, 4]], jnp.int32)  # real positions of each row
  for g, w in zip(paged_cache.gather_selected(pools, table, idx, PAGE),
                  kv_cache.gather_latents(contiguous, idx)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

  # the indexer's selection for each row's last token: over the paged keys = over the contiguous ones
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((2, 1, 4, cfg.indexer_head_dim)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, 1, 4)), jnp.float32)
  valid = jnp.asarray(real)[:, None, :]  # [B,1,S]
  sel = [topk_indices(index_scores(q, w, kv_cache.read_indexer_keys(c), valid, head_chunk=4), cfg.indexer_topk)
         for c in (view, contiguous)]
  for g, w_ in zip(*sel):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w_))

  # scored where the pages lie (PagedKeys), one row at a time in blocks of 2 pages, two queries a row, heads
  # 3 at a time (padded to 6): every score equal to the contiguous keys' (to f32 rounding: bit for bit on an
  # AVX-512 host, 9.5e-7 apart on an AVX2 one, where XLA sums the blocks' dot products in another order), -inf
  # past each query's position
  q2 = jnp.asarray(rng.standard_normal((2, 2, 4, cfg.indexer_head_dim)), jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((2, 2, 4)), jnp.float32)
  pos = jnp.asarray(lengths, jnp.int32)[:, None] - jnp.asarray([[2, 1]], jnp.int32)  # [B,2]
  want = ContiguousKeys(kv_cache.read_indexer_keys(contiguous)).scores(q2, w2, pos, head_chunk=4)
  assert np.isfinite(np.asarray(want)).sum() == 2 * lengths.sum() - 2
  for per_block in (2, 3):  # 3: the table's 4 pages are not a multiple of the block (the last one part padding)
    monkeypatch.setattr(paged_cache, "KEY_BLOCK_BYTES", per_block * PAGE * cfg.indexer_head_dim * 4)
    paged = paged_cache.PagedKeys(pools.idx_k, pools.idx_k_scale, table, PAGE).scores(q2, w2, pos, head_chunk=3)
    assert paged.shape == (2, 2, s), per_block
    np.testing.assert_array_equal(np.isfinite(np.asarray(paged)), np.isfinite(np.asarray(want)))
    np.testing.assert_allclose(np.asarray(paged), np.asarray(want), rtol=2e-6, atol=2e-6)


def test_padding_and_positions_past_the_table_are_dropped_not_written():
  cfg = make_config()
  n = PAGES * PAGE
  table = jnp.asarray([[2, 5]], jnp.int32)
  ids = paged_pools.slots(table, jnp.asarray([[0, 5, -1, 8, 3]], jnp.int32), PAGE, n)
  np.testing.assert_array_equal(np.asarray(ids), [[8, 21, n, n, 11]])
  pools = paged_pools.init_layer_pools(cfg, n)
  e = _entries(cfg, 1, 5, seed=3)
  got = paged_pools.write(pools, ids, **e)
  written = np.asarray(got.c_kv)
  np.testing.assert_array_equal(written[[8, 21, 11]], np.asarray(e["c_kv"])[0, [0, 1, 4]])
  others = np.ones(n, bool)
  others[[8, 21, 11]] = False
  assert not written[others].any()  # the padding token and the one past the table went nowhere


def test_a_stack_writes_every_layer_at_its_slots():
  cfg = make_config()
  layers, n = 3, PAGES * PAGE
  pools = paged_pools.init_layer_pools(cfg, n, num_layers=layers)
  table = jnp.asarray([[4], [9]], jnp.int32)
  ids = paged_pools.slots(table, jnp.asarray([[0, 1], [2, -1]], jnp.int32), PAGE, n)
  e = {k: jnp.stack([v * (i + 1) for i in range(layers)]) for k, v in _entries(cfg, 2, 2, seed=4).items()}
  got = paged_pools.write(pools, ids, **e)
  for i in range(layers):
    view = paged_cache.sequence_view(jax.tree.map(lambda a: a[i], got), table, PAGE)
    np.testing.assert_array_equal(np.asarray(view.c_kv)[0, :2], np.asarray(e["c_kv"])[i, 0])
    np.testing.assert_array_equal(np.asarray(view.c_kv)[1, 2], np.asarray(e["c_kv"])[i, 1, 0])
  # only those slots: the padding token's slot N is dropped, not layer i's slot N = layer i + 1's slot 0 of the
  # flat [L*N, n] pool the write scatters into
  written = {(i, s) for i in range(layers) for s in (4 * PAGE, 4 * PAGE + 1, 9 * PAGE + 2)}
  for name, a in got._asdict().items():
    if a is not None and a.shape[-2] == n:
      touched = {(i, s) for i, s in zip(*np.nonzero(np.asarray(a).reshape(layers, n, -1).any(axis=-1)))}
      assert touched <= written, (name, sorted(touched - written))
  assert paged_pools.pool_bytes(cfg, PAGES, PAGE) == \
      kv_cache.bytes_per_token_per_layer(cfg) * cfg.num_decoder_layers * n


def test_dense_attention_over_the_pages_equals_it_over_the_contiguous_cache(monkeypatch):
  """dense_over_pages reads a block of pages at a time (here one page: 4 blocks) with an online
  softmax: the same attention as latent_attention_dense over the contiguous cache, ragged rows
  whose new tokens (3, from slot 5 and from slot 9) replace what their slots held. fp8: the blocks
  are dequantized where they are read."""
  cfg = make_config(kv_cache_dtype="fp8")
  b, t, h, s = 2, 3, 4, 4 * PAGE
  table = jnp.asarray([[3, 7, 1, 6], [2, 0, 9, 4]], jnp.int32)  # [B,P]
  e = _entries(cfg, b, s, seed=5)
  pools = paged_pools.write(paged_pools.init_layer_pools(cfg, PAGES * PAGE),
                            paged_pools.slots(table, jnp.broadcast_to(jnp.arange(s), (b, s)), PAGE, PAGES * PAGE), **e)
  contiguous = kv_cache.write(kv_cache.init_layer_cache(cfg, b, length=s), jnp.zeros((b,), jnp.int32), **e)
  rng = np.random.default_rng(6)
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q_abs, q_pe, c_new, pe_new = f(b, t, h, cfg.kv_lora_rank), f(b, t, h, 8), f(b, t, cfg.kv_lora_rank), f(b, t, 8)
  positions = jnp.asarray([5, 9], jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B,t]
  valid = jnp.arange(s)[None, None, :] <= positions[:, :, None]  # [B,t,S]
  want = jax.jit(lambda c, *a: latent_attention_dense(*a[:2], *kv_cache.read_latents(c), *a[2:], valid,
                                                      positions[:, 0], 0.3))(contiguous, q_abs, q_pe, c_new, pe_new)
  monkeypatch.setattr(paged_cache, "KEY_BLOCK_BYTES", 1)  # a page a block
  got = jax.jit(lambda p, *a: paged_cache.dense_over_pages(p, table, PAGE, *a, positions[:, 0], 0.3))(
      pools, q_abs, q_pe, c_new, pe_new)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def _key_gathers(hlo: str, d: int) -> list[tuple[str, int]]:
  """(element type, tokens per slice) of each gather of d-wide rows in a compiled program's text:
  slice_sizes {.., tokens, d}."""
  found = []
  for line in hlo.split("\n"):
    if " gather(" not in line:
      continue
    sizes = [int(x) for x in line.split("slice_sizes={", 1)[1].split("}", 1)[0].split(",")]
    if sizes[-1] == d:
      found.append((line.split(" = ", 1)[1].split("[", 1)[0], int(np.prod(sizes[:-1]))))
  return found


def test_a_compiled_decode_step_reads_the_indexer_keys_by_whole_pages_never_token_by_token():
  """The paged step scores the indexer keys where their pages lie: the keys are gathered a page
  ([page, d]) at a time; a gather of one token's key (slice_sizes {1, d}) copies the whole key cache
  row by row every step (issue 45: 2.8x slower decode at 128K)."""
  from MaxText import serve_compile
  from MaxText.runtime import sharding
  d, page = 24, 8  # an indexer width no other cached vector has (kv_lora 32, rope 8)
  cfg = make_config(indexer_head_dim=d, serve_page_size=page, max_target_length=64, serve_max_num_seqs=2,
                    max_prefill_length=16, num_decoder_layers=1)  # one dense layer: a short compile
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    step, _, _ = serve_compile.build_engine(cfg).compile_step(2, 1)  # abstract: nothing allocated
  gathers = _key_gathers(step.as_text(), d)
  assert gathers and all(tokens == page for _, tokens in gathers), gathers


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_a_write_into_bf16_or_fp8_pools_updates_them_in_place(dtype):
  """The pools hold fp8 / bf16 fields as their bits (uint8 / uint16): a write into float8 or bfloat16
  pools compiled to an f16/f32 copy of every slot on XLA:CPU (float normalization), then a convert
  back, so each decode step rewrote the whole cache. The donated write's program has no pool-sized
  convert, its temporaries stay under one pool field, and what it wrote reads back."""
  cfg = make_config(kv_cache_dtype=dtype)
  n = 4096  # slots: the pool fields (128-256 KiB) outweigh the write's own temporaries
  pools = paged_pools.init_layer_pools(cfg, n)
  assert {a.dtype for a in pools if a is not None} <= {jnp.dtype(t) for t in (jnp.uint8, jnp.uint16, jnp.int32, jnp.float32)}
  e = _entries(cfg, 2, 1, seed=3)
  ids = jnp.asarray([[5], [n]], jnp.int32)  # row 1: padding, dropped
  write = jax.jit(paged_pools.write, donate_argnums=(0,))
  compiled = write.lower(pools, ids, **e).compile()
  hlo = compiled.as_text()
  pool_shapes = {f"[{a.shape[0]},{a.shape[-1]}]" for a in pools if a is not None}  # k_pe as int32 rows: [n/R, R*w]
  converts = [line.strip()[:120] for line in hlo.split("\n")
              if " convert(" in line and any(shape in line.split(" = ", 1)[-1].split(" ", 1)[0] for shape in pool_shapes)]
  assert not converts, converts
  assert compiled.memory_analysis().temp_size_in_bytes < pools.c_kv.nbytes  # a widened copy: 2-4x it
  got = paged_cache.sequence_view(write(pools, ids, **e), jnp.asarray([[1, 0]], jnp.int32), PAGE)  # slot 5: page 1
  c_kv, _ = kv_cache.read_latents(got)
  want = kv_cache.as_stored(kv_cache.init_layer_cache(cfg, 1, length=8), "c_kv", e["c_kv"][0, 0])
  np.testing.assert_array_equal(np.asarray(c_kv)[0, 1], np.asarray(want))


IN_PLACE = ("parameter", "scatter", "dynamic-update-slice", "get-tuple-element", "tuple", "bitcast", "while")


def _pool_sized(hlo: str, elements: int) -> list[str]:
  """HLO lines whose result holds >= `elements` elements (a whole pool's), but for ops that pass an array
  on or update it in place (IN_PLACE): a copy, convert or relayout of a pool."""
  out = []
  for line in hlo.split("\n"):
    head = line.split(" = ", 1)
    if len(head) < 2 or head[1].startswith("(") or "[" not in head[1].split(" ", 1)[0]:  # tuples: no array
      continue
    op = head[1].split("(", 1)[0].split(" ")[-1]
    if op in IN_PLACE or (op == "fusion" and any(kind in head[0] for kind in IN_PLACE[1:3])):  # an in-place update's
      continue
    dims = head[1].split("[", 1)[1].split("]", 1)[0]
    if re.fullmatch(r"[\d,]+", dims) and np.prod([int(d) for d in dims.split(",")]) >= elements:
      out.append(line.strip()[:140])
  return out


def test_the_fp8_latent_pool_is_32bit_words_gathered_and_written_without_a_pool_copy():
  """A TPU tiles an 8-bit [N, 512] array (32, 128) and its row gather / scatter wants (8, 128): XLA
  copied the whole fp8 latent pool twice a decode step (7.8 of 19.6 ms at 16 rows x 128K,
  docs/kernels.md). The pool holds the 512 codes a slot as 128 uint32 words; its selected rows
  gather and its new rows scatter with no pool-sized op but the in-place scatter, and read back
  exactly what the contiguous cache holds."""
  cfg = make_config(kv_cache_dtype="fp8", kv_lora_rank=512)
  n = 64 * PAGE
  pools = paged_pools.init_layer_pools(cfg, n)
  assert pools.c_kv.dtype == jnp.uint32 and pools.c_kv.shape == (n, 128)
  assert pools.idx_k.dtype == jnp.uint8  # 128 codes: a row of its own (the scoring kernel's page DMAs)
  e = _entries(cfg, 2, 3, seed=4)
  table = jnp.asarray([[5, 2], [9, 1]], jnp.int32)
  ids = paged_pools.slots(table, jnp.asarray([[0, 1, 2], [0, 1, -1]], jnp.int32), PAGE, n)  # row 1's last: padding
  write = jax.jit(paged_pools.write, donate_argnums=(0,))
  wrote = _pool_sized(write.lower(pools, ids, **e).compile().as_text(), n * 128)
  assert not wrote, wrote
  pools = write(pools, ids, **e)
  idx = jnp.asarray([[2, 0, 1], [1, 0, 0]], jnp.int32)
  gather = jax.jit(lambda p, t, i: paged_cache.gather_selected(p, t, i, PAGE))
  read = _pool_sized(gather.lower(pools, table, idx).compile().as_text(), n * 128)
  assert not read, read
  contiguous = kv_cache.write(kv_cache.init_layer_cache(cfg, 2, length=2 * PAGE), jnp.zeros((2,), jnp.int32), **e)
  for g, w in zip(gather(pools, table, idx), kv_cache.gather_latents(contiguous, idx)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _rows_and_bits(cfg, n, num_layers=None):
  """The same config's pools under rope_storage "rows" (the tpu row) and "bits" (the cpu row)."""
  with backend.forced(rope_storage="rows"):
    rows = paged_pools.init_layer_pools(cfg, n, num_layers)
  with backend.forced(rope_storage="bits"):
    bits = paged_pools.init_layer_pools(cfg, n, num_layers)
  return rows, bits


def test_a_k_pe_pool_of_int32_rows_reads_back_what_the_bits_pool_does(monkeypatch):
  """rope_storage "rows": k_pe as int32 pairs, R slots a pool row (here rope 8: 4 words a slot, R = 4 slots a
  page). Written through a page table (ragged rows, a padding token, a stack of 2 layers), every reader gives
  exactly what the uint16 pool gives: sequence_view, gather_selected, dense_over_pages (a page a block)."""
  cfg = make_config(kv_cache_dtype="fp8", serve_page_size=PAGE)
  n, b, s = PAGES * PAGE, 2, 3 * PAGE
  rows, bits = _rows_and_bits(cfg, n, num_layers=2)
  assert rows.k_pe.dtype == jnp.int32 and rows.k_pe.shape == (2, n // PAGE, PAGE * cfg.qk_rope_head_dim // 2)
  assert bits.k_pe.dtype == jnp.uint16 and bits.k_pe.shape == (2, n, cfg.qk_rope_head_dim)
  scales = -(-cfg.kv_lora_rank // 128)  # the latent's f32 scales a slot: a page of slots a row here, too
  assert rows.c_kv_scale.shape == (2, n // PAGE, PAGE * scales) and bits.c_kv_scale.shape == (2, n, scales)
  table = jnp.asarray([[3, 7, 1], [2, 0, 9]], jnp.int32)  # [B,P]
  positions = jnp.where(jnp.arange(s)[None] < jnp.asarray([[s], [s - 3]]), jnp.arange(s)[None], -1)  # row 1: padding
  e = {k: jnp.stack([v, -2 * v]) for k, v in _entries(cfg, b, s, seed=7).items()}  # [2,B,S,n]: two layers
  ids = paged_pools.slots(table, positions, PAGE, n)
  rows, bits = (paged_pools.write(p, ids, **e) for p in (rows, bits))
  assert np.asarray(rows.k_pe).any()
  idx = jnp.asarray([[0, 11, 5, 4], [8, 1, 2, 0]], jnp.int32)
  rng = np.random.default_rng(8)
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  r = cfg.qk_rope_head_dim
  q = (f(b, 1, 4, cfg.kv_lora_rank), f(b, 1, 4, r), f(b, 1, cfg.kv_lora_rank), f(b, 1, r))
  monkeypatch.setattr(paged_cache, "KEY_BLOCK_BYTES", 1)  # a page a block
  for layer in range(2):
    got, want = (jax.tree.map(lambda a: a[layer], p) for p in (rows, bits))
    for g, w in zip(paged_cache.sequence_view(got, table, PAGE), paged_cache.sequence_view(want, table, PAGE)):
      if w is not None:
        np.testing.assert_array_equal(np.asarray(kv_cache.as_values(g)), np.asarray(kv_cache.as_values(w)))
    for g, w in zip(paged_cache.gather_selected(got, table, idx, PAGE), paged_cache.gather_selected(want, table, idx, PAGE)):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    _, pe = paged_cache.gather_selected(got, table, idx, PAGE)
    np.testing.assert_array_equal(np.asarray(pe)[1, 1], np.asarray(e["k_pe"][layer, 1, 1].astype(jnp.bfloat16)))
    dense = [paged_cache.dense_over_pages(p, table, PAGE, *q, jnp.asarray([s - 1, s - 4]), 0.3) for p in (got, want)]
    np.testing.assert_array_equal(np.asarray(dense[0]), np.asarray(dense[1]))


def test_the_tpu_rows_k_pe_pool_is_lane_dense_and_gathered_and_written_without_a_pool_copy():
  """At the official sizes (rope 64, page 64 here 4) the tpu row holds k_pe as int32 [N/4, 128]: whole 128-word
  rows that a TPU gathers and scatters where they lie (as uint16 [N, 64] it was laid out column-major and
  copied whole each 16-row 128K step: 1.27 of 10.3 ms, docs/kernels.md). Its write and the selected rows'
  gather have no pool-sized op but the in-place scatter, and the rows read back the bits pool's values."""
  cfg = make_config(kv_cache_dtype="fp8", kv_lora_rank=512, qk_rope_head_dim=64, indexer_head_dim=128,
                    serve_page_size=PAGE)
  n = 64 * PAGE
  with backend.forced("tpu"):
    pools = paged_pools.init_layer_pools(cfg, n)
  _, bits = _rows_and_bits(cfg, n)
  assert pools.k_pe.dtype == jnp.int32 and pools.k_pe.shape == (n // 4, 128)
  assert pools.c_kv_scale.shape == (n // PAGE, PAGE * 4)  # 32 slots a 128-word row, or a page's at pages under 32
  e = _entries(cfg, 2, 3, seed=9)
  table = jnp.asarray([[5, 2], [9, 1]], jnp.int32)
  ids = paged_pools.slots(table, jnp.asarray([[0, 1, 2], [0, 1, -1]], jnp.int32), PAGE, n)
  write = jax.jit(paged_pools.write, donate_argnums=(0,))
  wrote = _pool_sized(write.lower(pools, ids, **e).compile().as_text(), n * 32)  # k_pe: n x 32 words
  assert not wrote, wrote
  pools, bits = write(pools, ids, **e), write(bits, ids, **e)
  idx = jnp.asarray([[2, 0, 1], [1, 0, 0]], jnp.int32)
  gather = jax.jit(lambda p, t, i: paged_cache.gather_selected(p, t, i, PAGE))
  read = _pool_sized(gather.lower(pools, table, idx).compile().as_text(), n * 32)
  assert not read, read
  for g, w in zip(gather(pools, table, idx), gather(bits, table, idx)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_the_engine_step_and_write_over_the_tpu_rows_pools_hold_no_pool_sized_array():
  """The fp8 engine's compiled decode step and write (rows x 1 token) with the tpu row's pools (latent as uint32
  words, k_pe as int32 rows): no op makes an array as large as a layer's k_pe pool (the smallest pool field
  checked) but the in-place updates. A reader that decoded or relaid a whole pool before picking its rows
  would (on a TPU the uint16 k_pe and uint8 latent pools were copied whole each step: docs/kernels.md). And the
  selected latents are gathered from the pool once, not again as f32 rows."""
  from MaxText import serve_compile
  from MaxText.runtime import sharding
  pages, page = 512, 8
  cfg = make_config(kv_cache_dtype="fp8", kv_lora_rank=512, qk_rope_head_dim=64, indexer_head_dim=128,
                    serve_page_size=page, serve_num_pages=pages, max_target_length=64, serve_max_num_seqs=2,
                    max_prefill_length=16, num_decoder_layers=1)
  mesh = sharding.create_mesh(cfg)
  with backend.forced(rope_storage="rows"), jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    engine = serve_compile.build_engine(cfg)  # abstract: nothing allocated
    step, write, _ = engine.compile_step(2, 1)
  pool = engine.pools["dense_layers"]
  assert pool.k_pe.shape == (1, pages * page // 4, 128) and pool.k_pe.dtype == jnp.int32
  assert pool.c_kv.shape == (1, pages * page, 128) and pool.c_kv.dtype == jnp.uint32
  assert pool.c_kv_scale.shape == (1, pages * page // page, page * 4) and pool.c_kv_scale.dtype == jnp.float32
  for program in (step, write):
    big = _pool_sized(program.as_text(), pages * page * 32)  # one layer's k_pe: N x 32 words
    assert not big, big
  # the selected latents are gathered once, as stored (uint32 words): no f32 gather of 512-wide rows after it (the
  # merge's per-slot take of the new token, gather_attend's identity gather: 67 MB each at 16 rows x 2048)
  again = [line.strip()[:120] for line in step.as_text().split("\n")
           if " gather(" in line and "= f32[" in line and re.search(r"slice_sizes=\{[\d,]*,512\}", line)]
  assert not again, again


@pytest.mark.parametrize("t", [1, 3])
def test_merge_selected_takes_each_new_tokens_row_where_selected(t):
  """Selected positions that are this step's new tokens (start .. start+t-1) get the new rows, the rest keep the
  cache's; t = 1 (a decode step) broadcasts the one new row instead of gathering it per slot."""
  rng = np.random.default_rng(10)
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  c_sel, pe_sel, c_new, pe_new = f(2, 5, 6), f(2, 5, 4), f(2, t, 6), f(2, t, 4)
  start = jnp.asarray([7, 2], jnp.int32)
  flat = jnp.asarray([[7, 0, 7 + t - 1, 3, 6], [1, 2 + t - 1, 2, 9, 0]], jnp.int32)  # [b,n] positions
  c, pe = merge_selected(c_sel, pe_sel, c_new, pe_new, flat, start, jnp.float32)
  for got, sel, new in ((c, c_sel, c_new), (pe, pe_sel, pe_new)):
    want = np.array(sel)
    for r in range(2):
      for i, p in enumerate(np.asarray(flat[r])):
        if 0 <= p - int(start[r]) < t:
          want[r, i] = np.asarray(new)[r, p - int(start[r])]
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("queries", ["f32", "fp8"])  # the engine's fp32 queries, or fp8_scored_queries' (bf16)
@pytest.mark.parametrize("d", [128, 256])  # one fp8 scale a key (scaled after the dot), two (dequantized first)
def test_paged_fp8_keys_score_as_their_dequantized_values_to_fp32_rounding(d, queries, monkeypatch):
  # PagedKeys scores fp8 keys with one scale each as s * sum_h w relu(q . codes) (relu(s x) = s relu(x), s > 0:
  # DeepGEMM's order, and the Pallas kernel's), not sum_h w relu(q . (s codes)): another fp32 rounding of the
  # same sum. Both within 4 fp32 ulps of the float64 sum's magnitude sum_h |w_h| sum_d |q_hd k_d| (key scales
  # spread over 2^-12 .. 2^6, so a scale left out or taken from another slot is off by far more). With fp8
  # queries (bf16 e4m3 values) against one-scale keys the logits are ONE bf16 x bf16 dot with fp32 accumulation
  # (exact products: the same bound holds), not an fp32 dot of the same values (what the compiled program shows).
  rng = np.random.default_rng(7)
  h, page, pages, n = 4, 4, 6, 8 * 4
  x = rng.standard_normal((n, d)) * np.exp2(rng.uniform(-12, 6, (n, 1)))
  codes, scale = kv_cache.quantize_fp8(jnp.asarray(x, jnp.float32))
  table = jnp.asarray([[5, 0, 3, 7, 1, 2], [6, 4, 2, -1, -1, -1]], jnp.int32)  # [B,P]; -1: no page
  pos = jnp.asarray([[pages * page - 1], [10]], jnp.int32)  # [B,1]
  q = jnp.asarray(rng.standard_normal((2, 1, h, d)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, 1, h)), jnp.float32)
  if queries == "fp8":
    q, w = paged_decode.fp8_scored_queries(q, w)  # d 128: bf16 codes' values, w x scale; d 256: fp32 dequantized
  monkeypatch.setattr(paged_cache, "KEY_BLOCK_BYTES", 2 * page * d * 4)  # blocks of 2 pages: 3 a row
  keys = paged_cache.PagedKeys(jax.lax.bitcast_convert_type(codes, jnp.uint8), scale, table, page)
  scores = jax.jit(lambda q, w, p: keys.scores(q, w, p, head_chunk=h))
  got = np.asarray(scores(q, w, pos))  # [B,1,S]
  bf16_dot = re.search(r"dot_general[^\n]*\(tensor<[0-9x]*xbf16>, tensor<[0-9x]*xbf16>\) -> tensor<[0-9x]*xf32>",
                       scores.lower(q, w, pos).as_text())
  assert bool(bf16_dot) == (queries == "fp8" and d == 128)
  q = q.astype(jnp.float32)
  k64 = np.asarray(kv_cache.dequantize_fp8(codes, scale), np.float64)  # [n,d] the values the dequantized path scores
  slots = np.asarray(jnp.maximum(table, 0)).repeat(page, axis=1) * page + np.tile(np.arange(page), pages)  # [B,S]
  terms = np.einsum("bhd,bsd->bhs", np.asarray(q[:, 0], np.float64), k64[slots])  # [B,h,S]
  w64 = np.asarray(w[:, 0], np.float64)[:, :, None] * d ** -0.5  # [B,h,1]
  want = (np.maximum(terms, 0) * w64).sum(1)  # [B,S]
  mag = (np.abs(w64) * np.einsum("bhd,bsd->bhs", np.abs(np.asarray(q[:, 0], np.float64)), np.abs(k64[slots]))).sum(1)
  valid = np.arange(pages * page)[None] <= np.asarray(pos)  # [B,S]
  np.testing.assert_array_equal(np.isfinite(got[:, 0]), valid)
  assert np.all(np.abs(got[:, 0] - want)[valid] <= 4 * np.finfo(np.float32).eps * mag[valid])
  ref = ContiguousKeys(kv_cache.dequantize_fp8(codes, scale)[slots]).scores(q, w, pos, head_chunk=h)  # dequantized first
  assert np.all(np.abs(np.asarray(ref)[:, 0] - want)[valid] <= 4 * np.finfo(np.float32).eps * mag[valid])


def test_lookup_pages_by_one_hot_equals_the_gather_for_any_page_id(monkeypatch):
  """page_lookup "onehot" (the tpu row) gives take_along_axis' page ids exactly, ids up to int32's largest (each
  byte an exact bf16, one product in each f32 sum), a none entry (< 0) as page 0; its program has no gather.
  Past ONEHOT_MAX_PAGES pages a row it gathers, as the portable rows do."""
  table = jnp.asarray([[3, 2**31 - 1, -1, 2**24 + 5, 255, 256], [7, 0, 65535, 65536, 2**30 + 2**16 + 3, 1]], jnp.int32)
  pages = jnp.asarray([[0, 1, 2, 3, 4, 5, 1, 1, 3], [5, 4, 3, 2, 1, 0, 4, 0, 2]], jnp.int32)  # [B,m], m > P
  want = np.take_along_axis(np.maximum(np.asarray(table), 0), np.asarray(pages), axis=1)
  for choice, gathers in (("gather", 1), ("onehot", 0)):
    with backend.forced(page_lookup=choice):
      fn = jax.jit(lambda t, p: paged_cache.lookup_pages(t, p))  # a fresh function: traced under this choice
      np.testing.assert_array_equal(np.asarray(fn(table, pages)), want)
      hlo = fn.lower(table, pages).compile().as_text()
    assert sum(" gather(" in line for line in hlo.split("\n")) == gathers, choice
  for limit, gathers in ((table.shape[1], 0), (table.shape[1] - 1, 1)):  # P == the limit: still one-hot
    monkeypatch.setattr(paged_cache, "ONEHOT_MAX_PAGES", limit)
    with backend.forced(page_lookup="onehot"):
      hlo = jax.jit(lambda t, p: paged_cache.lookup_pages(t, p)).lower(table, pages).compile().as_text()
    assert sum(" gather(" in line for line in hlo.split("\n")) == gathers, limit


@pytest.mark.parametrize("dtype", ["float32", "fp8"])
def test_a_scanned_stacks_step_and_write_read_and_write_each_layers_pool_where_it_lies(dtype):
  """A scanned stack's pools [L, N, n]: the scan sliced them, so every layer's pool was copied out whole
  each step, and the write's 3-D scatter was laid out layer-minor (every stacked pool copied into that
  layout and back): a v5e's 4-layer 16-row 128K fp8 step took 50 ms, 13x a layer's 3.6. The step reads
  each layer in place (CacheView.layer, paged_pools.layer_of) and writes every layer by one 2-D scatter:
  neither program has an op the size of a layer's pool field but in-place ones (the engine's results
  themselves: test_decode)."""
  from MaxText import serve_compile
  from MaxText.runtime import sharding
  page = 8
  cfg = make_config(kv_cache_dtype=dtype, serve_page_size=page, max_target_length=64, serve_max_num_seqs=2,
                    max_prefill_length=16, num_decoder_layers=3, first_num_dense_layers=0, scan_layers=True,
                    serve_num_pages=2048)  # a layer's pool field (16K slots) outweighs every weight and step array
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    engine = serve_compile.build_engine(cfg)
    step, write, _ = engine.compile_step(2, 1)  # abstract: nothing allocated
  slots = cfg.serve_num_pages * page
  stacked = jax.tree.leaves(engine.pools)
  assert stacked and all(a.shape[0] == 3 and a.shape[1] in (slots, slots // 4) for a in stacked), stacked
  largest = max(a.shape[-2] * a.shape[-1] for a in stacked)  # one layer's largest field (the step's own arrays: less)
  for name, program in (("step", step), ("write", write)):
    assert not _pool_sized(program.as_text(), largest), name
