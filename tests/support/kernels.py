"""What the kernels' tests share (test_paged_decode.py, test_paged_decode_gpu.py, test_sparse_mla_kernel.py): pool
bits of values, closeness relative to the largest finite value with -inf where the reference has it, a jaxpr's every
equation, and Pallas' TPU interpreter run so that a DMA started and never waited for shows."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from tests.support.precision import f32_rtol


def bits(x, dtype):
  """Values -> the bits a pool holds: fp8 (e4m3) as uint8, bf16 as uint16."""
  return jax.lax.bitcast_convert_type(x.astype(dtype), {jnp.float8_e4m3fn: jnp.uint8, jnp.bfloat16: jnp.uint16}[dtype])


def jaxpr_eqns(jaxpr, inside_shard_map: bool = False):
  """(equation, whether inside a shard_map) of every equation in `jaxpr` and its sub-jaxprs (what a test of what
  a compiler will be handed walks)."""
  for eqn in jaxpr.eqns:
    yield eqn, inside_shard_map
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        sub = getattr(sub, "jaxpr", sub)
        if isinstance(sub, jcore.Jaxpr):
          yield from jaxpr_eqns(sub, inside_shard_map or eqn.primitive.name == "shard_map")


def dma_eager_interpreter():
  """An `interpret=` for a Mosaic kernel: Pallas' TPU interpreter executing each DMA when it starts, so a DMA the
  kernel starts and never waits for leaves its semaphore non-zero at the kernel's exit, which the interpreter prints
  ("Semaphore N has non-zero count ... at kernel exit"; the default "on_wait" mode runs a DMA only at its wait, so
  one never waited for leaves no trace). On a TPU such a DMA reads past what the kernel needs or faults."""
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.InterpretParams(dma_execution_mode="eager")


def assert_every_dma_waited(capfd) -> None:
  """After kernels ran under dma_eager_interpreter(): none exited with a DMA semaphore still counting."""
  out = capfd.readouterr()
  assert "non-zero count" not in out.out + out.err, (out.out + out.err)[-500:]


def close(got, ref, rtol):
  """got finite exactly where ref is, and within rtol of ref's largest |value| there (rtol as the backend's
  matmul precision keeps it: precision.f32_rtol)."""
  got, ref, rtol = np.asarray(got), np.asarray(ref), f32_rtol(rtol)
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
  fin = np.isfinite(ref)
  assert np.max(np.abs(got[fin] - ref[fin])) <= rtol * np.max(np.abs(ref[fin])), np.max(np.abs(got[fin] - ref[fin]))


def mla_case(fp8: bool, *, rows: int, slots: int, heads: int, selected: int, c: int = 256, r: int = 64):
  """sparse_mla_decode's arguments (before its softmax scale): queries, `selected` slot ids of `slots` a row with
  about 60% valid, row 1 with none (its output must be 0), and the pools (fp8: codes uint8 with a scale per 128,
  k_pe as bf16 bits; else f32)."""
  from MaxText.inference import kv_cache
  k = jax.random.split(jax.random.key(2), 6)
  q_abs, q_pe = jax.random.normal(k[0], (rows, heads, c)), jax.random.normal(k[1], (rows, heads, r))
  c_kv, k_pe = jax.random.normal(k[2], (slots, c)), jax.random.normal(k[3], (slots, r))
  ids = jax.random.randint(k[4], (rows, selected), 0, slots)
  valid = (jax.random.uniform(k[5], (rows, selected)) < 0.6).at[1].set(False)  # row 1: nothing selected -> 0
  scale = None
  if fp8:
    cq, scale = kv_cache.quantize_fp8(c_kv)
    c_kv, k_pe = bits(cq, jnp.float8_e4m3fn), bits(k_pe, jnp.bfloat16)
  return q_abs, q_pe, ids, valid, c_kv, k_pe, scale
