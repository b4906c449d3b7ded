"""The row gather of a decode step's selected slots from a paged pool, by the pool's storage dtype.

    python benchmarks/pool_gather.py                          # 16 rows x 128K slots, k = 2048 (TPU)
    python benchmarks/pool_gather.py --slots 65536 --rows 2 --k 256 --iters 2     # CPU smoke run

A decode step gathers k rows a sequence from pools of N slots (paged_cache.gather_selected: jnp.take
of [N, n] rows). On a TPU the fp8 latent pool (uint8 [N, 512]) and the bf16 k_pe pool (uint16 [N, 64])
are held in a packed tiling ((32, 128)(4, 1) for 8-bit) that a row gather does not read: XLA copies
the WHOLE pool into another layout first, every step (docs/kernels.md, 7.8 ms of a 19.6 ms 16-row 128K
step). Per storage form of the same bytes: the gather's median time, and the copies of a pool-sized
array in the compiled program (each copy's HLO line), so one run tells which form gathers in place.

Prints a table, then one JSON line. Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp

from MaxText.kernels.fp8_blocks import pick_slot, take_slots

# (name, width n of a slot in its dtype, dtype, slots a pool row, what it is): the same bytes a slot holds,
# stored differently; several slots a row: fp8_blocks.take_slots (a row gather, then the slot picked out)
FORMS = (
    ("c_kv u8[N,512]", 512, jnp.uint8, 1, "fp8 latent before 2026-12-06"),
    ("c_kv u32[N,128]", 128, jnp.uint32, 1, "fp8 latent, 4 codes a 32-bit word (the pools now)"),
    ("c_kv u32[N/4,512]", 128, jnp.uint32, 4, "fp8 latent words, 4 slots a row"),
    ("k_pe u16[N,64]", 64, jnp.uint16, 1, "bf16 rope key (the cpu row's pool)"),
    ("k_pe u32[N,32]", 32, jnp.uint32, 1, "bf16 rope key, 2 a word"),
    ("k_pe i32[N/4,128]", 32, jnp.int32, 4, "bf16 rope key, 2 a word, 4 slots a row (the tpu row's pool)"),
    ("k_pe f32[N,64]", 64, jnp.float32, 1, "rope key widened to f32"),
    ("scale f32[N,4]", 4, jnp.float32, 1, "fp8 latent scales"),
)
LATENT, ROPE, SCALES = 128, 32, 4  # 32-bit words of one fp8 slot's latent codes, bf16 k_pe, f32 scales (164: 656 bytes)

# A slot's whole latent (FlashMLA's 656-byte token) in one pool row, R slots a row: [N/R, R * (128 + 32 + 4)] words
# padded to whole 128-lane tiles, the fields at lane-aligned offsets (codes at p * 128, k_pe after the R codes at
# 32 p, scales after those at 4 p); a slot is one gathered row, each field picked out of it (fp8_blocks.pick_slot).
JOINED = ((1, "one slot a row, padded to 256 words"), (2, "2 slots a row, 328 of 384 words"),
          (4, "4 slots a row, 656 of 768 words"))


def joined_width(per_row: int) -> int:
  """Words of a joined pool row (whole 128-lane tiles)."""
  return -(-per_row * (LATENT + ROPE + SCALES) // 128) * 128


def take_joined(pool: jax.Array, ids: jax.Array, per_row: int) -> tuple:
  """pool [N / R, joined_width(R)] u32, ids [B, k] -> (codes [B,k,128], k_pe [B,k,32], scales [B,k,4]) words."""
  rows = jnp.take(pool, ids // per_row, axis=0, mode="clip")  # [B,k,W]: one gathered row a slot
  bases = (0, per_row * LATENT, per_row * (LATENT + ROPE))
  return tuple(pick_slot(rows[..., base:base + per_row * w], ids, per_row)
               for base, w in zip(bases, (LATENT, ROPE, SCALES)))  # each field: R slots' words in a row


def three_fields(pools: tuple, ids: jax.Array) -> tuple:
  """Three row gathers: codes u32[N,128], k_pe i32[N/4,128], the scales as their pool holds them."""
  codes, pe, scales = pools
  return take_slots(codes, ids, 1), take_slots(pe, ids, 4), take_slots(scales, ids, codes.shape[0] // scales.shape[0])


def layouts(slots: int) -> list:
  """(name, pools (as ShapeDtypeStructs), fn(pools, ids) -> gathered, what): one slot's latent a layout."""
  fields = (jax.ShapeDtypeStruct((slots, LATENT), jnp.uint32), jax.ShapeDtypeStruct((slots // 4, 4 * ROPE), jnp.int32))
  out = [("3 gathers, scales [N,4]", fields + (jax.ShapeDtypeStruct((slots, SCALES), jnp.float32),), three_fields,
          "codes u32[N,128], k_pe i32[N/4,128], scales f32[N,4] (the tpu row before 9430e0b)"),
         ("3 gathers, scale rows", fields + (jax.ShapeDtypeStruct((slots // 32, 32 * SCALES), jnp.float32),),
          three_fields, "scales f32[N/32,128] (the tpu row now)")]
  for per_row, what in JOINED:
    shape = jax.ShapeDtypeStruct((slots // per_row, joined_width(per_row)), jnp.uint32)
    out.append((f"joined u32[N/{per_row},{joined_width(per_row)}]", (shape,),
                lambda pools, ids, r=per_row: take_joined(pools[0], ids, r), what))
  return out


def device_ms(fn, pools, ids, slots: int, iters: int, reps: int = 9) -> float:
  """fn's device time a call: a program running it `reps` times (each on other ids, its result the loop's
  carry, so each gather is written out) against one running it once, (t_reps - t_1) / (reps - 1) from
  medians of `iters` calls: the per-call floor cancels."""
  def looped(n):
    def run(pools, ids):
      first = fn(pools, ids)
      body = lambda i, carry: fn(pools, (ids + i * 7919) % slots)  # noqa: E731
      return jax.lax.fori_loop(1, n, body, first)
    return jax.jit(run)

  times = {}
  for n in (1, reps):
    f = looped(n)
    jax.block_until_ready(f(pools, ids))
    ts = []
    for _ in range(iters):
      t0 = time.perf_counter()
      jax.block_until_ready(f(pools, ids))
      ts.append(time.perf_counter() - t0)
    times[n] = statistics.median(ts)
  return (times[reps] - times[1]) / (reps - 1) * 1e3


def pool_copies(hlo: str, elements: int) -> list[str]:
  """The HLO lines of ops (copies, fusions; not parameters) whose result holds >= elements/2 elements."""
  out = []
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (\w+)\[([\d,]*)\]", line)
    if not m or " parameter(" in line:
      continue
    n = 1
    for d in filter(None, m.group(3).split(",")):
      n *= int(d)
    if n * 2 >= elements:
      out.append(line.strip()[:200])
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--slots", type=int, default=16 * 131072)
  ap.add_argument("--rows", type=int, default=16)
  ap.add_argument("--k", type=int, default=2048)
  ap.add_argument("--iters", type=int, default=7)
  args = ap.parse_args(argv)
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); {args.slots} slots, {args.rows} x {args.k} "
        f"rows gathered; median of {args.iters}")
  ids = jax.random.randint(jax.random.key(0), (args.rows, args.k), 0, args.slots, jnp.int32)  # [B,k]
  rows = []
  print(f"{'form':>18} {'pool MB':>8} {'gather ms':>10} {'pool-sized ops':>12}")
  for name, n, dtype, per_row, what in FORMS:
    pool = jnp.zeros((args.slots // per_row, n * per_row), dtype)  # [N/R, R*n]
    fn = jax.jit(lambda pool, ids, per_row=per_row: take_slots(pool, ids, per_row))  # [B,k,n]
    compiled = fn.lower(pool, ids).compile()
    copies = pool_copies(compiled.as_text(), args.slots * n)
    jax.block_until_ready(compiled(pool, ids))
    times = []
    for _ in range(args.iters):
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(pool, ids))
      times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    print(f"{name:>18} {pool.nbytes / 1e6:>8.0f} {ms:>10.3f} {len(copies):>14}   {what}", flush=True)
    for c in copies:
      print(f"{'':>20}{c}")
    rows.append(dict(form=name, pool_bytes=pool.nbytes, ms=round(ms, 4), copies=copies))
    del pool
  print(f"\none slot's whole fp8 latent (codes, k_pe, scales), by pool layout: device ms a step's gather "
        f"(a loop's difference, the per-call floor out)\n{'layout':>24} {'pool MB':>8} {'bytes/slot':>10} {'device ms':>10}")
  joined = []
  for name, shapes, fn, what in layouts(args.slots):
    pools = tuple(jnp.zeros(a.shape, a.dtype) for a in shapes)
    nbytes = sum(a.nbytes for a in pools)
    ms = device_ms(fn, pools, ids, args.slots, args.iters)
    print(f"{name:>24} {nbytes / 1e6:>8.0f} {nbytes / args.slots:>10.0f} {ms:>10.3f}   {what}", flush=True)
    joined.append(dict(layout=name, pool_bytes=nbytes, device_ms=round(ms, 4)))
    del pools
  print(json.dumps(dict(benchmark="pool_gather", backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                        slots=args.slots, rows=args.rows, k=args.k, forms=rows, joined=joined)))


if __name__ == "__main__":
  main()
