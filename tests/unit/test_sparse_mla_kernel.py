"""The sparse MLA kernels (kernels/sparse_mla_kernel.py) against the gather path's XLA attention
(sparse_attention._attend_block): outputs, the head-summed probabilities and the gradients in the queries and the
latent rows, for both ways of reaching the rows, f32 and bf16, ragged slot blocks, queries near the start with
fewer valid keys than k (-1 in their empty slots), a query with none, and a key selected by many queries; the
Mosaic lowering exported for a TPU at the official shapes; the gather path taking the kernel where backend.py's
gather_attention says. Interpreted off a TPU, compiled by Mosaic on one (`pytest -m device`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.kernels import backend
from MaxText.kernels import sparse_attention as sa
from MaxText.kernels import sparse_mla_kernel as smk
from tests.support.kernels import assert_every_dma_waited, dma_eager_interpreter
from tests.support.precision import f32_rtol

pytestmark = pytest.mark.device

SCALE = 0.3


def _causal_case(seed: int, *, b: int, t: int, s: int, k: int, h: int, c: int, r: int, dtype):
  """q [b,t,h,c+r], kv [b,s,c+r], and a causal selection: query i (at position s - t + i) picks min(k, pos + 1)
  distinct keys at or before its position, the rest of its k slots -1 and invalid; query 0 of sequence 0 is a
  padding query (no valid slot); every query picks key 0 when it can (a key many queries scatter into)."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, h, c + r)), dtype)
  kv = jnp.asarray(rng.standard_normal((b, s, c + r)), dtype)
  idx = np.full((b, t, k), -1, np.int32)
  for bi in range(b):
    for i in range(t):
      pos = s - t + i
      n = min(k, pos + 1)
      chosen = np.concatenate([[0], rng.permutation(np.arange(1, pos + 1))[:n - 1]]) if n else []
      idx[bi, i, :n] = rng.permutation(chosen)  # slots in any order, as an approximate selection may give
  idx[0, 0] = -1
  return q, kv, jnp.asarray(idx), jnp.asarray(idx >= 0)


def _loss_and_grads(fn, q, kv, idx, ok):
  """sum(o_lat * w) and its gradients in q and kv (f32), with the forward's outputs."""
  def loss(q, kv):
    o, ph = fn(q, kv, idx, ok)
    w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
    return jnp.sum(o.astype(jnp.float32) * w), (o, ph)
  (_, (o, ph)), (dq, dkv) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(q, kv)
  return [np.asarray(x, np.float32) for x in (o, ph, dq, dkv)]


def _xla(c: int):
  hi = jax.lax.Precision.HIGHEST
  return lambda q, kv, idx, ok: sa._attend_block(q, kv, idx, ok, SCALE, c, False, hi)


def _kernel(c: int, gather: str, block: int):
  return lambda q, kv, idx, ok: smk.sparse_mla_attend(q, kv, idx, ok, SCALE, c, gather=gather, block=block)


CASES = {  # name: shape, block; c a multiple of 128 (the kernel's lane-aligned value slice)
    "ragged_blocks": dict(b=2, t=5, s=300, k=260, h=4, c=128, r=64, block=128),  # 3 blocks of 128, the last 4 + pad
    "short_rows": dict(b=1, t=6, s=10, k=8, h=8, c=128, r=64, block=8),  # pos 4..9: 5..8 valid of 8; one block
}


@pytest.mark.parametrize("gather", smk.GATHERS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_head_probs_and_gradients_equal_the_xla_gather_path(case, dtype, gather):
  spec = dict(CASES[case])
  block, c = spec.pop("block"), spec["c"]
  q, kv, idx, ok = _causal_case(3, **spec, dtype=jnp.dtype(dtype))
  ref = _loss_and_grads(_xla(c), q, kv, idx, ok)
  got = _loss_and_grads(_kernel(c, gather, block), q, kv, idx, ok)
  rtol = f32_rtol(2e-5) if dtype == "float32" else 1.5e-2  # bf16: 5e-3 - 7e-3 seen (p rounded to bf16 unnormalized)
  for name, g, want in zip(("o_lat", "p_heads", "dq", "dkv"), got, ref):
    assert np.abs(want).max() > 0, name
    err = np.abs(g - want).max() / np.abs(want).max()
    assert err <= rtol, (name, err)
  o, ph, dq, _ = got
  np.testing.assert_array_equal(o[0, 0], 0.0)  # the padding query: no valid slot, output 0 ...
  np.testing.assert_array_equal(ph[0, 0], 0.0)
  np.testing.assert_array_equal(dq[0, 0], 0.0)  # ... and no gradient
  valid_rows = np.asarray(ok).any(-1)
  np.testing.assert_allclose(ph.sum(-1)[valid_rows], q.shape[2], rtol=1e-2)  # each valid query's heads sum to 1


def test_the_dma_way_waits_for_every_row_copy_it_starts(capfd):
  """The DMA way starts block j+1's row copies only while a block follows (j < last) and waits for each block:
  forward, head probabilities and backward under the TPU interpreter with DMAs executed as they start leave no
  semaphore counting at any kernel's exit, and agree with the default interpreter's outputs."""
  spec = dict(CASES["ragged_blocks"], t=2, k=136)  # 2 blocks of 128, the last 8 + pad
  block, c = spec.pop("block"), spec["c"]
  q, kv, idx, ok = _causal_case(3, **spec, dtype=jnp.float32)
  want = _loss_and_grads(_kernel(c, "dma", block), q, kv, idx, ok)
  eager = lambda q, kv, idx, ok: smk.sparse_mla_attend(q, kv, idx, ok, SCALE, c, gather="dma", block=block,
                                                       interpret=dma_eager_interpreter())
  got = _loss_and_grads(eager, q, kv, idx, ok)
  assert_every_dma_waited(capfd)
  for name, g, w in zip(("o_lat", "p_heads", "dq", "dkv"), got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * np.abs(w).max(), err_msg=name)


def test_a_query_with_every_key_selected_equals_dense_attention():
  """k >= the query's keys (DESIGN.md: sparse attention is dense causal attention there), against float64."""
  q, kv, idx, ok = _causal_case(5, b=1, t=4, s=4, k=4, h=2, c=128, r=64, dtype=jnp.float32)
  o, ph = smk.sparse_mla_attend(q, kv, idx, ok, SCALE, 128, block=4)
  q64, kv64 = np.asarray(q, np.float64)[0], np.asarray(kv, np.float64)[0]  # [t,h,e], [s,e]
  logits = np.einsum("the,se->ths", q64, kv64) * SCALE
  logits = np.where(np.arange(4)[None, None, :] <= np.arange(4)[:, None, None], logits, -np.inf)  # causal
  logits[0] = -np.inf  # the padding query
  p = np.exp(logits - np.max(np.where(np.isfinite(logits), logits, -1e30), -1, keepdims=True))
  p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
  want = np.einsum("ths,sc->thc", p, kv64[:, :128])
  np.testing.assert_allclose(np.asarray(o[0]), want, atol=f32_rtol(1e-5) * np.abs(want).max())
  slot_heads = np.take_along_axis(p.sum(1), np.maximum(np.asarray(idx[0]), 0), -1) * np.asarray(ok[0])
  np.testing.assert_allclose(np.asarray(ph[0]), slot_heads, atol=f32_rtol(1e-5))  # probabilities: <= 1


@pytest.mark.parametrize("gather", smk.GATHERS)
def test_the_kernels_lower_to_mosaic_at_the_official_shapes(gather):
  """128 heads, e = 512 + 64, top-k 2048 of 8192 keys, 4 query tokens, bf16: forward, head probabilities and the
  backward pass each lower for a TPU (jax.export on the CPU: Pallas' Mosaic lowering); the head probabilities'
  kernel is dropped where nothing reads them (the gather path without the KL)."""
  from jax import export
  s = jax.ShapeDtypeStruct
  args = (s((1, 4, 128, 576), jnp.bfloat16), s((1, 8192, 576), jnp.bfloat16), s((1, 4, 2048), jnp.int32),
          s((1, 4, 2048), jnp.bool_))

  def calls(with_probs: bool) -> int:
    def loss(q, kv, idx, ok):
      o, ph = smk.sparse_mla_attend(q, kv, idx, ok, 0.1, 512, gather=gather, interpret=False)
      return jnp.sum(o.astype(jnp.float32)) + (jnp.sum(ph) if with_probs else 0.0)
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return export.export(fn, platforms=["tpu"])(*args).mlir_module().count("tpu_custom_call")

  assert calls(True) == 3  # forward, head probabilities, backward
  assert calls(False) == 2


def _driver(pallas: str | None, b=1, t=9, s=9, h=4, nope=4, r=64, v=5, c=128):
  """sparse_mla_attention (the gather path's driver) with top-k 4, blocks of 4 queries and the KL: its output,
  KL and gradients in q_nope, q_pe, c_kv and k_pe, with backend.py's gather_attention forced to `pallas`."""
  rng = np.random.default_rng(11)
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  qn, qp, ckv, kpe = f(b, t, h, nope), f(b, t, h, r), f(b, s, c), f(b, s, r)
  w, iq, iw, ik = f(c, h * (nope + v)), f(b, t, 2, 4), f(b, t, 2), f(b, s, 4)
  spec = sa.SparseSpec(num_heads=h, nope=nope, v=v, scale=SCALE, topk=4, query_block=4, head_chunk=1, with_kl=True,
                       query_loop=False)

  def loss(qn, qp, ckv, kpe):
    out = sa.sparse_mla_attention(sa.SparseQueries(qn, qp, iq, iw, pos, None), sa.SparseKeys(ckv, kpe, ik, pos, None),
                                  w, spec)
    return jnp.sum(out.out * jnp.cos(jnp.arange(out.out.size)).reshape(out.out.shape)) + out.indexer_loss, out

  with backend.forced(**({} if pallas is None else dict(gather_attention=pallas))):
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(qn, qp, ckv, kpe)


@pytest.mark.parametrize("way", ["pallas", "pallas_dma"])
def test_the_gather_path_takes_the_kernel_where_backend_says_and_agrees(way, monkeypatch):
  calls = []
  monkeypatch.setattr(smk, "_forward", lambda *a, _f=smk._forward: calls.append(a[0].gather) or _f(*a))
  (_, want), g_want = _driver(None)
  assert not calls  # the rows' default (cpu here; the tpu row too, until timed): the XLA path
  (_, got), g_got = _driver(way)
  assert calls and set(calls) == {smk.GATHER_OF_WAY[way]}  # traced once or more (the map, the VJP)
  np.testing.assert_array_equal(np.asarray(got.idx), np.asarray(want.idx))
  for name, a, b_ in [("out", got.out, want.out), ("kl", got.indexer_loss, want.indexer_loss),
                      *zip(("q_nope", "q_pe", "c_kv", "k_pe"), g_got, g_want)]:
    a, b_ = np.asarray(a), np.asarray(b_)
    assert np.abs(a - b_).max() <= f32_rtol(1e-4) * np.abs(b_).max() and np.abs(b_).max() > 0, name


def test_gather_attention_defaults_to_xla_on_every_row_and_rejects_unknown_ways():
  for name in ("cpu", "gpu", "tpu", "other"):
    assert backend.row(name).gather_attention == "xla"
  with pytest.raises(ValueError, match="gather_attention"):
    backend.parse_forced(["gather_attention=mosaic"])
  assert backend.parse_forced(["gather_attention=pallas_dma"]) == dict(gather_attention="pallas_dma")


def test_the_benchmark_runs_every_way_at_quick_sizes(capsys):
  """benchmarks/sparse_mla_kernel.py --quick: a row a way with its times, none failed, one JSON line (the DMA way
  left out: interpreted, its 128 DMAs a token take seconds; the tests above hold its values)."""
  import json

  from benchmarks import sparse_mla_kernel as bench
  bench.main(["--quick", "--iters", "1", "--ways", "xla,pallas", "--kl"])
  rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
  assert [r["way"] for r in rows] == ["xla", "pallas"]
  assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows), rows
