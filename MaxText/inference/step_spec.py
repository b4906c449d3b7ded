"""MTP speculative decoding for the serving engine (serving.py, serve_speculative_tokens = k > 0).

The drafter is the model's MTP module 0 run through its own code with a cache
(Transformer.mtp_cached: its DecoderLayer's MLA.attend_cached) over its own paged pool, one more
PagedLayerCache under the engine's page table (so prefix pages share it as they share the
stacks' pools). One jitted program per (rows, tokens) bucket does, for tokens [B,t] whose row i
holds `known` tokens of its sequence then its drafts d_1..d_m (m <= k):

  1. the target over the pools (Transformer(cache=...)) -> logits at the row's last known token and
     at each draft [B,k+1,V], and the last layer's output h [B,t,D];
  2. verification (sampling.verify_drafts): p = the request's distribution of those logits, q =
     the distribution each draft was drawn from (kept on the device from the step that drew it,
     `draft_q` [max_seqs,k,V], row `q_row`; greedy: one-hot) -> the accepted run and the drawn token
     (when every row is greedy a lax.cond takes the same rule as argmax comparisons: no sorting, no draws);
  3. the MTP layer over every row position i with (h_i, token i+1): token i+1 is the row's next
     token, from the accepted run and the drawn token at and after the last known token, so the
     MTP pool holds a valid entry for every position the step computes (a rejected position's
     entry is rewritten when that position is computed);
  4. drafts for the next step from the last accepted position a: MTP logits at a predict the token
     after the drawn one; for k > 1 the module runs again at positions a + 1 .. a + k - 1 on its own
     h and its previous draft (t = 1 a pass; their pool entries lie past what is computed and are
     rewritten later). A draft position on a page the row has not got is not written: the next
     chained pass reads a stale slot there, a weaker draft, never a wrong output.

Structured outputs (grammar.py): a row with a grammar drafts nothing (its drafts are dropped after each
step), so its step verifies no draft and draws one token from the target's logits under the grammar's
bitmask (the masked variant of this program, given a mask [B, ceil(V/32)]): no token is taken unchecked.

Keys: position P's draws use fold_in(key(seed), P): split for the accept test and the residual
draw; fold_in(., 1) for the draft of P. So a request's tokens depend on its seed and its drafts,
whatever else shares the batch (a preempted sampling request redraws from where it resumes).
The MTP pool is updated inside the program (donated); the stacks' entries go through the
engine's write program as without speculation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.inference import paged_pools, step_feed
from MaxText.inference.cache_view import CacheView, stack_views
from MaxText.inference.grammar import apply_bitmask
from MaxText.inference.model_step import mtp_absorbed_weights, run_or_shape, step_head_chunk
from MaxText.inference.sampling import draw, greedy_ids, row_probs, verify_drafts
from MaxText.inference.scheduler import Scheduled
from MaxText.runtime.distributed import to_host


class SpecStep:
  """The engine's step when speculating; holds the MTP pool, the drafts' distributions and the counts."""

  def __init__(self, engine):
    self.engine, self.k = engine, engine.config.serve_speculative_tokens
    self._jit = jax.jit(self._step, static_argnums=(0,), donate_argnums=(4,))
    self._absorb = jax.jit(lambda p, b: mtp_absorbed_weights(nnx.merge(engine.graphdef, p, b)))
    self.load_weights()

  def load_weights(self) -> None:
    """The MTP layer's absorbed weights from the engine's params (once per set of weights; an abstract
    engine's: their shapes and shardings)."""
    e = self.engine
    self.absorbed = run_or_shape(self._absorb, e.abstract, e.params, e.buffers)

  def reset(self) -> None:
    e = self.engine
    # [N, n] per field; its slots shard over pages as the stacks' pools do (each device its rows' pages)
    self.mtp_pool = paged_pools.placed(e.config, lambda: paged_pools.init_layer_pools(
        e.config, e.num_pages * e.page_size), e.mesh, abstract=e.abstract)
    q_shape = (e.max_seqs, self.k, e.config.vocab_size)  # draft_q [S,k,V]
    self.draft_q = jax.ShapeDtypeStruct(q_shape, jnp.float32) if e.abstract else jnp.zeros(q_shape, jnp.float32)
    self.slots: dict[int, int] = {}  # id(running request) -> its row of draft_q, kept while it runs
    self.drafted = self.accepted = 0

  def _assign_slots(self, rows: list[Scheduled]) -> None:
    """Each row's request keeps one row of draft_q (Request.draft_row) while it runs, so its drafts and
    their distributions wait through steps that do not run it (a prefill step between two decode steps)."""
    live = {id(r) for r in self.engine.scheduler.running}
    self.slots = {key: slot for key, slot in self.slots.items() if key in live}
    free = sorted(set(range(self.engine.max_seqs)) - set(self.slots.values()))
    for row in rows:
      r = row.request
      if id(r) not in self.slots:
        self.slots[id(r)] = free.pop(0)
      r.draft_row = self.slots[id(r)]

  def step(self, rows: list[Scheduled]) -> list:
    e = self.engine
    t, pages = e.shape(rows)
    b, where = e.placement(rows)
    feed = step_feed.empty(b, t, pages)
    self._assign_slots(rows)
    step_feed.fill(feed, rows, where)
    got = self.device_step(t, feed["buf"], e.step_mask(rows, where, b))[where]  # [rows, 2k+2]
    out, accepted, drafts = got[:, :self.k + 1], got[:, self.k + 1], got[:, self.k + 2:]
    made = [len(row.request.output) if row.samples else None for row in rows]  # before update grows them
    samples = [row.samples for row in rows]  # (update changes what `samples` reads)
    e.scheduler.update(rows, [out[i, :accepted[i] + 1].tolist() for i in range(len(rows))])
    e.end_complete(rows, made)
    for i, row in enumerate(rows):
      r = row.request
      if samples[i]:
        self.drafted += len(row.drafts)
        self.accepted += int(accepted[i])
        if r.finish_reason is None and r.constraint is None:  # its next step verifies these (q: draft_q[r.draft_row])
          r.drafts = drafts[i].tolist()
    e.steps += 1
    return [(row.request, tok) for row, n in zip(rows, made) if n is not None for tok in row.request.output[n:]]

  def compile(self, t: int, buf):
    """The speculative step for rows of t tokens, compiled for buf (the step's input as a ShapeDtypeStruct)
    from the engine's (abstract or real) params and pools (ServingEngine.compile_step)."""
    e = self.engine
    return self._jit.lower(t, e.params, e.buffers, e.pools, self.mtp_pool, (e.absorbed, self.absorbed),
                           self.draft_q, buf).compile()

  def device_step(self, t: int, buf, mask) -> np.ndarray:
    """The speculative step's device call, every process's (step_channel "spec_step"): run on the step feed's
    buf [b, W] and a grammar bitmask (numpy, or None) -> [b, 2k+2] on the host."""
    self.engine.channel.send("spec_step", int(t), buf, mask)
    return to_host(self.run(t, {"buf": buf}, None if mask is None else jnp.asarray(mask)))

  def run(self, t: int, feed: dict, mask=None) -> jax.Array:
    e = self.engine
    buf = step_feed.to_device(feed)
    with e.rules():
      entries, self.mtp_pool, self.draft_q, out = self._jit(t, e.params, e.buffers, e.pools, self.mtp_pool,
                                                            (e.absorbed, self.absorbed), self.draft_q, buf, mask)
      e.pools = e.write_pools(t, e.pools, entries, buf)
    return out

  def _step(self, t, params, buffers, pools, mtp_pool, absorbed, draft_q, buf, mask=None):
    """-> (the stacks' new entries, the MTP pool, draft_q [S,k,V], [B, 2k+2]: the run's tokens [k+1],
    accepted, the next drafts [k]). mask: a grammar bitmask [B, ceil(V/32)] or None. See the module docstring."""
    e, k = self.engine, self.k
    f = step_feed.unpack(buf, t)
    absorbed, mtp_absorbed = absorbed
    model = nnx.merge(e.graphdef, params, buffers)
    chunk = step_head_chunk(e.config, e.chunk, t)
    views = stack_views(pools, absorbed, mode=e.mode, index_head_chunk=chunk, page_table=f["table"],
                        page_size=e.page_size)
    verify_at = jnp.clip(f["last"][:, None] + jnp.arange(k + 1), 0, t - 1)  # [B,k+1]
    logits, aux = model(f["tokens"], f["positions"], cache=views, last_index=verify_at)  # [B,k+1,V]
    if mask is not None:  # a constrained row has no drafts: its position 0 is the one drawn from
      logits = apply_bitmask(logits, mask)  # [B,k+1,V]
    opts = (f["temp"], f["top_p"], f["top_k"])
    all_greedy = jnp.all(f["temp"] <= 0)  # then verification and drafting need no distributions (lax.cond)
    drafts = jnp.take_along_axis(f["tokens"], verify_at[:, 1:], axis=1)  # [B,k]
    fold = jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)))  # keys [B], positions [B,m] -> [B,m]
    key_at = lambda pos: fold(jax.vmap(jax.random.key)(f["seeds"]), pos)  # noqa: E731  (inside the sampled branches)

    def sampled():
      p = row_probs(self.engine.mask_vocab(logits), *opts)  # [B,k+1,V]
      greedy = jax.nn.one_hot(drafts, p.shape[-1], dtype=p.dtype)  # [B,k,V]
      q = jnp.where((f["temp"] > 0)[:, None, None], draft_q[f["q_row"]], greedy)  # [B,k,V]
      pos = f["draw_at"][:, None] + jnp.arange(k + 1)  # [B,k+1] the drawn tokens' positions
      return verify_drafts(p, q, drafts, f["num_drafts"], key_at(pos))  # [B,k+1], [B]

    def argmax():  # verify_drafts with one-hot p and q, without drawing: the longest prefix equal to the argmax
      top = greedy_ids(self.engine.mask_vocab(logits))  # [B,k+1]
      ok = (drafts == top[:, :k]) & (jnp.arange(k)[None] < f["num_drafts"][:, None])  # [B,k]
      accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [B]
      padded = jnp.concatenate([drafts, top[:, k:]], axis=1)  # [B,k+1]
      return jnp.where(jnp.arange(k + 1)[None] < accepted[:, None], padded, top), accepted.astype(jnp.int32)

    out, accepted = jax.lax.cond(all_greedy, argmax, sampled)  # [B,k+1], [B]

    # The MTP layer over the row: token i+1 from the run at and after the last known token.
    j = jnp.arange(t)[None]  # [1,t]
    from_run = (j >= f["last"][:, None]) & f["samples"][:, None]  # [B,t]
    run_tok = jnp.take_along_axis(out, jnp.clip(j - f["last"][:, None], 0, k), axis=1)  # [B,t]
    nxt = jnp.where(from_run, run_tok, f["next"])  # [B,t]
    at = f["last"] + accepted  # [B] the last accepted position's row index
    mview = CacheView(mtp_pool, mtp_absorbed, f["table"], e.page_size, e.mode, chunk)
    m_logits, h, m_entries = model.mtp_cached(aux["hidden"], nxt, f["positions"], mview,
                                              last_index=at)  # [B,1,V], [B,t,D]
    num_slots = e.num_pages * e.page_size
    write = lambda pool, wpos, ent: paged_pools.write(pool, paged_pools.slots(  # noqa: E731
        f["table"], wpos, e.page_size, num_slots), **ent)
    mtp_pool = write(mtp_pool, f["write_pos"], m_entries)

    # Drafts: position a's MTP logits give the token at a + 2; k > 1 chains the module on its own h.
    at_pos = jnp.take_along_axis(f["positions"], at[:, None], axis=1)[:, 0]  # [B]
    real = f["write_pos"][:, 0] >= 0  # [B] rows that are not padding
    h = jnp.take_along_axis(h, at[:, None, None], axis=1)  # [B,1,D]
    qs, ds = [], []
    for c in range(k):
      if c:
        cpos = (at_pos + c)[:, None]  # [B,1]: this pass's position, token = the previous draft
        mview = CacheView(mtp_pool, mtp_absorbed, f["table"], e.page_size, e.mode,
                          step_head_chunk(e.config, e.chunk, 1))
        m_logits, h, m_entries = model.mtp_cached(h, ds[-1][:, None], cpos, mview)  # [B,1,V], [B,1,D]
        mtp_pool = write(mtp_pool, jnp.where(real[:, None], cpos, -1), m_entries)
      lg = self.engine.mask_vocab(m_logits)  # [B,1,V]

      def draft_sampled(lg=lg, c=c):
        keys = jax.vmap(lambda key: jax.random.fold_in(key, 1))(key_at((at_pos + c + 2)[:, None])[:, 0])  # [B]
        qc = row_probs(lg, *opts)[:, 0]  # [B,V]
        return qc, draw(qc, keys)

      def draft_argmax(lg=lg):  # greedy rows verify against one-hot drafts: no q needed
        return jnp.zeros(lg[:, 0].shape, jnp.float32), greedy_ids(lg[:, 0])

      qc, d = jax.lax.cond(all_greedy, draft_argmax, draft_sampled)  # [B,V], [B]
      qs.append(qc)
      ds.append(d)
    slot = jnp.where(real, f["q_row"], draft_q.shape[0])  # [B] each row's request's row; padding: dropped
    new_q = draft_q.at[slot].set(jnp.stack(qs, axis=1), mode="drop")  # [S,k,V]
    result = jnp.concatenate([out, accepted[:, None], jnp.stack(ds, axis=1)], axis=1)  # [B,2k+2]
    return aux["cache_entries"], mtp_pool, new_q, result


__all__ = ["SpecStep"]
