"""Prefill + autoregressive generate over the latent MLA cache and the indexer key cache.

One function, `forward`, runs t new tokens per row through the model's own call with a cache
(Transformer(cache=...), each layer's MLA.attend_cached): t = prefill_chunk_size (or max_prefill_length) for a prefill chunk, t = 1 for a generate
step. Both are jitted once with fixed shapes: the cache is preallocated (max_target_length,
rounded up to whole prefill chunks), rows carry their own lengths (ragged prompts), and validity
masks (key position <= query position) stand in for every shape that would otherwise grow.

Per layer (MLA.attend_cached, with kernels/cached_attention.py):

    q_nope, q_pe, q_lat = project_q(x)            [b,t,h,nope], [b,t,h,rope], [b,t,q_lora]
    c_kv, k_pe          = project_kv(x)           [b,t,kv_lora], [b,t,rope]   -> cache
    k_I                 = indexer.keys(x)         [b,t,d_I]                   -> cache
    q_abs = absorb_q(q_nope, wkv_b)               [b,t,h,kv_lora]   (q_nope through wkv_b's key part)
  sparse (use_indexer):
    I = index_scores(indexer.queries(x, q_lat), cached k_I)          [b,t,S]   O(S) per token
    idx, idx_valid = topk_indices(I) (exact or approx, per config)   [b,t,k]
    o_lat = gather_attend(q_abs, q_pe, c_kv[idx], k_pe[idx])         [b,t,h,kv_lora]  O(k) per token
  dense (no indexer, indexer_training_stage=dense_warmup, or the benchmark's baseline):
    o_lat = softmax over all valid cached latents                    [b,t,h,kv_lora]  O(S) per token
    out = wo(unabsorb_out(o_lat, wkv_b))          [b,t,D]           (through wkv_b's value part)

The forward only READS the cache: the t new tokens' own entries are spliced into the scores and
the gathered rows, and come back as `entries` that a separate jitted `commit` writes in place.
(XLA:CPU copied the whole cache, several times per step, when one program both updated it in
place and fed it to a matmul.) Prefill chunks see earlier chunks through the cache and their own
tokens through the splice, under the same causal mask.

Selection is topk_indices.topk_indices, the model's own: for exact top-k it is the mask path's
set (topk_threshold + generate_mask: ties at the k-th score lowest position first), so decode
and the teacher-forced forward break ties identically. With indexer_mask_exact_topk=false the
training mask keeps every key tied at the k-th score; decode keeps exactly k (a fixed-size gather).
MTP is not used for decoding.

On a context-parallel mesh (ici_context_parallelism > 1, under sharding.logical_rules as decode.py
runs) a prefill chunk's queries shard over `context` through the model's own activation
constraints: each device scores its C/cp queries against the whole cache ([b,C/cp,S]) and gathers
their k latents; the cache itself is replicated (it is the small latent). Every query costs the
same O(S) scoring + O(k) attention wherever it sits, so no zig-zag reordering is needed. A decode
step (t = 1) runs replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.config.types import Config, ConfigError
from MaxText.inference import kv_cache
from MaxText.inference.cache_view import stack_views, write_stacks
from MaxText.inference.sampling import sample
from MaxText.kernels.cached_attention import absorbed_weights
from MaxText.runtime.distributed import to_host

STACKS = ("dense_layers", "moe_layers")  # the Transformer's layer stacks, in order


class PromptError(ConfigError):
  """A prompt the engine cannot take: the message names the key (prompt, max_prefill_length, ...)."""


class DecodeState(NamedTuple):
  cache: dict          # kv_cache.init_cache layout
  lengths: jax.Array   # [b] int32: tokens stored per row; the next token goes to this position


@dataclasses.dataclass
class Generation:
  prompt: list[int]
  tokens: list[int]    # generated ids, EOS excluded
  stop: str            # "eos" | "max_target_length" | "max_new_tokens"


def default_attention(config: Config) -> str:
  """"sparse" when the model attends over the indexer's selection, else "dense"."""
  if config.use_indexer and config.indexer_training_stage != "dense_warmup":
    return "sparse"
  return "dense"


def step_head_chunk(config: Config, prefill_chunk: int, t: int) -> int:
  """Indexer heads scored at once for t new tokens per row. The indexer scores [b,t,S,chunk] per head
  chunk; a prefill chunk uses indexer_head_chunk, and fewer queries may use proportionally more heads
  at once (the same peak memory): a decode step (t=1) scores all heads in one matmul, far faster on CPU."""
  return min(config.indexer_n_heads,
             max(config.indexer_head_chunk, config.indexer_head_chunk * prefill_chunk // t))


class StepOptions(NamedTuple):
  """Static choices of a compiled forward over the cache."""
  mode: str = "sparse"            # "sparse" | "dense"
  index_head_chunk: int = 16      # indexer heads scored per chunk (see Engine.step_options)


# ---------------------------------------------------------------- the model over the cache


def model_absorbed_weights(model) -> dict:
  """{stack name: Absorbed [L,...] (scanned) or [Absorbed per layer]} for the model's stacks; None for a
  stack whose wkv_b is fp8 (weight_quantization=fp8_block)."""
  out = {}
  for name in STACKS:
    stack = getattr(model, name)
    if stack is None:
      continue
    layers = [stack.layers] if stack.scan else list(stack.layers)
    if layers[0].attention.wkv_b.kernel_scale is not None:  # fp8: no resident float copy; attend_cached
      out[name] = None  # dequantizes wkv_b inside the step, layer by layer
      continue
    split = [absorbed_weights(l.attention.wkv_b.kernel_value(), l.attention.num_heads, l.attention.nope,
                              l.attention.v_dim) for l in layers]
    out[name] = split[0] if stack.scan else split
  return out


def forward(model, cache: dict, tokens: jax.Array, positions: jax.Array, opts: StepOptions,
            absorbed: dict | None = None, last_index: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """tokens [b,t] at positions [b,t] -> (logits [b,t,V] fp32, or [b,1,V] at last_index [b]; the new
  tokens' cache entries per stack, for `commit`). The model's own call with a cache
  (Transformer(cache=...): every layer's MLA.attend_cached). absorbed: model_absorbed_weights(model)."""
  views = stack_views(cache, absorbed, mode=opts.mode, index_head_chunk=opts.index_head_chunk)
  logits, aux = model(tokens, positions, cache=views, last_index=last_index)
  return logits, aux["cache_entries"]


def commit(cache: dict, entries: dict, start: jax.Array) -> dict:
  """Writes forward's entries into the cache at slots start[b].. (in place when the cache is donated)."""
  return write_stacks(cache, entries, lambda c, **e: kv_cache.write(c, start, **e))


def check_prompts(config: Config, prompts: Sequence[Sequence[int]]) -> None:
  """Raises PromptError for a prompt the engine cannot take (empty, too long, ids out of range)."""
  cfg = config
  if not prompts:
    raise PromptError("prompt is empty: give at least one prompt")
  for i, p in enumerate(prompts):
    where = f"prompt row {i}" if len(prompts) > 1 else "prompt"
    if len(p) == 0:
      raise PromptError(f"{where} has no tokens (prompt={cfg.prompt!r})")
    if len(p) > cfg.max_prefill_length:
      raise PromptError(f"{where} has {len(p)} tokens, more than max_prefill_length={cfg.max_prefill_length}; "
                        f"raise max_prefill_length (<= max_target_length={cfg.max_target_length}) or shorten it")
    if len(p) >= cfg.max_target_length:
      raise PromptError(f"{where} has {len(p)} tokens, which fills max_target_length={cfg.max_target_length} "
                        f"(prompt + generated tokens must fit in it): raise max_target_length")
    bad = [int(x) for x in p if not 0 <= int(x) < cfg.vocab_size]
    if bad:
      raise PromptError(f"{where} has token ids {bad[:5]} outside [0, vocab_size={cfg.vocab_size})")


# ---------------------------------------------------------------- the engine


class Engine:
  """Jitted prefill chunk, generate step and commit for one model; the host loop in `generate`.

      engine = Engine(config, graphdef, params, buffers)
      results = engine.generate([[1, 5, 7], [1, 9]], eos_id=2, on_token=print_piece)
  """

  def __init__(self, config: Config, graphdef, params, buffers, *, attention: str | None = None,
               sample_vocab: int | None = None):
    """attention: "sparse" | "dense" (default: default_attention(config)). sample_vocab: sample only
    ids below it (a tokenizer smaller than vocab_size); the returned logits are not masked."""
    self.config = config
    self.sample_vocab = sample_vocab
    self.graphdef, self.params, self.buffers = graphdef, params, buffers
    self.mode = attention or default_attention(config)
    if self.mode == "sparse" and not config.use_indexer:
      raise ConfigError("sparse decode attention needs use_indexer=true")
    self.chunk = min(config.prefill_chunk_size or config.max_prefill_length, config.max_prefill_length)
    # whole chunks: a prefill window never runs past the cache (kv_cache.write)
    self.cache_length = -(-config.max_target_length // self.chunk) * self.chunk
    # wkv_b split head-major once (see Absorbed); stacked like the parameters
    self.absorbed = jax.jit(lambda p, b: model_absorbed_weights(self._model(p, b)))(params, buffers)
    self._prefill_jit = jax.jit(self._prefill_chunk)
    self._step_jit = jax.jit(self._step)
    self._forward_jit = jax.jit(self._forward_all, static_argnums=(6,))
    self._commit_jit = jax.jit(commit, donate_argnums=(0,))
    self._sample_jit = jax.jit(self._sample)

  def step_options(self, t: int) -> StepOptions:
    """Options for t new tokens per row (index_head_chunk: see step_head_chunk)."""
    return StepOptions(mode=self.mode, index_head_chunk=step_head_chunk(self.config, self.chunk, t))

  # ---- jitted bodies (params/buffers are arguments, not constants)
  def _model(self, params, buffers):
    return nnx.merge(self.graphdef, params, buffers)

  def _prefill_chunk(self, params, buffers, cache, absorbed, tokens, offset, lengths, logits):
    """tokens [b,C] at positions offset.. -> (entries, logits [b,V] updated where a row's last prompt
    token is in this chunk)."""
    b, c = tokens.shape
    positions = jnp.broadcast_to(offset + jnp.arange(c, dtype=jnp.int32)[None], (b, c))
    last = lengths - 1 - offset  # [b]: index of the row's last prompt token in this chunk
    here = (last >= 0) & (last < c)
    out, entries = forward(self._model(params, buffers), cache, tokens, positions, self.step_options(c), absorbed,
                           last_index=jnp.clip(last, 0, c - 1))
    return entries, jnp.where(here[:, None], out[:, 0], logits)

  def _step(self, params, buffers, cache, absorbed, lengths, tokens, key):
    """tokens [b] at positions lengths [b] -> (entries, next tokens [b], logits [b,V])."""
    out, entries = forward(self._model(params, buffers), cache, tokens[:, None], lengths[:, None],
                           self.step_options(1), absorbed)
    return entries, self._sample(out[:, 0], key), out[:, 0]

  def _forward_all(self, params, buffers, cache, absorbed, tokens, positions, opts):
    return forward(self._model(params, buffers), cache, tokens, positions, opts, absorbed)

  def _sample(self, logits, key):
    cfg = self.config
    if self.sample_vocab is not None:
      logits = jnp.where(jnp.arange(logits.shape[-1]) < self.sample_vocab, logits, -jnp.inf)
    return sample(logits, key, strategy=cfg.decode_sampling_strategy, temperature=cfg.decode_sampling_temperature,
                  nucleus_p=cfg.decode_sampling_nucleus_p)

  # ---- host API
  def init_state(self, batch: int) -> DecodeState:
    return DecodeState(kv_cache.init_cache(self.config, batch, self.cache_length), jnp.zeros((batch,), jnp.int32))

  def prefill(self, state: DecodeState, prompts: Sequence[Sequence[int]], pad_id: int = 0
              ) -> tuple[DecodeState, jax.Array]:
    """Writes each row's prompt into the cache, chunk by chunk -> (state, logits [b,V] at each row's
    last prompt token). Rows are padded to whole chunks; padding is never attended to."""
    check_prompts(self.config, prompts)
    b, c = len(prompts), self.chunk
    lengths = np.array([len(p) for p in prompts], np.int32)
    n_chunks = -(-int(lengths.max()) // c)
    tokens = np.full((b, n_chunks * c), pad_id, np.int32)
    for i, p in enumerate(prompts):
      tokens[i, :len(p)] = p
    lengths_dev = jnp.asarray(lengths)
    logits = jnp.zeros((b, self.config.vocab_size), jnp.float32)
    cache = state.cache
    for j in range(n_chunks):
      offset = jnp.full((b,), j * c, jnp.int32)
      entries, logits = self._prefill_jit(self.params, self.buffers, cache, self.absorbed,
                                          jnp.asarray(tokens[:, j * c:(j + 1) * c]), offset[0], lengths_dev, logits)
      cache = self._commit_jit(cache, entries, offset)
    return DecodeState(cache, lengths_dev), logits

  def step(self, state: DecodeState, tokens, active, key: jax.Array):
    """One generate step: tokens [b] written at state.lengths (rows with active[b] advance) ->
    (state, next tokens [b], logits [b,V])."""
    entries, nxt, logits = self._step_jit(self.params, self.buffers, state.cache, self.absorbed, state.lengths,
                                          jnp.asarray(tokens, jnp.int32), key)
    cache = self._commit_jit(state.cache, entries, state.lengths)
    return DecodeState(cache, state.lengths + jnp.asarray(active, jnp.int32)), nxt, logits

  def forward_tokens(self, state: DecodeState, tokens, positions) -> tuple[DecodeState, jax.Array]:
    """All logits [b,t,V] of tokens [b,t] at positions [b,t] (consecutive per row, in the cache),
    then written to the cache; for tests and scoring. lengths become positions[:, -1] + 1."""
    tokens, positions = jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32)
    logits, entries = self._forward_jit(self.params, self.buffers, state.cache, self.absorbed, tokens, positions,
                                        self.step_options(tokens.shape[1]))
    cache = self._commit_jit(state.cache, entries, positions[:, 0])
    return DecodeState(cache, positions[:, -1] + 1), logits

  def generate(self, prompts: Sequence[Sequence[int]], *, eos_id: int | None, pad_id: int = 0,
               max_new_tokens: int | None = None, on_token: Callable[[int, int], None] | None = None,
               seed: int | None = None) -> list[Generation]:
    """Prefill, then generate until each row emits EOS, fills max_target_length (prompt + generated
    tokens), or has max_new_tokens. on_token(row, id) is called for each generated id as it comes."""
    cfg = self.config
    b = len(prompts)
    key = jax.random.key(cfg.seed if seed is None else seed)
    state, logits = self.prefill(self.init_state(b), prompts, pad_id)
    nxt = to_host(self._sample_jit(logits, jax.random.fold_in(key, 0)))
    results = [Generation(list(map(int, p)), [], "") for p in prompts]
    limit = [cfg.max_target_length - len(p) for p in prompts]  # room left for generated tokens
    if max_new_tokens is not None:
      limit = [min(n, max_new_tokens) for n in limit]
    active = np.ones((b,), bool)
    step = 0
    while True:
      for i in np.flatnonzero(active):
        tok = int(nxt[i])
        if eos_id is not None and tok == eos_id:
          results[i].stop, active[i] = "eos", False
          continue
        results[i].tokens.append(tok)
        if on_token is not None:
          on_token(int(i), tok)
        if len(results[i].tokens) >= limit[i]:
          full = max_new_tokens is None or limit[i] < max_new_tokens
          results[i].stop, active[i] = ("max_target_length" if full else "max_new_tokens"), False
      if not active.any():
        return results
      step += 1
      state, nxt_dev, _ = self.step(state, nxt, active, jax.random.fold_in(key, step))
      nxt = to_host(nxt_dev)




__all__ = ["Engine", "DecodeState", "Generation", "PromptError", "StepOptions", "forward", "commit",
           "model_absorbed_weights", "check_prompts", "default_attention"]
