"""Decode step time vs context length: the paged engine against a contiguous cache of the same data, sparse
(indexer + top-k + gather over k latents) and dense (absorbed attention over the whole latent cache).

    python benchmarks/decode.py --quick                      # 32K and 128K, sparse only (~2 min here)
    python benchmarks/decode.py                              # 4K .. 128K, 1 layer, batch 1, fp32
    python benchmarks/decode.py --contexts 32768 131072 --batch 1 4 16 --cache-dtype fp8
    python benchmarks/decode.py --prefill --chunk 512 --contexts 4096 32768   # a prefill chunk after a long prefix
    python benchmarks/decode.py --prompt --contexts 32768 --chunk 512 --set num_query_heads=16 indexer_topk=512
    python benchmarks/decode.py --prompt --prompt-attention sparse dense --contexts 32768 131072 --chunk 2048
    python benchmarks/decode.py --scoring --contexts 131072 --batch 4 --short-context 4096   # one long row, 3 short

The model has the official attention shapes (WIDE) on a narrow residual stream (--set key=value overrides it).
Prints per row the paged and contiguous ms (--stat of --iters calls, alternated), the bytes a step must move and
the roofline fraction (BANDWIDTH, else measured), paged / contiguous with its quartiles; one JSON line.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx

from benchmarks import timing
from MaxText.checkpoint import model_state  # noqa: E402
from MaxText.config import pyconfig
from MaxText.inference import kv_cache, paged_cache, step_feed  # noqa: E402
from MaxText.inference.cache_view import stack_views, write_stacks
from MaxText.inference.model_step import step_head_chunk
from MaxText.inference.sampling import greedy_ids
from MaxText.inference.scheduler import SamplingParams
from MaxText.inference.serving import ServingEngine  # noqa: E402
from MaxText.kernels import backend
from MaxText.kernels.cached_attention import ContiguousKeys
from MaxText.runtime import sharding

WIDE = dict(  # official attention dims, narrow everything else
    model_name="default", vocab_size=512, emb_dim=1024, mlp_dim=1024, first_num_dense_layers=1,
    num_query_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, indexer_n_heads=64, indexer_head_dim=128, use_indexer=True,
    rope_factor=40.0, original_max_position_embeddings=4096, max_position_embeddings=163840,
    num_experts=8, num_experts_per_tok=2, n_routing_groups=4, topk_routing_group=2, moe_mlp_dim=256,
    mtp_num_layers=0, ici_data_parallelism=1,
)
PAGE = 64
# Memory bandwidth per device kind (GB/s; the first name in jax.devices()[0].device_kind wins): the roofline's
# denominator. The CPU has no entry: a jitted sum over 512 MiB measures it in the run (`bandwidth`).
BANDWIDTH = (("v5 lite", 819.0), ("v5e", 819.0), ("v5p", 2765.0), ("v6", 1640.0), ("H200", 4800.0), ("H100", 3350.0))


def bandwidth() -> tuple[float, str]:
  """(GB/s, where it came from) for this process's device: BANDWIDTH, else measured (a reduction reading 512 MiB,
  the best of 5)."""
  kind = jax.devices()[0].device_kind
  for name, gbs in BANDWIDTH:
    if name.lower() in kind.lower():
      return gbs, f"{kind} (table)"
  x = jnp.ones((1 << 27,), jnp.float32)
  f = jax.jit(jnp.sum)
  best = min(timing.interleaved({"sum": lambda: f(x)}, 5, warmup=0)[0]["sum"])
  return x.nbytes / best / 1e9, f"{kind}: measured (a sum over 512 MiB)"


def step_bytes(cfg, params, batch: int, context: int) -> dict:
  """The bytes one decode step must move at least (its roofline bound's numerator), per part: every
  parameter once (weights), and per row and layer the cache it reads: sparse, every indexer key (and
  its scale) plus the k selected latents (c_kv, k_pe, scales); dense, every latent."""
  latent, rotary = kv_cache.field_dtypes(cfg.kv_cache_dtype)  # one slot's fields (kv_cache's layout)
  dt = {"c_kv": latent, "k_pe": rotary, "idx_k": latent, "c_kv_scale": jnp.float32, "idx_k_scale": jnp.float32}
  per = {name: w * jnp.dtype(dt[name]).itemsize for name, w in kv_cache.field_widths(cfg).items()}
  latent = per["c_kv"] + per["k_pe"] + per["c_kv_scale"]
  keys = per["idx_k"] + per["idx_k_scale"]
  layers = cfg.num_decoder_layers
  weights = sum(a.nbytes for a in jax.tree.leaves(params))
  k = min(cfg.indexer_topk, context)
  return dict(weights=weights, sparse=weights + batch * layers * (context * keys + k * latent),
              dense=weights + batch * layers * context * latent)


def model_args(ap, cache_dtype: str, iters: int) -> None:
  """The model's and the timing's flags, decode_profile.py's too (and timing.parse's --set, --force)."""
  ap.add_argument("--layers", type=int, default=1, help="decoder layers (more: the per-call floor shared as deep)")
  ap.add_argument("--topk", type=int, default=2048)
  ap.add_argument("--cache-dtype", default=cache_dtype, choices=["float32", "bfloat16", "fp8"])
  ap.add_argument("--short-context", type=int, default=0, help="rows after the first at this position (decode.py: "
                  "--scoring only; their tables as wide as the first's; 0: all at the context)")
  ap.add_argument("--iters", type=int, default=iters)


def config_for(context: int, args, batch: int = 1):
  model = {**WIDE, "indexer_topk": args.topk, **timing.overrides(args.set)}
  page = int(model.pop("serve_page_size", PAGE))  # --set serve_page_size=256: the pools' page (the tpu config's)
  return pyconfig.initialize(["bench", "base.yml"], num_devices=1, num_decoder_layers=args.layers,
                             max_target_length=context, max_prefill_length=min(context, args.chunk),
                             serve_max_num_tokens=max(batch, min(context, args.chunk)),
                             kv_cache_dtype=args.cache_dtype, serve_max_num_seqs=batch, serve_page_size=page,
                             serve_num_pages=batch * -(-context // page), **model)


FILL_SLOTS = 1 << 18  # slots filled per program, over all of a stack's layers: a [chunk, 512] f32 draw (512 MiB) at most


def fill_pools(engine: ServingEngine, seed: int) -> None:
  """Every slot of the engine's pools random (normal latents; fp8 fields with unit scales), FILL_SLOTS
  slots at a time into the pools in place (donated): drawing a 16-row 128K pool at once held 8 GB of
  f32 values and random bits beside it."""
  key = jax.random.key(seed)

  @functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(3, 4))
  def put(a, key, start, n, ones):  # a [L, N, w] or [N, w]: slots start .. start+n drawn (ones: a scale field)
    shape = a.shape[:-2] + (n, kv_cache.value_width(a))  # values (fp8 latent: 4 a uint32 word)
    values = jnp.ones(shape, jnp.float32) if ones else jax.random.normal(jax.random.fold_in(key, start), shape)
    return jax.lax.dynamic_update_slice_in_dim(a, kv_cache.to_storage(values, a.dtype), start, axis=a.ndim - 2)

  def fill(pool, key):  # a stacked PagedLayerCache [L,N,..] or a list of per-layer ones [N,..]
    if isinstance(pool, list):
      return [fill(p, jax.random.fold_in(key, i)) for i, p in enumerate(pool)]
    out = {}
    for i, (name, a) in enumerate(pool._asdict().items()):
      if a is not None:
        n = a.shape[-2]
        chunk = min(max(1, FILL_SLOTS // math.prod(a.shape[:-2])), n)  # slots a call: FILL_SLOTS over every layer
        for start in range(0, n, chunk):  # the last chunk ends at N (it may redraw slots before it)
          a = put(a, jax.random.fold_in(key, i), min(start, n - chunk), chunk, name.endswith("_scale"))
      out[name] = a
    return type(pool)(**out)

  engine.pools = {name: fill(p, jax.random.fold_in(key, i)) for i, (name, p) in enumerate(engine.pools.items())}


def step_feed_at_end(engine: ServingEngine, batch: int, t: int) -> dict:
  """`batch` rows of t new tokens each, the row's last t positions over its own pages (a decode
  step for t = 1, a prefill chunk over a cached prefix of S - t otherwise), writes dropped. The
  rows' pages are a random permutation of the pool's, as in a pool that has served many requests."""
  s, p = engine.pages_per_seq * engine.page_size, engine.pages_per_seq
  feed = step_feed.empty(batch, t, p)  # temperature 0, write_pos -1
  feed["tokens"][:], feed["positions"][:] = 1, s - t + np.arange(t, dtype=np.int32)
  feed["last"][:], feed["draw_at"][:] = t - 1, s
  feed["table"][:] = np.random.default_rng(p).permutation(batch * p).astype(np.int32).reshape(batch, p)  # fragmented
  return feed


def paged_step(engine: ServingEngine, feed: dict):
  """The engine's step and write programs on the feed: a function () -> sampled [B] (the write is
  dropped, so the pools keep their data), returning once both programs have run."""
  def run():
    engine.pools, sampled, _ = engine.run(feed["t"], feed)
    jax.block_until_ready(engine.pools)  # the write too: left running, its time went to the next variant's call
    return sampled
  return run


def contiguous_step(engine: ServingEngine, feed: dict):
  """The same step over a contiguous copy of the pools' rows: a function () -> sampled [B] that
  runs the model with kv_cache.LayerCache views (no page table) and writes its entries in place.
  Its tokens and positions travel from the host every call, as the engine's feed does (closed
  over as constants, XLA would fold the masks and splice offsets that depend on them)."""
  cfg, t = engine.config, feed["t"]
  table = jnp.asarray(feed["table"])
  host = np.concatenate([feed["tokens"], feed["positions"]], axis=1).astype(np.int32)  # [B, 2t]

  def as_rows(pool):  # a stacked pool [L,N,n] -> a LayerCache [L,B,S,n] (idx_k [L,B,d,S])
    if isinstance(pool, list):
      return [paged_cache.sequence_view(p, table, engine.page_size) for p in pool]
    return jax.vmap(lambda p: paged_cache.sequence_view(p, table, engine.page_size))(pool)

  state = {"stores": jax.jit(lambda pools: {n: as_rows(p) for n, p in pools.items()})(engine.pools)}
  graphdef, head_chunk = engine.graphdef, step_head_chunk(cfg, engine.chunk, t)

  @jax.jit
  def step(params, buffers, stores, absorbed, inputs):  # inputs [B, 2t]: tokens, positions
    model = nnx.merge(graphdef, params, buffers)
    views = stack_views(stores, absorbed, mode=engine.mode, index_head_chunk=head_chunk)
    tokens, positions = inputs[:, :t], inputs[:, t:]
    logits, aux = model(tokens, positions, cache=views, last_index=jnp.full(tokens.shape[0], t - 1, jnp.int32))
    return aux["cache_entries"], greedy_ids(logits[:, 0])

  def write(stores, entries, inputs):  # at the row's first new position: every call writes the same entries
    return write_stacks(stores, entries, lambda store, **e: kv_cache.write(store, inputs[:, t], **e))

  write = jax.jit(write, donate_argnums=(0,))

  def run():
    inputs = jnp.asarray(host)
    entries, sampled = step(engine.params, engine.buffers, state["stores"], engine.absorbed, inputs)
    state["stores"] = write(state["stores"], entries, inputs)
    jax.block_until_ready(state["stores"])  # as the paged step: its write inside its own time
    return sampled

  return run


def step_rows(args, params, buffers, gbs: float) -> list[dict]:
  modes = ("sparse",) if args.sparse_only else ("sparse", "dense")
  print(f"{'rows':>4} {'context':>8} " + " ".join(f"{m + ' ' + v:>16}" for m in modes for v in ("paged ms", "contig ms"))
        + " " + " ".join(f"{m + ' MB':>10} {m + ' roofline':>14}" for m in modes)
        + " " + " ".join(f"{m + ' p/c [quartiles]':>26}" for m in modes) + ("  dense/sparse" if len(modes) == 2 else ""))
  rows = []
  for batch in args.batch:
    for s in args.contexts:
      cfg = config_for(s, args, batch)
      graphdef, _, _ = model_state.abstract_model(cfg)
      need = step_bytes(cfg, params, batch, s)
      copy = batch * s * cfg.num_decoder_layers * kv_cache.bytes_per_token_per_layer(cfg)  # the reference's cache
      reference = args.contiguous == "on" or (args.contiguous == "auto" and copy <= 2 ** 30)
      row = dict(rows=batch, context=s, contiguous=reference)
      for mode in modes:
        engine = ServingEngine(cfg, graphdef, params, buffers, attention=mode)
        fill_pools(engine, seed=s)
        feed = step_feed_at_end(engine, batch, args.chunk if args.prefill else 1)
        fns = {"paged": paged_step(engine, feed)}
        if reference:  # built only when asked for: it holds a copy of the rows' cache (6.6 GiB at 4 rows, 128K)
          fns["contiguous"] = contiguous_step(engine, feed)
        got, out = timing.interleaved(fns, args.iters)
        row[f"{mode}_ms"] = round(args.pick(got["paged"]) * 1e3, 3)
        row[f"{mode}_bytes"] = need[mode]
        row[f"{mode}_bound_ms"] = round(need[mode] / gbs / 1e6, 4)
        row[f"{mode}_roofline"] = round(row[f"{mode}_bound_ms"] / row[f"{mode}_ms"], 4)
        if reference:
          row[f"{mode}_same_tokens"] = bool(np.array_equal(out["paged"], out["contiguous"]))  # greedy, same data
          row[f"{mode}_contiguous_ms"] = round(args.pick(got["contiguous"]) * 1e3, 3)
          ratio, quartiles = timing.paired_ratio(got["paged"], got["contiguous"])
          row[f"{mode}_ratio"], row[f"{mode}_ratio_q"] = round(ratio, 3), [round(q, 3) for q in quartiles]
        del engine, fns
      nan = float("nan")
      line = f"{batch:>4} {s:>8} " + " ".join(f"{row.get(f'{m}{v}_ms', nan):>16.1f}" for m in modes
                                              for v in ("", "_contiguous"))
      line += " " + " ".join(f"{row[m + '_bytes'] / 1e6:>10.0f} {row[m + '_roofline']:>14.3f}" for m in modes)
      line += " " + " ".join(f"{row[m + '_ratio']:>11.2f}x [{row[m + '_ratio_q'][0]:.2f}-{row[m + '_ratio_q'][1]:.2f}]"
                             if reference else f"{'(no contiguous)':>26}" for m in modes)
      if len(modes) == 2:
        line += f"  {row['dense_ms'] / row['sparse_ms']:>11.1f}x"
      differ = [m for m in modes if reference and not row[f"{m}_same_tokens"]]
      print(line + (f"  (paged and contiguous sampled different tokens: {', '.join(differ)})" if differ else ""),
            flush=True)
      rows.append(row)
  return rows


def scoring_rows(args) -> list[dict]:
  """--scoring: the indexer's scoring + top-k of one decode step alone (64 heads of 128, fp32 keys), the contiguous
  cache's ContiguousKeys (one batched matmul) beside the paged pool's PagedKeys (a block of whole pages a row at a
  time, 2-D dots: the engine's "xla" route); each row's query at its last position (--short-context N: every row
  but the first at N - 1; PagedKeys reads no block past a row's position, the contiguous cache scores every slot)
  -> rows {rows, context, scoring_ms, scoring_contiguous_ms, scoring_ratio(_q), same_selection (as sets)}."""
  h, d, k = 64, 128, args.topk
  top = lambda x: jnp.sort(jax.lax.top_k(x, k)[1], axis=-1)  # noqa: E731  [b,1,k] as a set
  contiguous = jax.jit(lambda k, q, w, pos: top(ContiguousKeys(jnp.swapaxes(k, 1, 2)).scores(q, w, pos, head_chunk=h)))
  paged = jax.jit(lambda k, t, q, w, pos: top(paged_cache.PagedKeys(k, None, t, PAGE).scores(q, w, pos, head_chunk=h)))
  print(f"{'rows':>4} {'context':>8} {'paged ms':>10} {'contig ms':>10} {'p/c [quartiles]':>22}")
  rows = []
  for b in args.batch:
    for s in args.contexts:
      rng = np.random.default_rng(s)
      p = s // PAGE
      pool = jnp.asarray(rng.standard_normal((b * s, d), np.float32))  # [N,d]
      table = jnp.asarray(rng.permutation(b * p).astype(np.int32).reshape(b, p))  # [b,P]
      stored = jnp.swapaxes(pool.reshape(b * p, PAGE, d)[table].reshape(b, s, d), 1, 2) + 0  # [b,d,S]
      q = jnp.asarray(rng.standard_normal((b, 1, h, d), np.float32))  # [b,1,h,d]
      w = jnp.asarray(rng.random((b, 1, h), np.float32))  # [b,1,h]
      pos = jnp.full((b, 1), s - 1, jnp.int32)  # [b,1]
      if args.short_context:
        pos = pos.at[1:].set(min(args.short_context, s) - 1)  # one long row, the rest short
      got, out = timing.interleaved({"paged": lambda: paged(pool, table, q, w, pos),
                                     "contiguous": lambda: contiguous(stored, q, w, pos)}, args.iters)
      ratio, quartiles = timing.paired_ratio(got["paged"], got["contiguous"])
      row = dict(rows=b, context=s, scoring_ms=round(args.pick(got["paged"]) * 1e3, 3),
                 scoring_contiguous_ms=round(args.pick(got["contiguous"]) * 1e3, 3), scoring_ratio=round(ratio, 3),
                 scoring_ratio_q=[round(x, 3) for x in quartiles],
                 same_selection=bool(np.array_equal(out["paged"], out["contiguous"])))
      rows.append(row)
      print(f"{b:>4} {s:>8} {row['scoring_ms']:>10.2f} {row['scoring_contiguous_ms']:>10.2f} {ratio:>11.2f}x "
            f"[{quartiles[0]:.2f}-{quartiles[1]:.2f}]" + ("" if row["same_selection"] else "  selections differ"),
            flush=True)
  return rows


def prompt_rows(args, params, buffers) -> list[dict]:
  """--prompt: per context, one prompt of context - 1 tokens (greedy, max_tokens 1) through ServingEngine.step as a
  server runs it (the scheduler's --chunk chunks, each step's table as wide as its context bucket), every step timed
  after engine.warmup -> rows {context, attention, prefix, slots, tokens, ms}, then per (context, attention) the
  prompt's tokens/s (--prompt-attention: sparse, dense or both, each its own engine on the same parameters)."""
  rows = []
  print(f"{'context':>8} {'attention':>9} {'prefix':>8} {'tokens':>7} {'slots read':>10} {'ms':>10}")
  for s, mode in ((s, m) for s in args.contexts for m in args.prompt_attention):
    cfg = config_for(s, args)
    graphdef, _, _ = model_state.abstract_model(cfg)
    engine = ServingEngine(cfg, graphdef, params, buffers, attention=mode)
    programs = engine.warmup()
    prompt = np.random.default_rng(s).integers(1, cfg.vocab_size, s - 1).tolist()
    engine.generate([prompt[:2 * args.chunk]], SamplingParams(max_tokens=1))  # the host side's first calls
    engine.reset()
    request = engine.add_request(prompt, SamplingParams(max_tokens=1))
    while not engine.idle:
      prefix = request.computed
      tokens = min(args.chunk, len(prompt) - prefix)  # this step's chunk (the scheduler's rule, one request)
      pages = -(-(prefix + tokens) // engine.page_size)
      slots = next(c for c in engine.contexts if c >= pages) * engine.page_size  # the step's table width
      t0 = time.perf_counter()
      engine.step()  # returns once the sampled token is on the host
      ms = (time.perf_counter() - t0) * 1e3
      rows.append(dict(context=s, attention=mode, prefix=prefix, tokens=tokens, slots=slots, ms=round(ms, 3)))
      print(f"{s:>8} {mode:>9} {prefix:>8} {tokens:>7} {slots:>10} {ms:>10.1f}", flush=True)
    assert request.output, "the prompt finished without its token"
    total = sum(r["ms"] for r in rows if r["context"] == s and r["attention"] == mode)
    print(f"  context {s}, {mode}: {len(prompt)} prompt tokens in {total / 1e3:.2f} s, {len(prompt) / total * 1e3:,.0f} tokens/s "
          f"({programs} step programs compiled first)")
    del engine
  return rows


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 8192, 16384, 32768, 65536, 131072])
  ap.add_argument("--quick", action="store_true", help="contexts 32768 131072, sparse only, 5 iters")
  ap.add_argument("--sparse-only", action="store_true", help="skip the dense columns")
  ap.add_argument("--batch", type=int, nargs="+", default=[1], help="rows a step, each its own sequence (each in turn)")
  ap.add_argument("--contiguous", default="auto", choices=["auto", "on", "off"], help="auto: when its copy fits 1 GiB")
  model_args(ap, "float32", 8)
  ap.add_argument("--prefill", action="store_true", help="a --chunk-token chunk at the end of the context instead")
  ap.add_argument("--prompt", action="store_true", help="a prompt of context - 1 tokens through the engine instead")
  ap.add_argument("--prompt-attention", nargs="+", default=["sparse"], choices=["sparse", "dense"], help="--prompt's")
  ap.add_argument("--scoring", action="store_true", help="the indexer's scoring + top-k alone instead")
  ap.add_argument("--chunk", type=int, default=512, help="the prefill chunk (max_prefill_length)")
  ap.add_argument("--stat", default="min", choices=["min", "median"])
  args, force = timing.parse(ap, argv, "model config overrides over WIDE")
  args.pick = min if args.stat == "min" else statistics.median
  if args.quick:
    args.contexts, args.sparse_only, args.iters = [32768, 131072], True, min(args.iters, 5)
  if args.prompt and len(args.batch) > 1:
    ap.error("--prompt runs one request: give one --batch")
  with backend.forced(**force):
    measure(args)


def measure(args) -> None:
  """main's measurements, under its forced kernel choices."""
  if args.scoring:
    print(f"the indexer's scoring + top-{args.topk} of one decode step; backend {jax.default_backend()}, rows "
          f"{args.batch}, 64 heads of 128, pages of {PAGE}; {args.stat} of {args.iters}; paged / contiguous"
          + (f"; rows after the first at {args.short_context}" if args.short_context else ""))
    print(json.dumps(dict(benchmark="decode_scoring", backend=jax.default_backend(), topk=args.topk, stat=args.stat,
                          iters=args.iters, short_context=args.short_context, rows=scoring_rows(args))))
    return
  cfg0 = config_for(args.contexts[0], args)
  mesh = sharding.create_mesh(cfg0)
  _, params, buffers, _ = model_state.create(cfg0, mesh)  # parameters do not depend on the context
  what = (f"a prompt through the engine in {args.chunk}-token chunks" if args.prompt else
          f"a {args.chunk}-token prefill chunk at the end of each context" if args.prefill else "a decode step")
  print(f"{what}; backend {jax.default_backend()} ({os.cpu_count()} cpus); {args.layers} layer(s), rows {args.batch}, "
        f"{model_state.count_params(params) / 1e6:.0f}M parameters; top-k {cfg0.indexer_topk}; "
        f"{kv_cache.describe(cfg0).split(';')[0]}"
        + ("" if args.prompt else f"; {args.stat} of {args.iters} steps"))
  common = dict(backend=jax.default_backend(), layers=args.layers, topk=cfg0.indexer_topk, cache_dtype=args.cache_dtype,
                overrides=args.set, forced=args.force)
  if args.prompt:
    print(json.dumps(dict(benchmark="decode_prompt_chunks", chunk=args.chunk, **common,
                          rows=prompt_rows(args, params, buffers))))
    return
  gbs, source = bandwidth()
  print(f"roofline: the bytes a step must move (weights + indexer keys + selected latents; dense: every latent) "
        f"at {gbs:.1f} GB/s ({source})")
  rows = step_rows(args, params, buffers, gbs)
  name = "decode_prefill_chunk" if args.prefill else "decode"
  print(json.dumps(dict(benchmark=name, chunk=args.chunk if args.prefill else 1, **common, bandwidth_gbs=round(gbs, 1),
                        bandwidth_source=source, stat=args.stat, iters=args.iters, rows=rows)))


if __name__ == "__main__":
  main()
