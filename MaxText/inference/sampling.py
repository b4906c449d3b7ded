"""Next-token sampling from logits [b,V], each row by its own request's options (temperature, top_p,
top_k; temperature 0 = greedy) and key: sample_rows, and speculative decoding's verify_drafts. Pure,
jit-able. The serving engine folds each request's position into its seed's key, so a request's
tokens do not depend on what shares the batch (decode.py's decode_sampling_* keys become these
per-request options).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy_ids(logits: jax.Array) -> jax.Array:
  """logits [..., V] -> the lowest id of each row's maximum [...] int32: jnp.argmax's ids (ties lowest
  first) as two plain reductions, a max and a min (XLA:CPU runs argmax's paired reduction about 5x
  slower). A row with a NaN gives V - 1 (argmax would give the NaN's id)."""
  v = logits.shape[-1]
  top = jnp.max(logits, axis=-1, keepdims=True)
  ids = jnp.min(jnp.where(logits == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
  return jnp.minimum(ids, v - 1)


def kept_sorted(lg: jax.Array, temp: jax.Array, p: jax.Array, k: jax.Array):
  """THE kept top-k / top-p set (the engine draws from it, rollout.py records it, the trainer's keep
  sampling mask scores over it): logits [..., V], options [...] (temperature, top_p (1 = off), top_k
  (0 = off)) -> (order [..., V] ids most likely first (ties lowest id first: a stable sort), sorted
  logits / temperature [..., V], keep [..., V] bool in that sorted order).

  As vLLM and HF apply them: temperature, then top-k (the k most likely AND every token tied with the
  k-th: logits [2, 2, 1, 0], k = 1 keeps {0, 1}, as vLLM's and HF's `logits < kth value` mask), then
  top-p over the top-k RENORMALIZED (the fewest most likely whose mass reaches p: a token is kept while
  the mass strictly ahead of it is < p). So probs [.5, .3, .2], k = 2, p = .6 keeps {0} (.5 / .8 >= .6),
  not {0, 1}. keep is a prefix of the sorted order (ties are adjacent in it; its size is the set's size)
  and always holds the most likely token."""
  order = jnp.argsort(-lg, axis=-1, stable=True)  # [..., V], most likely first
  sorted_lg = jnp.take_along_axis(lg, order, axis=-1) / jnp.maximum(temp, 1e-6)[..., None]  # [..., V]
  at = jnp.broadcast_to(jnp.clip(k - 1, 0, lg.shape[-1] - 1), sorted_lg.shape[:-1])[..., None]  # [..., 1]
  kth = jnp.take_along_axis(sorted_lg, at, axis=-1)  # [..., 1]: the k-th largest
  in_top_k = (k[..., None] <= 0) | (sorted_lg >= kth)  # [..., V]: the k most likely and their ties
  probs = jax.nn.softmax(jnp.where(in_top_k, sorted_lg, -jnp.inf), axis=-1)  # [..., V]: the top-k renormalized
  before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly ahead of each token
  in_top_p = (before < p[..., None]) | (p[..., None] >= 1)  # p >= 1 is off: a mass rounded to 1 drops nothing
  return order, sorted_lg, in_top_k & in_top_p


def kept_mask(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
  """kept_sorted's set in id order: logits [..., V], options [...] -> keep [..., V] bool."""
  order, _, keep = kept_sorted(logits, jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32),
                               jnp.asarray(top_k, jnp.int32))
  rank = jnp.argsort(order, axis=-1)  # [..., V]: each id's place in the sorted order
  return jnp.take_along_axis(keep, rank, axis=-1)


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array,
                top_k: jax.Array) -> jax.Array:
  """Each row by its own request's options: logits [B,V] fp32, keys [B] (one PRNG key per row),
  temperature [B] (0 = greedy), top_p [B] (1 = off), top_k [B] int (0 = off) -> ids [B] int32.

  A row's draw depends only on its logits, options and key, never on the other rows: greedy is
  the argmax (lowest id on ties); an unfiltered row (top_p 1, top_k 0) draws over every id from
  logits / temperature; a filtered row sorts its logits and draws from its top_p / top_k set. The
  batch only decides what is computed at all (lax.cond): no sort when no row filters, no draw
  when every row is greedy (the common decode step pays for neither)."""
  logits = logits.astype(jnp.float32)
  greedy = greedy_ids(logits)  # [B]
  sampling = temperature > 0  # [B]
  filtered = sampling & ((top_p < 1) | (top_k > 0))  # [B]

  def unfiltered(lg, key, temp):  # [V], key, []
    return jax.random.categorical(key, lg / jnp.maximum(temp, 1e-6))

  def kept(lg, key, temp, p, k):  # [V], key, [], [], []
    order, sorted_lg, keep = kept_sorted(lg, temp, p, k)
    return order[jax.random.categorical(key, jnp.where(keep, sorted_lg, -jnp.inf))]

  def drawn():
    plain = jax.vmap(unfiltered)(logits, keys, temperature)  # [B]
    some = lambda: jnp.where(filtered, jax.vmap(kept)(logits, keys, temperature, top_p, top_k), plain)  # noqa: E731
    ids = jax.lax.cond(jnp.any(filtered), some, lambda: plain)
    return jnp.where(sampling, ids, greedy).astype(jnp.int32)

  return jax.lax.cond(jnp.any(sampling), drawn, lambda: greedy)


def row_probs(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
  """The distribution sample_rows draws from, explicit: logits [B,m,V] fp32, options [B] -> probs
  [B,m,V] fp32 (softmax of logits / temperature over the top_p / top_k set; temperature 0: one-hot
  at the argmax, lowest id on ties, as sample_rows). Sorts only when some sampling row filters."""
  logits = logits.astype(jnp.float32)
  greedy = jax.nn.one_hot(greedy_ids(logits), logits.shape[-1], dtype=jnp.float32)  # [B,m,V]
  sampling = (temperature > 0)[:, None, None]  # [B,1,1]
  filtered = (temperature > 0) & ((top_p < 1) | (top_k > 0))  # [B]

  def one(lg, temp, p, k):  # [V]
    order, sorted_lg, keep = kept_sorted(lg, temp, p, k)
    kept = jax.nn.softmax(jnp.where(keep, sorted_lg, -jnp.inf))  # [V] in sorted order
    return jnp.zeros_like(kept).at[order].set(kept)  # [V] in id order

  plain = jax.nn.softmax(logits / jnp.maximum(temperature, 1e-6)[:, None, None], axis=-1)  # [B,m,V]
  some = lambda: jnp.where(filtered[:, None, None], jax.vmap(jax.vmap(one, in_axes=(0, None, None, None)))(  # noqa: E731
      logits, temperature, top_p, top_k), plain)
  probs = jax.lax.cond(jnp.any(filtered), some, lambda: plain)
  return jnp.where(sampling, probs, greedy)


def draw(probs: jax.Array, keys: jax.Array) -> jax.Array:
  """probs [...,V], keys [...] -> one id [...] int32 from each distribution (a one-hot gives its id)."""
  pick = lambda pr, key: jax.random.categorical(key, jnp.log(pr))  # noqa: E731
  flat = jax.vmap(pick)(probs.reshape(-1, probs.shape[-1]), keys.reshape(-1))
  return flat.reshape(probs.shape[:-1]).astype(jnp.int32)


def verify_drafts(p: jax.Array, q: jax.Array, drafts: jax.Array, num_drafts: jax.Array,
                  keys: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Speculative decoding's rejection sampling (Leviathan et al. / Chen et al.), per row:
  p [B,K+1,V] the target's distributions at the row's verified positions (the last known token,
  then each draft), q [B,K,V] the distributions drafts [B,K] were drawn from, num_drafts [B] (the
  row's real drafts, <= K), keys [B,K+1] (one per verified position) -> (tokens [B,K+1], accepted [B]).

  Draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); the run stops at the first
  rejection, whose token is drawn from normalize(max(0, p_j - q_j)); when every draft is accepted the
  bonus token is drawn from p at the next position. tokens[:accepted] are the accepted drafts and
  tokens[accepted] the drawn one; later entries mean nothing. So each emitted token is distributed
  exactly as p (greedy: p and q one-hot, so a draft is accepted iff it is the target's argmax)."""
  b, k1, v = p.shape
  j = jnp.arange(k1 - 1)  # [K]
  split = jax.vmap(jax.vmap(lambda key: jax.random.split(key)))(keys)  # [B,K+1,2]
  u = jax.vmap(jax.vmap(jax.random.uniform))(split[:, :-1, 0])  # [B,K]
  p_d = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]  # [B,K]
  q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]  # [B,K]
  ok = (u * q_d < p_d) & (j[None] < num_drafts[:, None])  # u < p/q without dividing by q = 0
  accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [B] leading accepts
  real = (jnp.arange(k1)[None] < num_drafts[:, None])[..., None]  # [B,K+1,1]: a draft's position
  q_ext = jnp.where(real, jnp.concatenate([q, jnp.zeros((b, 1, v), q.dtype)], axis=1), 0.0)  # [B,K+1,V]
  residual = jnp.maximum(p - q_ext, 0.0)  # [B,K+1,V]
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  residual = jnp.where(mass > 0, residual / jnp.maximum(mass, 1e-30), p)  # p == q: never rejected, p is safe
  drawn = draw(residual, split[:, :, 1])  # [B,K+1]
  padded = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)  # [B,K+1]
  tokens = jnp.where(jnp.arange(k1)[None] < accepted[:, None], padded, drawn)
  return tokens.astype(jnp.int32), accepted.astype(jnp.int32)
