"""MoE dispatch: the grouped matmul (ragged_dot vs blocked), expert parallelism over meshes, and
the one-layer 671B memory. Prints tables; asserts nothing about time.

    python benchmarks/moe_dispatch.py                   # all three tables
    python benchmarks/moe_dispatch.py --tables matmul --shapes 4096,8,64,256,128   # T,k,E,D,I
    python benchmarks/moe_dispatch.py --tables mesh     # per-device memory + step time, 1..8 devices
    python benchmarks/moe_dispatch.py --tables 671b     # compile only: official dims on 64 devices

"matmul": ms per way, the median of --reps calls ("dense", all experts, a yardstick; "1 matmul", the ideal
FLOPs). "mesh": one MoE layer's per-device temp memory and step time on data / expert meshes of simulated CPU
devices. "671b": one layer at the official dims, fsdp 8 x expert 8, compiled, never run: per-device memory and the
collectives.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import timing  # noqa: E402
from MaxText.config import pyconfig  # noqa: E402
from MaxText.kernels import moe_experts  # noqa: E402
from MaxText.kernels.moe_experts import ExpertWeights  # noqa: E402
from MaxText.layers import moe  # noqa: E402
from MaxText.layers.linears import dtype_of  # noqa: E402
from MaxText.runtime import aot, sharding

DEFAULT_SHAPES = ["1024,2,8,64,32", "2048,8,64,256,128", "4096,8,16,512,256"]


def _dense(x, weights, ids, wi_0, wi_1, wo):
  gates = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(ids, wi_0.shape[0], dtype=x.dtype))  # [T,E]
  h = jax.nn.silu(jnp.einsum("td,edi->tei", x, wi_0)) * jnp.einsum("td,edi->tei", x, wi_1)  # [T,E,I]
  return jnp.einsum("te,tei,eid->td", gates, h, wo)  # [T,D]


def _one_matmul(x, weights, ids, wi_0, wi_1, wo):
  rows = jnp.repeat(x, ids.shape[1], axis=0)  # [T*k,D]
  h = jax.nn.silu(rows @ wi_0[0]) * (rows @ wi_1[0])  # [T*k,I]
  return (h @ wo[0]).reshape(x.shape[0], ids.shape[1], -1).sum(1)  # [T,D]


def _layer_grad(cfg, devices, batch: int, seq: int, run: bool, reps: int = 2):
  """Compiles (and with `run` times) the MoE layer's forward + backward on `devices`:
  (per-device temp bytes, per-device argument bytes, the collectives "op count, ...", seconds or None)."""
  mesh = sharding.create_mesh(cfg, devices)

  def loss(state, graphdef, x):
    y, aux = nnx.merge(graphdef, state)(x)
    return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(aux["expert_load"])

  with mesh, sharding.logical_rules(cfg, mesh):
    graphdef, state = aot.abstract_module(lambda: moe.DeepSeekMoE(cfg, rngs=nnx.Rngs(0)), cfg, mesh)
    x = aot.abstract_array((batch, seq, cfg.emb_dim), dtype_of(cfg.dtype),
                           ("activation_batch", "activation_length", "activation_embed"), cfg, mesh)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 2)), static_argnums=1).lower(state, graphdef, x).compile()
    mem = compiled.memory_analysis()
    secs = None
    if run:
      shardings = jax.tree.map(lambda a: a.sharding, state)
      real = jax.jit(lambda: nnx.split(moe.DeepSeekMoE(cfg, rngs=nnx.Rngs(0)))[1], out_shardings=shardings)()
      xs = jax.device_put(np.random.default_rng(0).normal(size=x.shape).astype(x.dtype), x.sharding)
      secs = timing.median_ms(lambda: compiled(real, xs), reps, warmup=0) / 1e3
    coll = ", ".join(f"{k} {v}" for k, v in aot.collective_counts(compiled.as_text()).items()) or "-"
    return mem.temp_size_in_bytes, mem.argument_size_in_bytes, coll, secs


def mesh_table(reps: int, counts) -> None:
  print("\none MoE layer fwd+bwd, E=64 k=8 D=512 I=256, 16 x 1024 tokens (fixed); moe_capacity_factor -1 "
        f"(dropless) and 1.25; median of {reps} steps")
  print(f"{'mesh':>14} {'n':>2} {'cf':>5} {'temp MiB/dev':>13} {'vs n=1':>7} {'step s':>7}  collectives")
  dims = ["num_experts=64", "num_experts_per_tok=8", "n_routing_groups=8", "topk_routing_group=4", "emb_dim=512",
          "moe_mlp_dim=256", "global_batch_size=16"]
  base = None
  for kind in ("data", "expert", "data x expert"):
    for n in counts:
      if kind == "data x expert" and n < 4:
        continue
      axes = {"data": {"data": n}, "expert": {"data": 1, "expert": n},
              "data x expert": {"data": 2, "expert": n // 2}}[kind]
      for cf in ((-1.0, 1.25) if "expert" in kind and n > 1 else (-1.0,)):
        cfg = pyconfig.initialize(["bench", "base.yml", *dims, f"moe_capacity_factor={cf}",
                                   *[f"ici_{a}_parallelism={v}" for a, v in axes.items()]], num_devices=n)
        temp, _, coll, secs = _layer_grad(cfg, jax.devices()[:n], 16, 1024, run=True, reps=reps)
        base = base or (temp if n == 1 else None)
        ratio = f"{temp / base:>7.2f}" if base else f"{'-':>7}"
        print(f"{kind:>14} {n:>2} {cf:>5} {temp / 2**20:>13.1f} {ratio} {secs:>7.2f}  {coll}", flush=True)


def table_671b() -> None:
  print("\none DeepSeekMoE layer, official 671B dims, bf16, batch 64 x 4096, 64 devices (fsdp 8 x expert 8); "
        "forward + backward, compiled only")
  print(f"{'cf':>5} {'temp GiB/dev':>13} {'args GiB/dev':>13} {'compile s':>10}  collectives")
  for cf in (-1.0, 1.25):
    cfg = pyconfig.initialize(["bench", "base.yml", "model_name=deepseek3.2-671b", "global_batch_size=64",
                               "ici_data_parallelism=1", "ici_fsdp_parallelism=8", "ici_expert_parallelism=8",
                               f"moe_capacity_factor={cf}"], num_devices=64)
    t = time.perf_counter()
    temp, args_b, coll, _ = _layer_grad(cfg, jax.devices()[:64], 64, 4096, run=False)
    secs = time.perf_counter() - t
    print(f"{cf:>5} {temp / 2**30:>13.2f} {args_b / 2**30:>13.2f} {secs:>10.1f}  {coll}", flush=True)


def matmul_table(args) -> None:
  print(f"backend {jax.default_backend()}, dispatch_impl() = {moe_experts.dispatch_impl()!r}; times in ms")
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
        "ragged_dot": lambda x, w, ids, *e: moe_experts.weighted_experts(x, w, ids, ExpertWeights(*e), impl="ragged_dot"),
        "blocked": lambda x, w, ids, *e: moe_experts.weighted_experts(x, w, ids, ExpertWeights(*e), impl="blocked"),
        "dense": _dense,
        "1 matmul": _one_matmul,
    }
    heavy = t * e * d * i > 2**31  # dense, and ragged_dot on the CPU, skipped past this
    grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 3, 4, 5))  # x, wi_0, wi_1, wo
    for name, make in (("fwd", lambda f: f), ("fwd+bwd", grad)):
      row = []
      for col, f in impls.items():
        skip = heavy and (col == "dense" or (col == "ragged_dot" and jax.default_backend() == "cpu"))
        if skip:
          row.append(f"{'skipped':>11}")
          continue
        fn = jax.jit(make(f))
        row.append(f"{timing.median_ms(lambda: fn(x, weights, ids, wi_0, wi_1, wo), args.reps, warmup=0):11.1f}")
      print(f"{spec:>22} {name:>8} " + " ".join(row))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tables", nargs="*", default=["matmul", "mesh", "671b"], choices=["matmul", "mesh", "671b"])
  ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="matmul table: T,k,E,D,I")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--devices", nargs="*", type=int, default=[1, 2, 4, 8], help="mesh table: device counts")
  args = ap.parse_args()
  if "matmul" in args.tables:
    matmul_table(args)
  if "mesh" in args.tables:
    mesh_table(args.reps, args.devices)
  if "671b" in args.tables:
    table_671b()


if __name__ == "__main__":
  main()
