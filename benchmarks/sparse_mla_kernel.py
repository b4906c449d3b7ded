"""The gather path's attention alone: XLA (sparse_attention._attend_block) vs the Mosaic kernels, on one device.

    python benchmarks/sparse_mla_kernel.py                      # a TPU: official shapes, forward and backward
    python benchmarks/sparse_mla_kernel.py --tokens 64 --keys 131072 --block 1024
    python benchmarks/sparse_mla_kernel.py --quick              # a CPU smoke run (tiny shapes, interpreted kernels)
    PYTHONPATH=/tmp/libtpu:. python benchmarks/sparse_mla_kernel.py --compile-for v5e:1x1   # no TPU: Mosaic's compile

One query block of --tokens at the end of --keys, each over --topk selected keys, 128 heads, bf16. Prints per way
of backend.py's gather_attention (--ways) the forward and forward + backward median ms against the MXU bound at
the device's bf16 peak, then one JSON line; --compile-for: each way's compile and temp memory. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import profile_ops, timing
from MaxText.kernels import backend
from MaxText.kernels import sparse_attention as sa
from MaxText.runtime.metrics import peak_flops_per_device

QUICK = dict(tokens=4, keys=512, topk=128, heads=8, kv_lora=128, iters=2)


def inputs(a) -> tuple[jax.Array, ...]:
  """q [1,T,h,e], kv [1,S,e] bf16; idx [1,T,k] distinct causal keys ascending; ok all True."""
  rng = np.random.default_rng(0)
  e = a.kv_lora + a.rope
  q = jnp.asarray(rng.standard_normal((1, a.tokens, a.heads, e)), jnp.bfloat16)
  kv = jnp.asarray(rng.standard_normal((1, a.keys, e)), jnp.bfloat16)
  first = a.keys - a.tokens  # the first query's position
  idx = np.stack([np.sort(rng.choice(first + i + 1, a.topk, replace=False)) for i in range(a.tokens)])
  return q, kv, jnp.asarray(idx[None], jnp.int32), jnp.ones((1, a.tokens, a.topk), bool)


def attend(a, q, kv, idx, ok):
  """The gather path's attention of one block: [1,T,h,c] outputs, [1,T,k] p_heads."""
  return sa.attend_block(q, kv, idx, ok, (a.kv_lora + a.rope) ** -0.5, a.kv_lora, block=a.block)


def measure(a, way: str, args) -> dict:
  r = jnp.asarray(np.random.default_rng(1).standard_normal((1, a.tokens, a.heads, a.kv_lora)), jnp.bfloat16)
  forward = lambda *x: attend(a, *x) if a.kl else attend(a, *x)[0]  # noqa: E731
  loss = lambda *x: jnp.sum(attend(a, *x)[0].astype(jnp.float32) * r)  # noqa: E731

  with backend.forced(gather_attention=way):  # traced (so chosen) inside the block
    fwd = jax.jit(forward)
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    row = dict(way=way, fwd_ms=timing.median_ms(lambda: fwd(*args), a.iters, warmup=0))
    row["fwd_bwd_ms"] = timing.median_ms(lambda: grad(*args), a.iters, warmup=0)
  return row


def compile_for(a, topology: str) -> list[dict]:
  """Each way's forward + backward (with p_heads) compiled for a TPU topology from abstract inputs: rows of
  (way, compile seconds, XLA's temp GiB) or the error's first line."""
  devices = profile_ops.topology_devices(topology)
  if devices is None:
    return []
  sh = jax.sharding.SingleDeviceSharding(devices[0])
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh) for x in inputs(a)]
  rows = []

  def loss(*x):
    o, ph = attend(a, *x)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ph)

  for way in a.ways.split(","):
    t0 = time.perf_counter()
    try:
      with backend.forced("tpu", gather_attention=way):  # the tpu row: Mosaic's lowering, not the interpreter
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*shapes).compile()
      row = dict(way=way, compile_s=round(time.perf_counter() - t0, 1),
                 temp_gib=round(compiled.memory_analysis().temp_size_in_bytes / 2**30, 3))
    except Exception as ex:  # a way Mosaic or XLA refuses is a row (e.g. out of scoped VMEM)
      row = dict(way=way, failed=timing.failure(ex))
    print(f"{way:<11} {row}", flush=True)
    rows.append(row)
  return rows


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tokens", type=int, default=256, help="query tokens (a gather-path block)")
  ap.add_argument("--keys", type=int, default=32768, help="the sequence's keys")
  ap.add_argument("--topk", type=int, default=2048)
  ap.set_defaults(heads=128, kv_lora=512, rope=64)  # the official MLA shapes (--quick: QUICK's)
  ap.add_argument("--ways", default="xla,pallas,pallas_dma", help="backend.py gather_attention ways")
  ap.add_argument("--block", type=int, default=None, help="the kernels' slots a grid step (default BLOCK_SLOTS)")
  ap.add_argument("--kl", action="store_true", help="the forward also returns p_heads (the sparse stage's KL)")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--quick", action="store_true", help=f"tiny shapes for a CPU smoke run: {QUICK}")
  ap.add_argument("--compile-for", metavar="TOPOLOGY", help="compile only, for a TPU topology (e.g. v5e:1x1)")
  a = ap.parse_args(argv)
  if a.quick:
    for k, v in QUICK.items():
      setattr(a, k.replace("-", "_"), v)
  if a.compile_for:
    rows = compile_for(a, a.compile_for)
    print(json.dumps(dict(benchmark="sparse_mla_kernel", compile_for=a.compile_for, tokens=a.tokens, keys=a.keys,
                          topk=a.topk, heads=a.heads, block=a.block, rows=rows)))
    return
  args = inputs(a)
  peak, peak_from = peak_flops_per_device()
  e, c = a.kv_lora + a.rope, a.kv_lora
  flops_fwd = 2 * a.heads * a.topk * (e + c) * a.tokens
  flops_bwd = 2 * a.heads * a.topk * (3 * e + 2 * c) * a.tokens
  rows = []
  print(f"gather-path attention, {a.tokens} tokens x top-{a.topk} of {a.keys} keys, {a.heads} heads, e {e}, bf16, "
        f"{jax.devices()[0].device_kind}; MXU bound at {peak / 1e12:.0f} TFLOP/s ({peak_from})")
  print(f"{'way':<11} {'fwd ms':>9} {'us/token':>9} {'of bound':>9} {'fwd+bwd ms':>11} {'us/token':>9} {'of bound':>9}")
  for way in a.ways.split(","):
    try:
      row = measure(a, way, args)
    except Exception as ex:  # a way that fails to compile or run is a row; the others still run
      row = dict(way=way, failed=timing.failure(ex))
      print(f"{way:<11} failed: {row['failed']}", flush=True)
      rows.append(row)
      continue
    row["fwd_of_bound"] = flops_fwd / peak / (row["fwd_ms"] / 1e3)
    row["fwd_bwd_of_bound"] = (flops_fwd + flops_bwd) / peak / (row["fwd_bwd_ms"] / 1e3)
    rows.append(row)
    print(f"{way:<11} {row['fwd_ms']:>9.3f} {1e3 * row['fwd_ms'] / a.tokens:>9.2f} {row['fwd_of_bound']:>9.1%} "
          f"{row['fwd_bwd_ms']:>11.3f} {1e3 * row['fwd_bwd_ms'] / a.tokens:>9.2f} {row['fwd_bwd_of_bound']:>9.1%}",
          flush=True)
  print(json.dumps(dict(benchmark="sparse_mla_kernel", tokens=a.tokens, keys=a.keys, topk=a.topk, heads=a.heads,
                        e=e, block=a.block, kl=a.kl, device=jax.devices()[0].device_kind, rows=rows)))


if __name__ == "__main__":
  main()
