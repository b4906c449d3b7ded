"""The continuous-batching engine: requests join and leave between steps, over paged caches.

    engine = ServingEngine(config, graphdef, params, buffers)
    r = engine.add_request([1, 17, 42], SamplingParams(max_tokens=8))
    while not engine.idle:
        for request, token in engine.step():   # the tokens made in this step
            ...

Each `step` asks the scheduler (scheduler.py) for its rows, decode rows and prefill chunks
together under serve_max_num_tokens, then runs ONE jitted program of fixed shape [B, t]: B the
rows padded to a power of two (at most serve_max_num_seqs), t the smallest width holding the
step's widest row: 1 when every row decodes, else one of serve_width_buckets prefill widths
(chunk, chunk/2, chunk/4, ...: a short prompt's step is not padded to a whole chunk); a row's real
tokens first, padding after (its writes are dropped); its page table as wide as the smallest of
serve_context_buckets widths (P, P/2, ...) holding its longest row's pages (attention and the indexer
read table width x page size slots a row). Its inputs travel as one int32 array (step_feed.py).
The program is the model's own call with a cache (Transformer(cache=...): every layer's
MLA.attend_cached) over the paged pools (paged_cache.py) seen through the step's page table,
then the per-row sampling (penalties.py: each request's logit_bias, min_tokens, repetition,
frequency and presence penalties and min_p, a variant of the step only when a row sets them; then
sampling.sample_rows: each request's temperature, top_p, top_k and seed; no sort or draw unless a
row needs it). A second jitted program writes the new
tokens' entries into their slots (in place: the pools are donated). So at most (row buckets) x
(widths) x (contexts) step programs are compiled (and as many writes), said at start.

Pages: serve_page_size tokens each, serve_num_pages per pool (0: room for serve_max_num_seqs
sequences of max_target_length). A finished request frees its pages at once; with
serve_prefix_caching its full pages stay cached for later prompts with the same prefix.
On a mesh (built under sharding.logical_rules) attention is data-parallel over sequences: the
pools shard over pages on the rows' mesh axes (paged_cache.py), the allocator splits its pages in
as many shards (page_allocator.py), and a step puts each row in its home shard's block of B/D rows,
so each device runs its own sequences over its own pages; the experts run over `expert`
(the MoE layer's all-to-all dispatch). Params/buffers given as abstract ShapeDtypeStructs (with
shardings) make an abstract engine: nothing allocated, `compile_step(b, t)` for serve_compile
(the speculative step when speculating). `load_weights` serves other weights of the same model
(a later checkpoint) with the compiled programs kept.
Logprobs (logprobs.py): a step holding a row whose request asks for them runs the step's with_logprobs variant,
the same model call keeping every row position's logits, returning [B,t,N+1] values (the next token's
logprob and the top N = serve_max_logprobs); other steps run the plain one. Not when speculating.
Rollouts (rollout.py, RL): a step holding a rollout request's row runs the step's with_rollout variant (the
plain or with_logprobs step plus each row's sampled token's logprob under its sampling distribution, its kept set
(size, and ids up to rollout.KEPT_IDS) and the step's routed experts [B,t,L,k]); the host keeps them in
Request.rollout. Not when speculating.
Structured outputs (grammar.py, with `grammars`): a request with a grammar waits out of the queue while
its grammar compiles on a worker thread (others keep stepping); a step holding a sampling row with a
grammar runs the step program's masked variant, its [B, ceil(V/32)] int32 bitmask filled on the host
(rows without a grammar all ones), and after it each such row's token advances its matcher.
LoRA adapters (serve_lora_adapters; checkpoint/lora_adapters.py builds the params): the adapted linears hold every
served adapter stacked on a slot axis, a request's SamplingParams.lora_adapter is its slot (0: the base), carried
per row in the step feed, and the step adds each row's own adapter (layers/lora_rows.py): any mix of adapters
shares one batch and one compiled program. Its pages' prefix keys start from its adapter (Request.prefix_root).
Seeds: a request's key for its i-th position is fold_in(key(seed), i), its seed given or drawn
from the engine's `seed` stream; greedy (temperature 0) needs none.

Speculative decoding (serve_speculative_tokens k > 0, MTP module 0 as the drafter, with its own
paged pool under the same page table; step_spec.py): a decoding row is [its newest token, its k
drafts], t = 1 + k when every row decodes (the widths are 1 + k and the prefill ones); the step
verifies the drafts against the target (sampling.verify_drafts: greedy accepts the longest prefix equal to
the argmax, sampling is rejection sampling, so outputs keep the target's distribution), then runs
the MTP layer over every row position (the target's h_i and token i+1: the accepted tokens, then
the drawn one) so its cache holds every computed position, and drafts the next k tokens from the
last accepted position (k > 1: the module chained on its own h, one position a pass).
On a mesh the MTP pool shards over pages as the stacks' pools do.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.config.types import Config, ConfigError
from MaxText.inference import grammar, logprobs, paged_pools, penalties, rollout, step_channel, step_feed
from MaxText.inference.cache_view import stack_views, write_stacks
from MaxText.inference.model_step import (
  compiled_outputs,
  default_attention,
  model_absorbed_weights,
  run_or_shape,
  step_head_chunk,
)
from MaxText.inference.page_allocator import PageAllocator
from MaxText.inference.sampling import sample_rows
from MaxText.inference.scheduler import Request, RequestError, SamplingParams, Scheduled, Scheduler
from MaxText.inference.step_spec import SpecStep
from MaxText.layers import lora_rows
from MaxText.runtime import sharding
from MaxText.runtime.distributed import to_host


class ServingEngine:
  def __init__(self, config: Config, graphdef, params, buffers, *, attention: str | None = None,
               sample_vocab: int | None = None, eos_id: int | None = None, log=None,
               grammars: grammar.Grammars | None = None):
    """attention: "sparse" | "dense" (default: default_attention(config)). sample_vocab: sample only
    ids below it (a tokenizer smaller than vocab_size). eos_id: default config.eos_id. grammars: serves
    requests with a grammar (structured outputs; grammar.py)."""
    cfg = config
    self.config, self.graphdef, self.params, self.buffers = cfg, graphdef, params, buffers
    self.mode = attention or default_attention(cfg)
    self.page_size = cfg.serve_page_size
    self.pages_per_seq = -(-cfg.max_target_length // self.page_size)
    num_pages = cfg.serve_num_pages or cfg.serve_max_num_seqs * self.pages_per_seq
    self.mesh = sharding.active_mesh()[0] if sharding.active_mesh() else None
    self.shards = paged_pools.page_shards(cfg, self.mesh)
    for key, value in (("serve_max_num_seqs", cfg.serve_max_num_seqs), ("serve_num_pages", num_pages)):
      if value % self.shards:
        raise ConfigError(f"config key '{key}' = {value}: a multiple of the {self.shards} page shards (the mesh axes "
                          f"{paged_pools.page_axes(cfg, self.mesh)} that shard the rows)")
    self.abstract = isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct)
    self.max_seqs = cfg.serve_max_num_seqs
    self.chunk = min(cfg.prefill_chunk_size or cfg.max_prefill_length, cfg.serve_max_num_tokens)
    self.num_pages, self.eos_id = num_pages, cfg.eos_id if eos_id is None else eos_id
    self.sample_vocab, self.grammars = sample_vocab, grammars
    self.spec = SpecStep(self) if cfg.serve_speculative_tokens else None
    self.t_decode = 1 + cfg.serve_speculative_tokens  # a decode step's tokens per row
    self.t_mixed = max(self.chunk, self.t_decode)
    wide = {min(self.t_mixed, max(self.t_decode + 1, -(-self.chunk // 2 ** i)))
            for i in range(cfg.serve_width_buckets)}
    self.widths = sorted({self.t_decode} | wide)  # a step's tokens per row: the smallest holding its widest row
    self.contexts = sorted({-(-self.pages_per_seq // 2 ** i) for i in range(cfg.serve_context_buckets)})  # table widths
    self._absorb = jax.jit(lambda p, b: model_absorbed_weights(nnx.merge(graphdef, p, b)))
    self.absorbed = run_or_shape(self._absorb, self.abstract, params, buffers)
    # one program per (width, with_logprobs, with_rollout, grammar mask or not, adjust or not) and input shapes
    self._step_jit = jax.jit(self._step, static_argnums=(0, 1, 2))
    self.rollouts = rollout.RolloutRecorder(self.page_size, cfg.num_moe_layers, cfg.num_experts_per_tok)
    self._write_jit = jax.jit(self._write, static_argnums=(0,), donate_argnums=(1,))
    self._seeds = np.random.default_rng(cfg.seed)
    # several processes: process 0's Channel announces each device call (step_channel.py); one process: LOCAL
    self.channel = step_channel.LOCAL
    self.reset()
    if log is not None:
      log(f"serve: {num_pages} pages of {self.page_size} tokens per pool "
          f"({paged_pools.pool_bytes(cfg, num_pages, self.page_size) / 2**20:.1f} MiB), up to {self.max_seqs} "
          f"sequences and {cfg.serve_max_num_tokens} tokens a step; attention {self.mode}; at most "
          f"{len(self.buckets()) * len(self.widths) * len(self.contexts)} step programs: [rows, tokens, pages] in "
          f"{self.buckets()} x {self.widths} x {self.contexts}"
          + (f"; speculative: {cfg.serve_speculative_tokens} MTP drafts a step" if self.spec else ""))

  def load_weights(self, params, buffers) -> None:
    """Serves other weights of the same model (same shapes, dtypes and shardings, e.g. a later
    checkpoint of a run): their absorbed attention weights are computed, the compiled programs
    stay, and the engine is reset (every cached page was computed by the old weights)."""
    if self.abstract:
      raise ValueError("load_weights: an abstract engine (ShapeDtypeStruct params) runs nothing")
    if jax.tree.structure((params, buffers)) != jax.tree.structure((self.params, self.buffers)):
      raise ValueError("load_weights: the new params/buffers are not the engine's model (another tree)")
    self.params, self.buffers = params, buffers
    self.absorbed = self._absorb(params, buffers)
    if self.spec is not None:
      self.spec.load_weights()
    self.reset()

  def reset(self) -> None:
    """Empty pools, a new page allocator and scheduler (no request, nothing cached); the compiled
    programs stay."""
    self.channel.send("reset")
    cfg = self.config
    self.allocator = PageAllocator(self.num_pages, self.page_size, prefix_caching=cfg.serve_prefix_caching,
                                   shards=self.shards)
    self.scheduler = Scheduler(self.allocator, max_num_seqs=self.max_seqs, max_num_tokens=cfg.serve_max_num_tokens,
                               chunk=self.chunk, max_length=cfg.max_target_length, eos_id=self.eos_id,
                               vocab_size=cfg.vocab_size, speculative=cfg.serve_speculative_tokens)
    self.rollouts.pages.clear()  # computed by the old weights, like the pages
    self.scheduler.rollout_shareable = self.rollouts.shareable
    self.pools = paged_pools.init_pools(cfg, self.num_pages, self.page_size, self.mesh, abstract=self.abstract)
    self.held = grammar.Held()  # requests whose grammar compiles
    if self.spec is not None:
      self.spec.reset()
    if not self.abstract:
      # the pools now lie as every step returns them (on the params' mesh): no recompile. The program is
      # programs()[0], the first a warmup compiles (a start compiles nothing twice)
      self._noop(self.shards, self.t_decode, self.contexts[0])
    self.steps = 0

  def buckets(self) -> list[int]:
    """The row counts a step is padded to: page shards x powers of two, up to serve_max_num_seqs."""
    per = self.max_seqs // self.shards
    return sorted({self.shards * min(per, 1 << i) for i in range(per.bit_length() + 1)})

  def programs(self, first: bool = False) -> list[tuple[int, int, int]]:
    """Every step program's (rows, tokens, pages), smallest first: the shortest context, then the
    fewest rows, then every width. first: only the smallest bucket's at the shortest context (one per
    width): what one short request needs, its prefill then its decode (serve_warmup=first)."""
    every = [(b, t, pages) for pages in self.contexts for b in self.buckets() for t in self.widths]
    return every[:len(self.widths)] if first else every

  def warmup(self, shapes=None) -> int:
    """Compiles the step and write programs of `shapes` ((rows, tokens, pages) each; default: every one
    of programs()) on padding-only input: every write is dropped, nothing changes. Returns how many."""
    shapes = self.programs() if shapes is None else [tuple(int(v) for v in s) for s in shapes]
    self.channel.send("warmup", np.asarray(shapes, np.int32).reshape(-1, 3))  # [n, 3]: the followers' same list
    for b, t, pages in shapes:
      self._noop(b, t, pages)
    return len(shapes)

  def step_programs(self) -> int:
    """How many step programs are compiled so far: one per (rows, tokens, pages) shape and variant
    (with_logprobs, with_rollout, grammar mask), each compiled on first use."""
    return self._step_jit._cache_size()  # noqa: SLF001 - jax's jit has no public count of its programs

  def shape(self, rows: list[Scheduled]) -> tuple[int, int]:
    """A step's (tokens per row, page-table width): the smallest width holding its widest row (1 + k
    for decode rows) and the smallest context holding its longest row's pages. The attention and the
    indexer read table width x page size slots a row: a batch of short sequences reads a short view."""
    widest, pages = max(row.count for row in rows), max(len(row.request.pages) for row in rows)
    return next(w for w in self.widths if w >= widest), next(c for c in self.contexts if c >= pages)

  def _noop(self, b: int, t: int, pages: int) -> None:
    """A step of b padding rows of t tokens over a page table of `pages`: compiles that program, writes nothing."""
    feed = step_feed.empty(b, t, pages)
    if self.spec is not None:
      self.spec.run(t, feed)
      return
    self.pools, _, _ = self.run(t, feed)

  # ---- requests
  def add_request(self, prompt: Sequence[int], params: SamplingParams) -> Request:
    """Queues a request (RequestError naming the field for a bad one; the others are untouched)."""
    logprobs.check(params.logprobs, params.prompt_logprobs, self.config.serve_max_logprobs,
                   self.config.serve_speculative_tokens)
    if params.rollout and self.spec is not None:
      raise RequestError("rollout is not recorded with speculative decoding (serve_speculative_tokens="
                         f"{self.config.serve_speculative_tokens}): use serve_speculative_tokens=0", "rollout")
    if (penalties.adjusts(params) or params.min_p > 0) and (params.rollout or self.spec is not None):
      field = "rollout" if params.rollout else "serve_speculative_tokens"
      raise RequestError("presence/frequency/repetition penalties, logit_bias, min_p and min_tokens are not applied "
                         f"with {field} (a rollout's logprobs, a draft's verification would not see them): "
                         "leave them at their defaults", field)
    adapters = len(self.config.serve_lora_adapters)
    if not 0 <= params.lora_adapter <= adapters:
      raise RequestError(f"LoRA adapter {params.lora_adapter} is not served: this engine serves {adapters} "
                         "(serve_lora_adapters)", "model")
    if params.seed is None and params.temperature > 0:
      params = SamplingParams(**{**params.__dict__, "seed": int(self._seeds.integers(2 ** 62))})
    if params.grammar is None:
      r = self.scheduler.add(prompt, params)
      if params.rollout:
        self.rollouts.start(r)
      return r
    if params.rollout:
      raise RequestError("rollout is not recorded under a grammar (structured outputs): its logprobs would not be "
                         "the policy's; drop one of the two", "rollout")
    if self.grammars is None:
      raise RequestError("structured outputs need the server's tokenizer as a Hugging Face tokenizer.json "
                         "(tokenizer_type=hf tokenizer_path=...)", params.grammar.field)
    future = self.grammars.compile(params.grammar)
    if future.done() and future.exception() is not None:
      raise RequestError(str(future.exception()), params.grammar.field)
    r = self.scheduler.add(prompt, params, hold=True)
    self.held.add(r, future)
    if future.done():  # compiled already (the server compiles first): queued now, in its arrival order
      self.held.release(self.scheduler)
    return r

  def abort(self, request: Request) -> None:
    self.scheduler.abort(request)

  @property
  def idle(self) -> bool:
    return self.scheduler.idle and not self.held.requests

  # ---- one step
  def step(self) -> list[tuple[Request, int]]:
    """Runs one engine step -> (request, new token) for each token made (a stop token is not one)."""
    self.held.release(self.scheduler)
    rows = self.scheduler.schedule()
    if not rows:
      self.held.wait(0.01)  # only grammars compiling: wait a little for one, not a busy loop
      return []
    if self.spec is not None:
      return self.spec.step(rows)
    t, pages = self.shape(rows)
    b, where = self.placement(rows)
    feed = step_feed.empty(b, t, pages)
    step_feed.fill(feed, rows, where)
    ro = rollout.wants(rows)
    adjust = penalties.step_arrays(rows, where, b, self.config.vocab_size, self.eos_id)
    sampled, lps, records = self.device_step(t, feed["buf"], logprobs.wants(rows), ro, self.step_mask(rows, where, b),
                                             adjust)
    if records is not None:
      self.rollouts.record(rows, where, sampled, *records)
    if lps is not None:
      logprobs.record(rows, where, *lps)
    made = [len(row.request.output) if row.samples else None for row in rows]  # before update grows them
    self.scheduler.update(rows, sampled[where])
    if ro:
      self.rollouts.publish(rows, self.allocator)
    self.end_complete(rows, made)
    self.steps += 1
    return [(row.request, row.request.output[-1]) for row, n in zip(rows, made)
            if n is not None and len(row.request.output) > n]

  def device_step(self, t: int, buf: np.ndarray, with_logprobs: bool, with_rollout: bool, mask, adjust):
    """A step's device call, every process's (step_channel.CALLS' "step"): the step and write programs on
    the step feed's buf [b, W] -> on the host: (sampled [b], lps or None, records or None) as `run` says.
    mask: the grammar bitmask [b, ceil(V/32)] or None; adjust: penalties.step_arrays' or None."""
    self.channel.send("step", int(t), buf, bool(with_logprobs), bool(with_rollout), mask, adjust)
    mask = None if mask is None else jnp.asarray(mask)
    adjust = None if adjust is None else tuple(jnp.asarray(a) for a in adjust)
    self.pools, sampled, (lps, records) = self.run(t, {"buf": buf}, with_logprobs, with_rollout, mask, adjust)
    sampled = to_host(sampled)  # these reads, in this order, are every process's (collective over processes)
    records = None if records is None else tuple(to_host(a) for a in records)
    return sampled, None if lps is None else tuple(to_host(a) for a in lps), records

  def step_mask(self, rows: list[Scheduled], where: list[int], b: int) -> np.ndarray | None:
    """The step's grammar bitmask [b, ceil(V/32)] int32 on the host, or None (no sampling row has a grammar)."""
    return self.grammars.mask(rows, where, b, self.eos_id) if self.grammars is not None else None

  def end_complete(self, rows: list[Scheduled], made: list[int | None]) -> None:
    """After update: the new tokens advance their rows' grammars; a request whose grammar is complete ends ("stop")."""
    for r in grammar.advance(rows, made):
      self.scheduler.abort(r, "stop")

  def placement(self, rows: list[Scheduled]) -> tuple[int, list[int]]:
    """(B, the batch row of each scheduled row): D page shards of B/D rows each, B/D a power of two;
    a row sits in its home shard's block (the shard of its pages), so its device holds its pages."""
    homes = [self.allocator.shard_of(row.request.pages[0]) for row in rows]
    per = min(self.max_seqs // self.shards, 1 << (max(homes.count(h) for h in homes) - 1).bit_length())
    taken = [0] * self.shards
    where = []
    for h in homes:
      where.append(h * per + taken[h])
      taken[h] += 1
    return self.shards * per, where

  def compile_step(self, b: int, t: int):
    """The step and write programs for b rows of t tokens, compiled from the engine's (abstract or
    real) params and pools -> (step, write, the step's row inputs as ShapeDtypeStructs: they shard
    as a step's rows do). Speculating, the step is the speculative one (with the MTP pool)."""
    buf = step_feed.abstract(b, t, self.pages_per_seq, self._row_sharding(2))
    return (*self.compile_programs(t, buf), buf)

  def compile_programs(self, t: int, buf):
    """The step and write programs for rows of t tokens, compiled for buf (a step's input: an array or a
    ShapeDtypeStruct) from the engine's params and pools -> (step, write). Called as step(params, buffers, pools,
    absorbed, buf) -> (entries, sampled, lps, records) and write(pools, entries, buf) -> pools (the benchmarks
    time and profile them alone)."""
    with self.rules():
      step = self.spec.compile(t, buf) if self.spec is not None else \
          self._step_jit.lower(t, False, False, self.params, self.buffers, self.pools, self.absorbed,
                              buf).compile()
      entries = compiled_outputs(step)[0]  # both steps' first output: the stacks' new entries
      return step, self._write_jit.lower(t, self.pools, entries, buf).compile()

  def rules(self):
    """The mesh's logical rules, active wherever the engine's programs trace (its step reads them)."""
    return sharding.logical_rules(self.config, self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _row_sharding(self, ndim: int):
    """A step input's sharding: its rows (axis 0) over the page shards' axes."""
    if self.mesh is None:
      return None
    axes = paged_pools.page_axes(self.config, self.mesh)
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(axes or None, *[None] * (ndim - 1)))

  def run(self, t: int, feed: dict, with_logprobs: bool = False, with_rollout: bool = False, mask=None,
          adjust=None):
    """The step and write programs on a step_feed (step_feed.fill's, or step_feed.empty's: padding only)
    -> (the pools after the write (also kept as self.pools by the caller), sampled [B], (lps, records)):
    lps with with_logprobs the logprob step's (token logprobs [B,t], ranks [B,t], top values [B,t,N],
    top ids [B,t,N]), else None; records with with_rollout the rollout's (logp [B], kept [B], kept_ids [B,C],
    routed_experts [B,t,L,k]), else None. mask: the grammar bitmask [B, ceil(V/32)] (the masked variant), or None;
    adjust: penalties.step_arrays' (ids [B,S], values [B,S,3]) (the adjusting variant), or None."""
    buf = step_feed.to_device(feed)
    with self.rules():
      entries, sampled, lps, records = self._step_jit(t, with_logprobs, with_rollout, self.params, self.buffers,
                                                      self.pools, self.absorbed, buf, mask, adjust)
      pools = self.write_pools(t, self.pools, entries, buf)
    return pools, sampled, (lps, records)

  def write_pools(self, t: int, pools, entries, buf):
    """The write program: a step's new entries (the stacks' keys and latents of its t tokens a row) into pools
    (donated) at the feed's slots -> the pools after it."""
    return self._write_jit(t, pools, entries, buf)

  def _forward(self, t, params, buffers, pools, absorbed, buf, every_position: bool):
    """The model over the pools for a step_feed's tokens [B,t] -> (the feed's fields, logits [B,1,V] at
    each row's last known token, or [B,t,V] at every position (the model's own: not vocab-masked); aux)."""
    cfg = self.config
    f = step_feed.unpack(buf, t)
    model = nnx.merge(self.graphdef, params, buffers)
    views = stack_views(pools, absorbed, mode=self.mode, index_head_chunk=step_head_chunk(cfg, self.chunk, t),
                        page_table=f["table"], page_size=self.page_size)
    with lora_rows.row_adapters(f["adapter"]):  # served LoRA adapters: row b through its slot (none: no effect)
      logits, aux = model(f["tokens"], f["positions"], cache=views,
                          last_index=None if every_position else f["last"])  # [B,t,V] | [B,1,V]
    return f, logits, aux

  def _sample(self, f: dict, logits: jax.Array, mask=None, adjust=None) -> jax.Array:
    """Each row's token [B] from its logits [B,V] by its request's options and key: ids past sample_vocab
    masked; with adjust (penalties.step_arrays'), the requests' bias and penalties; with a grammar bitmask
    [B, ceil(V/32)], the ids it disallows; then min_p (penalties.min_p_filter) and sample_rows' kept set."""
    logits = self.mask_vocab(logits.astype(jnp.float32))
    logits = logits if adjust is None else penalties.apply(logits, *adjust)
    logits = logits if mask is None else grammar.apply_bitmask(logits, mask)
    logits = penalties.min_p_filter(logits, f["temp"], f["min_p"])
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(f["seeds"], f["draw_at"])  # [B]
    return sample_rows(logits, keys, f["temp"], f["top_p"], f["top_k"])

  def _step(self, t, with_logprobs: bool, with_rollout: bool, params, buffers, pools, absorbed, buf, mask=None,
            adjust=None):
    """The model over the pools for a step_feed's tokens [B,t] -> (the new entries, the sampled token per row
    [B], lps, records). mask: a grammar bitmask [B, ceil(V/32)] (a separately compiled variant), or None; adjust:
    penalties.step_arrays' (ids [B,S], values [B,S,3]) (the adjusting variant), or None.
    with_logprobs (a row asks for logprobs): the model keeps every row position's logits and lps is
    logprobs.step_logprobs there (token logprobs [B,t], ranks [B,t], top values [B,t,N], top ids [B,t,N]),
    N = serve_max_logprobs (the model's own logits: a grammar's mask changes only what is drawn); else None.
    with_rollout (a rollout row): records = (logp [B], kept [B], kept_ids [B,C], routed_experts [B,t,L,k]),
    rollout.sampled_logprobs of the drawn tokens and the step's routing; else None. Each flag is static: its own
    program."""
    f, logits, aux = self._forward(t, params, buffers, pools, absorbed, buf, every_position=with_logprobs)
    if with_logprobs:  # logits [B,t,V]: the row's last known token's
      last = jnp.take_along_axis(logits, f["last"][:, None, None], axis=1)[:, 0]  # [B,V]
    else:  # logits [B,1,V], already at each row's last known token
      last = logits[:, 0]  # [B,V]
    sampled = self._sample(f, last, mask, adjust)  # mask, adjust: other rows' (never a rollout's own)
    lps = logprobs.step_logprobs(logits, logprobs.next_tokens(f, sampled), self.config.serve_max_logprobs) \
        if with_logprobs else None
    records = None
    if with_rollout:
      logp, kept, kept_ids = rollout.sampled_logprobs(self.mask_vocab(last), sampled, f["temp"], f["top_p"],
                                                      f["top_k"])  # [B], [B], [B,C]
      b, cfg = f["tokens"].shape[0], self.config
      routed_experts = aux.get("routed_experts", jnp.zeros((b, t, 0, cfg.num_experts_per_tok), jnp.int32))  # [B,t,L,k]
      records = (logp, kept, kept_ids, routed_experts)
    return aux["cache_entries"], sampled, lps, records

  def mask_vocab(self, logits: jax.Array) -> jax.Array:
    """logits [..., V] with the ids at or past sample_vocab at -inf (unchanged without sample_vocab)."""
    v = self.sample_vocab
    return logits if v is None else jnp.where(jnp.arange(logits.shape[-1]) < v, logits, -jnp.inf)

  def _write(self, t, pools, entries, buf):
    """Writes the step's entries at their slots (padding dropped), every layer of a stack at once."""
    f = step_feed.unpack(buf, t)
    slot_ids = paged_pools.slots(f["table"], f["write_pos"], self.page_size, self.allocator.num_pages * self.page_size)
    return write_stacks(pools, entries, lambda pool, **e: paged_pools.write(pool, slot_ids, **e))

  # ---- convenience
  def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
               on_token=None, max_steps: int = 1_000_000) -> list[Request]:
    """All prompts as concurrent requests, run until each finishes -> the requests, in order.
    on_token(index, token) is called for each token as it is made."""
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    requests = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
    index = {id(r): i for i, r in enumerate(requests)}
    for _ in range(max_steps):
      if self.idle:
        break
      for r, tok in self.step():
        if on_token is not None and id(r) in index:
          on_token(index[id(r)], tok)
    return requests

  def stats(self) -> dict:
    """spec_drafted / spec_accepted: drafts verified / accepted since reset (0 without speculation);
    spec_acceptance their ratio (None before any draft); step_programs: compiled step programs so far."""
    a = self.allocator
    drafted, accepted = (self.spec.drafted, self.spec.accepted) if self.spec else (0, 0)
    return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "pages_used": a.used_pages, "pages_total": a.num_pages, "pages_cached": a.cached_pages,
            "prefix_hit_rate": a.hit_rate(), "steps": self.steps, "spec_drafted": drafted,
            "spec_accepted": accepted, "spec_acceptance": accepted / drafted if drafted else None,
            "step_programs": self.step_programs()}


__all__ = ["ServingEngine", "SamplingParams", "Scheduled"]
