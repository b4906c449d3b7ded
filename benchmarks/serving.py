"""Serving: the continuous-batching engine (inference/serving.py) vs a static batch of the old kind.

    python benchmarks/serving.py            # the tiny model and a mid-size one (8 layers, emb 512)
    python benchmarks/serving.py --quick    # the tiny model, fewer requests

One seeded workload, the same requests in the same arrival order for both engines, in real time:
Poisson arrivals (--rate per second), prompt lengths uniform in [--prompt-min, --prompt-max],
output lengths uniform in [--out-min, --out-max] (max_tokens, EOS ignored), greedy.
  ours     requests join the running batch at the next step, leave it when done (paged caches).
  static   the contiguous Engine of decode.py before this engine: when idle it takes every request
           that has arrived (up to --seqs; the batch padded to --seqs rows, one compiled shape)
           and runs it until its longest request is done; later arrivals wait for the next batch.
Both are compiled before the clock starts (ours: ServingEngine.warmup; static: a warm-up batch). Reported: output
tokens/s over the run, time to first token (TTFT: arrival -> first token) and time per output
token (TPOT: (finish - first token) / (tokens - 1)), p50 and p99.
Then a shared-prefix workload (--system tokens of system prompt + a short question each) through
our engine with and without the prefix cache: its TTFT.
Speculative decoding (`speculative`): the tiny model with one MTP module, trained on the synthetic
progressions for --spec-train-steps steps (an untrained MTP drafts noise), then progression
prefixes (a PRNG of their own) as prompts, all arriving at once, through our engine with
serve_speculative_tokens=0 and =--spec-tokens: spec_acceptance (accepted / drafted) and
spec_speedup (output tokens/s with / without). A table, then one JSON line. Ratios are measured
side by side in one process; never a timed assert.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from MaxText import train
from MaxText.checkpoint import model_state
from MaxText.config import pyconfig
from MaxText.data.input_pipeline import SyntheticBatches, create_data_iterator
from MaxText.inference.engine import Engine
from MaxText.inference.scheduler import SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.runtime import sharding
from MaxText.runtime.optimizers import create_optimizer

MID = dict(num_decoder_layers=8, first_num_dense_layers=1, emb_dim=512, mlp_dim=1024, num_query_heads=8,
           moe_mlp_dim=256, num_experts=8, num_experts_per_tok=2)


def workload(args, seed: int):
  """[(arrival s, prompt ids, output tokens)] sorted by arrival."""
  rng = np.random.default_rng(seed)
  t = np.cumsum(rng.exponential(1.0 / args.rate, args.requests))
  t -= t[0]
  return [(float(a), [1] + rng.integers(3, 500, rng.integers(args.prompt_min, args.prompt_max + 1) - 1).tolist(),
           int(rng.integers(args.out_min, args.out_max + 1))) for a in t]


def stats(first, finish, arrival, counts, t0, t1):
  ttft = np.array([f - a for f, a in zip(first, arrival)])
  tpot = np.array([(e - f) / max(n - 1, 1) for f, e, n in zip(first, finish, counts)])
  return {"tokens_per_s": sum(counts) / (t1 - t0), "ttft_p50": float(np.percentile(ttft, 50)),
          "ttft_p99": float(np.percentile(ttft, 99)), "tpot_p50": float(np.percentile(tpot, 50)),
          "tpot_p99": float(np.percentile(tpot, 99))}


def run_ours(engine: ServingEngine, work, warm: bool = False):
  n = len(work)
  first, finish = [None] * n, [None] * n
  requests, nxt = {}, 0
  t0 = time.perf_counter()
  while nxt < n or not engine.idle:
    now = time.perf_counter() - t0
    while nxt < n and (work[nxt][0] <= now or warm):
      a, prompt, out = work[nxt]
      requests[id(engine.add_request(prompt, SamplingParams(max_tokens=out, ignore_eos=True)))] = nxt
      nxt += 1
    if engine.idle:
      time.sleep(max(0.0, min(0.01, work[nxt][0] - now)))
      continue
    for r, _ in engine.step():
      i, t = requests[id(r)], time.perf_counter() - t0
      if first[i] is None:
        first[i] = t
      if r.finish_reason is not None:
        finish[i] = t
  t1 = time.perf_counter() - t0
  return stats(first, finish, [w[0] for w in work], [w[2] for w in work], 0.0, t1)


def run_static(engine: Engine, work, seqs: int, warm: bool = False):
  n = len(work)
  first, finish = [None] * n, [None] * n
  nxt = 0
  t0 = time.perf_counter()
  while nxt < n:
    now = time.perf_counter() - t0
    if work[nxt][0] > now and not warm:
      time.sleep(min(0.01, work[nxt][0] - now))
      continue
    batch = []
    while nxt < n and len(batch) < seqs and (work[nxt][0] <= time.perf_counter() - t0 or warm):
      batch.append(nxt)
      nxt += 1
    prompts = [work[i][1] for i in batch] + [[1]] * (seqs - len(batch))  # one compiled shape
    limit = max(work[i][2] for i in batch)
    got = [0] * seqs

    def on_token(row, tok, batch=batch, got=got):
      if row >= len(batch):
        return
      i = batch[row]
      got[row] += 1
      t = time.perf_counter() - t0
      if got[row] == 1:
        first[i] = t
      if got[row] == work[i][2]:
        finish[i] = t

    engine.generate(prompts, eos_id=None, max_new_tokens=limit, on_token=on_token)
  t1 = time.perf_counter() - t0
  return stats(first, finish, [w[0] for w in work], [w[2] for w in work], 0.0, t1)


def model_for(args, extra: dict, seqs: int, prefix_caching: bool = True):
  keys = dict(ici_data_parallelism=1, mtp_num_layers=0, max_target_length=args.max_len,
              max_prefill_length=args.prefill, prefill_chunk_size=0, serve_max_num_seqs=seqs,
              serve_max_num_tokens=args.tokens, serve_page_size=args.page, serve_prefix_caching=prefix_caching)
  cfg = pyconfig.initialize(["bench", "base.yml"], num_devices=1, **{**keys, **extra})
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  return cfg, graphdef, params, buffers


def compare(args, name: str, extra: dict) -> dict:
  cfg, g, p, b = model_for(args, extra, args.seqs)
  work = workload(args, seed=0)
  ours, static = ServingEngine(cfg, g, p, b), Engine(cfg, g, p, b)
  ours.warmup()  # every step program compiled before the clock starts
  run_static(static, work[:args.seqs], args.seqs, warm=True)
  ours.reset()  # empty pools and prefix cache; the compiled programs stay
  a = run_ours(ours, work)
  s = run_static(static, work, args.seqs)
  return {"model": name, "ours": a, "static": s}


def prefix(args, extra: dict) -> dict:
  rng = np.random.default_rng(1)
  system = [1] + rng.integers(3, 500, args.system - 1).tolist()
  work = [(0.2 * i, system + rng.integers(3, 500, 8).tolist(), 8) for i in range(args.prefix_requests)]
  out = {}
  for caching in (False, True):
    cfg, g, p, b = model_for(args, {**extra, "max_target_length": args.system + 64,
                                    "max_prefill_length": args.system + 16}, args.seqs, prefix_caching=caching)
    eng = ServingEngine(cfg, g, p, b)
    eng.warmup()
    out["with" if caching else "without"] = run_ours(eng, work)
  return out


def speculative(args) -> dict:
  """The tiny model trained with MTP, served greedy with and without MTP drafts, side by side."""
  keys = dict(ici_data_parallelism=1, mtp_num_layers=1, max_target_length=args.max_len, dataset_type="synthetic",
              steps=args.spec_train_steps, max_prefill_length=args.prefill, prefill_chunk_size=0,
              serve_max_num_seqs=args.spec_seqs, serve_max_num_tokens=args.tokens, serve_page_size=args.page)
  cfg = pyconfig.initialize(["bench", "base.yml"], num_devices=1, **keys)
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  tx = create_optimizer(cfg, train.trainable_labels(cfg, params))
  state = {"params": params, "buffers": buffers, "opt_state": jax.jit(tx.init)(params), "step": np.int32(0)}
  step, data = jax.jit(train.make_train_step(cfg, graphdef, tx), donate_argnums=(0,)), create_data_iterator(cfg)
  t0 = time.perf_counter()
  for _ in range(cfg.steps):
    state, metrics = step(state, train.prepare_batch(cfg, next(data)))
  trained = {k: round(float(metrics[k]), 3) for k in ("lm_loss", "mtp_loss", "accuracy")}
  trained["seconds"] = round(time.perf_counter() - t0, 1)
  rng = np.random.default_rng(2)
  rows = SyntheticBatches(cfg, 0, 1, salt=0x5EC)  # progressions for prompts: random starts and steps
  work = [(0.0, rows.row(0, i)["inputs"][:int(rng.integers(args.prompt_min, args.prompt_max + 1))].tolist(),
           int(rng.integers(args.out_min, args.out_max + 1))) for i in range(args.requests)]
  out = {"train": trained}
  for k in (0, args.spec_tokens):
    eng = ServingEngine(pyconfig.initialize(["bench", "base.yml"], num_devices=1, **keys, serve_speculative_tokens=k),
                        graphdef, state["params"], state["buffers"])
    eng.warmup()
    out[k] = run_ours(eng, work, warm=True)  # every request at once: decode speed, not the arrival rate
    out[k]["acceptance"] = eng.stats()["spec_acceptance"]
  out["acceptance"], out["speedup"] = out[args.spec_tokens]["acceptance"], \
      out[args.spec_tokens]["tokens_per_s"] / out[0]["tokens_per_s"]
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="the tiny model only, 16 requests, a 256-token system prompt")
  ap.add_argument("--requests", type=int, default=48)
  ap.add_argument("--rate", type=float, default=8.0, help="arrivals per second")
  ap.add_argument("--seqs", type=int, default=16, help="concurrent sequences (ours) / static batch rows")
  ap.add_argument("--tokens", type=int, default=512, help="serve_max_num_tokens")
  ap.add_argument("--page", type=int, default=16)
  ap.add_argument("--prompt-min", type=int, default=8)
  ap.add_argument("--prompt-max", type=int, default=96)
  ap.add_argument("--out-min", type=int, default=4)
  ap.add_argument("--out-max", type=int, default=48)
  ap.add_argument("--max-len", type=int, default=160)
  ap.add_argument("--prefill", type=int, default=96)
  ap.add_argument("--system", type=int, default=1024, help="shared system prompt tokens")
  ap.add_argument("--prefix-requests", type=int, default=8)
  ap.add_argument("--spec-tokens", type=int, default=1, help="serve_speculative_tokens measured against 0")
  ap.add_argument("--spec-seqs", type=int, default=8, help="serve_max_num_seqs of the speculative comparison")
  ap.add_argument("--spec-train-steps", type=int, default=300, help="steps training the tiny model with MTP")
  args = ap.parse_args()
  if args.quick:
    args.requests, args.system = 16, 256
  rows = [compare(args, "tiny", {})]
  if not args.quick:
    rows.append(compare(args, "mid (8 layers, emb 512)", MID))
  pre = prefix(args, {})
  spec = speculative(args)
  print(f"{args.requests} requests, Poisson {args.rate}/s, prompts {args.prompt_min}-{args.prompt_max}, "
        f"outputs {args.out_min}-{args.out_max} tokens, {args.seqs} sequences; greedy, EOS ignored")
  print(f"{'model':>24} {'engine':>8} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
  for r in rows:
    for eng in ("ours", "static"):
      m = r[eng]
      print(f"{r['model']:>24} {eng:>8} {m['tokens_per_s']:8.1f} {m['ttft_p50']:9.3f} {m['ttft_p99']:9.3f} "
            f"{m['tpot_p50']:9.4f} {m['tpot_p99']:9.4f}")
  print(f"shared prefix ({args.system}-token system prompt, {args.prefix_requests} requests): TTFT p50 "
        f"{pre['without']['ttft_p50']:.3f} s without the prefix cache, {pre['with']['ttft_p50']:.3f} s with it")
  k, tr = args.spec_tokens, spec["train"]
  print(f"speculative ({k} MTP drafts a step; tiny model + MTP trained {args.spec_train_steps} steps in "
        f"{tr['seconds']} s: lm loss {tr['lm_loss']}, mtp loss {tr['mtp_loss']}; {args.requests} requests at once, "
        f"{args.spec_seqs} sequences): {spec[0]['tokens_per_s']:.1f} tok/s without, {spec[k]['tokens_per_s']:.1f} "
        f"with; acceptance {spec['acceptance']:.3f}; TPOT p50 {spec[0]['tpot_p50']:.4f} / {spec[k]['tpot_p50']:.4f} s")
  tiny = rows[0]
  print(json.dumps({
      "throughput_ratio": round(tiny["ours"]["tokens_per_s"] / tiny["static"]["tokens_per_s"], 3),
      "ttft_p50_ratio": round(tiny["static"]["ttft_p50"] / tiny["ours"]["ttft_p50"], 3),
      "prefix_ttft_ratio": round(pre["without"]["ttft_p50"] / pre["with"]["ttft_p50"], 3),
      "spec_acceptance": round(spec["acceptance"], 3), "spec_speedup": round(spec["speedup"], 3),
      "rows": {r["model"]: {"throughput_ratio": round(r["ours"]["tokens_per_s"] / r["static"]["tokens_per_s"], 3),
                            "ttft_p50_ratio": round(r["static"]["ttft_p50"] / r["ours"]["ttft_p50"], 3)}
               for r in rows}}))


if __name__ == "__main__":
  main()
