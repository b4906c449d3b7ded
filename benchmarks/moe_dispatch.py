"""Times the routed-expert grouped matmul: ragged_dot vs blocked, forward and forward+backward.

    python benchmarks/moe_dispatch.py                   # a few shapes on the default backend
    python benchmarks/moe_dispatch.py --shapes 4096,8,64,256,128

A shape is T,k,E,D,I (tokens, experts per token, experts, emb_dim, moe_mlp_dim). "dense" is the
all-experts einsum (E/k times the routed FLOPs), printed as a yardstick, not as an option; "1 matmul"
is the ideal: one [T*k,D]x[D,I] product per weight, the FLOPs a perfect grouped matmul would do.
Prints a table; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from MaxText.layers import moe  # noqa: E402

DEFAULT_SHAPES = ["1024,2,8,64,32", "2048,8,64,256,128", "4096,8,16,512,256"]


def _time(fn, *args, reps: int) -> float:
  jax.block_until_ready(fn(*args))  # compile
  t0 = time.perf_counter()
  for _ in range(reps):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / reps * 1e3


def _dense(x, weights, ids, wi_0, wi_1, wo):
  gates = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(ids, wi_0.shape[0], dtype=x.dtype))  # [T,E]
  h = jax.nn.silu(jnp.einsum("td,edi->tei", x, wi_0)) * jnp.einsum("td,edi->tei", x, wi_1)  # [T,E,I]
  return jnp.einsum("te,tei,eid->td", gates, h, wo)  # [T,D]


def _one_matmul(x, weights, ids, wi_0, wi_1, wo):
  rows = jnp.repeat(x, ids.shape[1], axis=0)  # [T*k,D]
  h = jax.nn.silu(rows @ wi_0[0]) * (rows @ wi_1[0])  # [T*k,I]
  return (h @ wo[0]).reshape(x.shape[0], ids.shape[1], -1).sum(1)  # [T,D]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="T,k,E,D,I")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--skip-dense-above", type=int, default=2**31, help="skip dense/ragged-on-CPU past T*E*D*I")
  args = ap.parse_args()

  print(f"backend {jax.default_backend()}, dispatch_impl() = {moe.dispatch_impl()!r}; times in ms")
  cols = ["ragged_dot", "blocked", "dense", "1 matmul"]
  print(f"{'T,k,E,D,I':>22} {'pass':>8} " + " ".join(f"{c:>11}" for c in cols))
  for spec in args.shapes:
    t, k, e, d, i = (int(v) for v in spec.split(","))
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(keys[0], (t, d))
    ids = jax.lax.top_k(jax.random.normal(keys[1], (t, e)), k)[1].astype(jnp.int32)  # [T,k] distinct
    weights = jax.nn.softmax(jax.random.normal(keys[2], (t, k)), -1)
    wi_0, wi_1 = (jax.random.normal(kk, (e, d, i)) * d ** -0.5 for kk in jax.random.split(keys[3]))
    wo = jax.random.normal(keys[4], (e, i, d)) * i ** -0.5
    impls = {
        "ragged_dot": lambda *a: moe.routed_experts(*a, impl="ragged_dot"),
        "blocked": lambda *a: moe.routed_experts(*a, impl="blocked"),
        "dense": _dense,
        "1 matmul": _one_matmul,
    }
    heavy = t * e * d * i > args.skip_dense_above
    grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 3, 4, 5))  # x, wi_0, wi_1, wo
    for name, make in (("fwd", lambda f: f), ("fwd+bwd", grad)):
      row = []
      for col, f in impls.items():
        skip = heavy and (col == "dense" or (col == "ragged_dot" and jax.default_backend() == "cpu"))
        if skip:
          row.append(f"{'skipped':>11}")
          continue
        fn = jax.jit(make(f))
        row.append(f"{_time(fn, x, weights, ids, wi_0, wi_1, wo, reps=args.reps):11.1f}")
      print(f"{spec:>22} {name:>8} " + " ".join(row))


if __name__ == "__main__":
  main()
